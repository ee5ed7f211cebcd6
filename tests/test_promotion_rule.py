"""The canary's decision rule against published formulas (scipy) and hand-computed examples."""

import math
import random

import pytest
from scipy import stats

from gateway.promotion import rule


def test_the_difference_and_its_error_are_welchs():
    candidate, incumbent = [1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    found = rule.compare({"a": candidate}, {"a": incumbent}, margin=0.1, min_sessions=4)
    # By hand: means 0.75 and 0.5, sample variances 0.25 and 0.3: se = sqrt(0.25/4 + 0.3/6).
    assert found.difference == pytest.approx(0.25)
    assert found.std_error == pytest.approx(math.sqrt(0.0625 + 0.05))
    welch = stats.ttest_ind(candidate, incumbent, equal_var=False)
    assert found.difference / found.std_error == pytest.approx(welch.statistic)
    assert (found.candidate_sessions, found.incumbent_sessions, found.keys, found.look) == (4, 6, 1, 1)


def test_task_keys_are_compared_within_and_pooled_by_their_precision():
    candidate = {"a": [1.0, 1.0], "b": [0.0, 1.0, 0.0, 1.0], "only-candidate": [5.0]}
    incumbent = {"a": [1.0, 0.0, 1.0, 0.0], "b": [0.0, 0.0], "only-incumbent": [9.0]}
    found = rule.compare(candidate, incumbent, margin=0.1, min_sessions=2)
    # By hand. Keys both sides have: a (2 vs 4), b (4 vs 2); d_a = 1 - 0.5, d_b = 0.5 - 0 (equal).
    # Weights n_c n_i / (n_c + n_i) = 8/6 each: w = 1/2, 1/2.  d = 0.5.
    # Within-key variances: candidate (a: 0 ss, 1 df; b: 1.0 ss, 3 df) = 1/4;
    # incumbent (a: 1.0 ss, 3 df; b: 0 ss, 1 df) = 1/4.
    # se^2 = 1/4 (0.25/2 + 0.25/4) + 1/4 (0.25/4 + 0.25/2) = 0.09375.
    assert found.keys == 2 and found.candidate_sessions == 6 and found.incumbent_sessions == 6
    assert found.difference == pytest.approx(0.5)
    assert found.std_error == pytest.approx(math.sqrt(0.09375))


def test_the_critical_value_and_the_power_follow_the_normal_distribution():
    assert rule.z_per_look() == pytest.approx(stats.norm.ppf(1 - rule.ALPHA / rule.LOOKS))
    se = 0.5 * math.sqrt(1 / 100 + 1 / 900)
    assert rule.power(0.1, 0.5, 100, 900) == pytest.approx(stats.norm.cdf(0.1 / se - stats.norm.ppf(0.99)))


def test_equal_steps_are_promoted_a_clear_drop_is_rejected_noise_waits():
    same = rule.compare({"k": [1.0] * 10}, {"k": [1.0] * 40}, margin=0.1, min_sessions=10)
    assert rule.decide(same) == "promote"  # a converged task: the candidate equals its incumbent
    worse = rule.compare({"k": [0.5] * 10}, {"k": [1.0] * 40}, margin=0.1, min_sessions=10)
    assert rule.decide(worse) == "reject"
    noisy = rule.compare({"k": [0.0, 1.0] * 5}, {"k": [0.0, 1.0] * 20}, margin=0.1, min_sessions=10)
    assert rule.decide(noisy) == "wait"  # d = 0, but se = 0.18: neither bound clears
    early = rule.compare({"k": [1.0] * 9}, {"k": [1.0] * 40}, margin=0.1, min_sessions=10)
    assert early.look == 0 and rule.decide(early) == "wait"


def test_looking_at_every_look_keeps_wrong_promotions_under_alpha():
    # The candidate is worse by exactly the margin (Bernoulli 0.5 against 0.6): any promotion is
    # wrong. Looking at all five looks, the error stays under alpha (Bonferroni over the looks).
    rng = random.Random(7)
    runs, wrong, n = 2000, 0, 40
    for _ in range(runs):
        cand = [float(rng.random() < 0.5) for _ in range(n * rule.LOOKS)]
        inc = [float(rng.random() < 0.6) for _ in range(4 * n * rule.LOOKS)]
        for look in range(1, rule.LOOKS + 1):
            found = rule.compare({"k": cand[: n * look]}, {"k": inc[: 4 * n * look]}, margin=0.1, min_sessions=n)
            verdict = rule.decide(found)
            if verdict != "wait":
                wrong += verdict == "promote"
                break
    assert wrong / runs < rule.ALPHA


@pytest.mark.parametrize("reward", [0.1, 0.3, 0.9])
def test_a_candidate_equal_to_its_incumbent_on_a_converged_task_is_promoted(reward):
    # Every session of both steps earns the same partial credit (a converged task): no spread, d = 0.
    # The means of 12 and of 100 such rewards differ in their last bit; that is not a difference.
    found = rule.compare({"a": [reward] * 12, "b": [1.0] * 12}, {"a": [reward] * 100, "b": [1.0] * 90}, 0.1, 6)
    assert rule.decide(found) == "promote"
    assert found.difference == 0.0 and found.std_error == 0.0


def test_with_no_margin_a_candidate_exactly_equal_is_still_promoted():
    # --canary-margin 0 ("never a worse step"): a candidate that earns what its incumbent earns is
    # not worse; waiting would end in a rejection by --canary-max-wait.
    found = rule.compare({"a": [1.0] * 6}, {"a": [1.0] * 20}, 0.0, 6)
    assert rule.decide(found) == "promote"
