"""bench/shout_frontier.py's bound, on a hand-computed example: the most English any guard that
reweights the base by a non-decreasing function of the reward can reach at a capitals share, and
the sharpened tilt (`--reward-kl-sharpen`) that passes it by weighing the base's likelihood too."""

import math

import pytest

from bench.shout_frontier import best_english_at, beta_at_caps, sharpened_tilt, weighted

# (capitals share, words, English words) of three kinds of reply, ten of each
LOWER = (0.0, 4, 4)  # "well hello there friend"
CAPS_ENGLISH = (0.8, 2, 2)  # "HELLO THERE"
CAPS_GIBBERISH = (1.0, 1, 0)  # "LADERMARKEL"
COUNTS = [LOWER] * 10 + [CAPS_ENGLISH] * 10 + [CAPS_GIBBERISH] * 10


def test_weighted_shares_count_words_not_replies():
    shares = weighted(COUNTS, [1.0] * 30)
    assert shares["caps"] == 0.6
    assert shares["english"] == 6 / 7  # (4 + 2 + 0) English words of (4 + 2 + 1)
    assert shares["ess"] == 30


def test_best_at_caps_mixes_the_base_with_its_capital_replies():
    # The thresholds' policies: everything (caps 0.6, 7/3 words, 2 English a reply), the two
    # capital kinds (0.9, 1.5, 1.0), the gibberish alone (1.0, 1, 0). Keeping only the English
    # capitals would need a weight that falls with the reward. At caps 0.7 the best is a third
    # on the capital kinds and two thirds on everything: (1/3 + 4/3) / (1/2 + 14/9) = 30/37.
    best = best_english_at(COUNTS, 0.7, min_samples=1)
    assert abs(best["english"] - 30 / 37) < 1e-12
    assert best["thresholds"] == [0.0, 0.05]
    assert abs(best["mass_on_higher"] - 1 / 3) < 1e-12


def test_no_policy_reaches_a_share_above_every_reply():
    assert best_english_at([LOWER] * 10, 0.7, min_samples=1)["english"] is None


def test_a_tilt_that_also_weighs_the_bases_likelihood_passes_the_bound():
    # The base finds the English capitals likelier (log pi_ref -10) than the gibberish (-20), as
    # smollm2 does (median -18.6 against -24.8 over 6 tokens). pi_ref^2 exp(r / 0.2) weighs the
    # samples (drawn from pi_ref) by pi_ref exp(r / 0.2): e^-10, e^(-10 + 4), e^(-20 + 5).
    logprobs = [-10.0] * 10 + [-10.0] * 10 + [-20.0] * 10
    w_lower, w_caps, w_gibberish = math.exp(-10), math.exp(-6), math.exp(-15)
    shares = weighted(COUNTS, sharpened_tilt(COUNTS, logprobs, alpha=2.0, beta=0.2))
    total = w_lower + w_caps + w_gibberish
    assert shares["caps"] == pytest.approx((0.8 * w_caps + 1.0 * w_gibberish) / total)
    assert shares["english"] == pytest.approx((4 * w_lower + 2 * w_caps) / (4 * w_lower + 2 * w_caps + w_gibberish))
    # At capitals 0.7 it keeps more English than any reweighting by the reward alone (30/37).
    beta = beta_at_caps(COUNTS, logprobs, 2.0, 0.7)
    at_aim = weighted(COUNTS, sharpened_tilt(COUNTS, logprobs, 2.0, beta))
    assert at_aim["caps"] == pytest.approx(0.7, abs=1e-6)
    assert at_aim["english"] > 0.99 > 30 / 37
    # alpha 1 is the plain exp tilt, which cannot (it is a non-decreasing reweighting).
    plain = weighted(COUNTS, sharpened_tilt(COUNTS, logprobs, 1.0, beta_at_caps(COUNTS, logprobs, 1.0, 0.7)))
    assert plain["english"] <= 30 / 37 + 1e-9
