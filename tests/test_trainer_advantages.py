"""Advantages against numbers worked out by hand (population std, eps = 1e-4)."""

import math

import pytest

from trainer.advantages import compute_advantages, group_advantages, has_reward_spread

EPS = 1e-4


def test_group_scaling_hand_example():
    # rewards [1, 0, 0, 1]: mean 0.5; population std sqrt(4 * 0.25 / 4) = 0.5.
    got = group_advantages([1.0, 0.0, 0.0, 1.0], "group", eps=EPS)
    a = 0.5 / (0.5 + 1e-4)  # = 0.99980003999...
    assert got == pytest.approx([a, -a, -a, a], abs=1e-12)
    assert a == pytest.approx(0.9998000399920016, abs=1e-15)


def test_no_scaling_only_centres():
    assert group_advantages([1.0, 0.0, 0.0, 1.0], "none") == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([3.0, 1.0], "none") == [1.0, -1.0]


def test_batch_scaling_uses_every_reward_of_the_batch():
    groups = {"a": [1.0, 0.0, 0.0, 1.0], "same": [2.0, 2.0, 2.0, 2.0], "c": [0.0, 3.0]}
    # All ten rewards: mean 13/10 = 1.3. Squared deviations:
    #   0.3^2 * 2 (the ones) + 1.3^2 * 3 (the zeros) + 0.7^2 * 4 (the twos) + 1.7^2 (the three)
    #   = 0.18 + 5.07 + 1.96 + 2.89 = 10.1  -> population variance 1.01.
    std = math.sqrt(1.01)
    adv, skipped = compute_advantages(groups, "batch", eps=EPS)
    assert skipped == ["same"]
    assert adv["a"] == pytest.approx([x / (std + EPS) for x in (0.5, -0.5, -0.5, 0.5)], abs=1e-12)
    assert adv["c"] == pytest.approx([-1.5 / (std + EPS), 1.5 / (std + EPS)], abs=1e-12)


def test_batch_scaling_needs_the_batch_std():
    with pytest.raises(ValueError, match="compute_advantages"):
        group_advantages([1.0, 0.0], "batch")


def test_constant_group_is_skipped_and_reported():
    adv, skipped = compute_advantages({"g1": [0.0, 1.0], "flat": [0.5, 0.5, 0.5]}, "group")
    assert skipped == ["flat"]
    # [0, 1]: mean 0.5, std 0.5.
    assert adv == {"g1": pytest.approx([-0.5 / 0.5001, 0.5 / 0.5001], abs=1e-12)}
    # Skipped whatever the scaling: a centred constant group is all zeros.
    assert compute_advantages({"flat": [1.0, 1.0]}, "none") == ({}, ["flat"])


def test_has_reward_spread():
    assert has_reward_spread([0.0, 1.0])
    assert not has_reward_spread([0.3, 0.3, 0.3])
    assert not has_reward_spread([0.3, 0.3 + 1e-9])
    assert not has_reward_spread([1.0])
    assert not has_reward_spread([])


def test_bad_input_fails_with_a_message():
    with pytest.raises(ValueError, match="scale_rewards"):
        compute_advantages({"g": [0.0, 1.0]}, "std")
    with pytest.raises(ValueError, match="non-finite"):
        compute_advantages({"g": [0.0, float("nan")]})
    with pytest.raises(ValueError, match="no rewards"):
        group_advantages([])


def test_huge_rewards_scale_to_the_same_advantages_without_overflow():
    # (x - m) ** 2 overflows a float from |x - m| ~ 1e154; the advantages are scale-free: a group
    # of [1e200, 0] is a group of [1, 0] (by hand: mean 0.5e200, std 0.5e200, advantages +-1).
    assert group_advantages([1e200, 0.0], "group", eps=EPS) == pytest.approx([1.0, -1.0], abs=1e-12)
    assert group_advantages([-3e160, 3e160, 0.0], "group", eps=EPS) == pytest.approx(
        [-math.sqrt(1.5), math.sqrt(1.5), 0.0], abs=1e-12
    )
