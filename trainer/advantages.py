"""Group-relative advantages (GRPO): pure Python, no torch.

A group is the set of rollouts of one task. Each trajectory's advantage is its reward
minus the group's mean, optionally divided by a standard deviation. Groups whose rewards
are all equal carry no signal (every advantage would be 0), so they are skipped and
reported, for the caller to mark them so in the store.

Standard deviations are *population* ones (ddof=0). The group is the whole set being
compared, not a sample from which to estimate a wider variance, so ddof=0 makes the scaled
advantages of a group exactly unit-variance, and it is defined for any group size. TRL
uses torch.std's default (unbiased, ddof=1), which for G rollouts gives advantages
sqrt((G-1)/G) times ours: a global rescale (0.71 at G=2, 0.94 at G=8) that only acts like
a learning-rate change.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

SCALE_REWARDS = ("group", "batch", "none")
"""group: divide by the group's std (GRPO); batch: by the std of every reward in the batch
(Liu et al. 2025, "tricks or traps": group mean, batch std); none: only centre (Dr. GRPO)."""


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _population_std(xs: Sequence[float]) -> float:
    # Deviations scaled by the largest first: (x - m) ** 2 overflows a float from |x - m| ~ 1e154.
    m = _mean(xs)
    largest = max(abs(x - m) for x in xs)
    if largest == 0.0:
        return 0.0
    return largest * math.sqrt(sum(((x - m) / largest) ** 2 for x in xs) / len(xs))


def _check_rewards(rewards_G: Sequence[float], what: str) -> None:
    if len(rewards_G) == 0:
        raise ValueError(f"{what} has no rewards")
    for r in rewards_G:
        if not math.isfinite(r):
            raise ValueError(f"{what} has a non-finite reward: {r}")


def _check_scale(scale_rewards: str) -> None:
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}, got {scale_rewards!r}")


def has_reward_spread(rewards_G: Sequence[float], tol: float = 1e-6) -> bool:
    """Whether the group's rewards differ by more than `tol` (else nothing to learn)."""
    return len(rewards_G) > 0 and max(rewards_G) - min(rewards_G) > tol


def group_advantages(
    rewards_G: Sequence[float],
    scale_rewards: str = "group",
    eps: float = 1e-4,
    batch_std: float | None = None,
) -> list[float]:
    """Advantages of one group: `(r - mean_G) / (std + eps)`, or `r - mean_G` for "none".

    `eps` keeps near-constant groups from blowing up. "batch" divides by `batch_std`, the
    population std of every reward in the batch, which only `compute_advantages` knows.
    """
    _check_scale(scale_rewards)
    _check_rewards(rewards_G, "group")
    centred_G = [r - _mean(rewards_G) for r in rewards_G]
    if scale_rewards == "none":
        return centred_G
    if scale_rewards == "group":
        std = _population_std(rewards_G)
    elif batch_std is None:
        raise ValueError("scale_rewards='batch' needs batch_std; use compute_advantages")
    else:
        std = batch_std
    return [a / (std + eps) for a in centred_G]


def compute_advantages(
    groups: Mapping[str, Sequence[float]],
    scale_rewards: str = "group",
    eps: float = 1e-4,
    tol: float = 1e-6,
) -> tuple[dict[str, list[float]], list[str]]:
    """Advantages of a batch of groups, keyed like `groups` (group id -> rewards in order).

    Returns `(advantages by group id, skipped group ids)`; a group is skipped when its
    rewards have no spread (`has_reward_spread`). For "batch", the std is over every
    reward of the batch, skipped groups included: they are part of the batch's reward
    distribution even though they contribute no gradient.
    """
    _check_scale(scale_rewards)
    for group_id, rewards_G in groups.items():
        _check_rewards(rewards_G, f"group {group_id!r}")
    batch_std = None
    if scale_rewards == "batch":
        batch_std = _population_std([r for rewards_G in groups.values() for r in rewards_G])
    advantages: dict[str, list[float]] = {}
    skipped: list[str] = []
    for group_id, rewards_G in groups.items():
        if not has_reward_spread(rewards_G, tol):
            skipped.append(group_id)
            continue
        advantages[group_id] = group_advantages(rewards_G, scale_rewards, eps, batch_std)
    return advantages, skipped


def kl_shaped_advantages(
    rewards: Mapping[str, Mapping[str, float]],
    kls: Mapping[str, float],
    coef: float,
    scale_rewards: str = "group",
    eps: float = 1e-4,
) -> dict[str, float]:
    """Advantages from each trajectory's reward less `coef` times its KL to the base model.

    `rewards`: group id -> trajectory id -> reward; `kls`: trajectory id -> its KL (summed over
    its trained tokens). This is the KL penalty of RLHF's PPO (InstructGPT's r - beta KL, verl's
    `use_kl_in_reward`), put in the reward *before* the group is centred and scaled. A KL term
    in the loss instead (`--beta`) is weighed against advantages that the group's std has
    already scaled to unit size, however small the reward differences behind them, so late in a
    run it loses to ever finer reward differences; here the trade is fixed in the reward's own
    units. Scaled as `group_advantages` does; "batch" divides by the std of every shaped reward
    given. Returns trajectory id -> advantage.
    """
    _check_scale(scale_rewards)
    shaped = {gid: [reward - coef * kls[tid] for tid, reward in by_id.items()] for gid, by_id in rewards.items()}
    batch_std = None
    if scale_rewards == "batch":
        batch_std = _population_std([r for rewards_G in shaped.values() for r in rewards_G])
    out: dict[str, float] = {}
    for gid, by_id in rewards.items():
        out.update(zip(by_id, group_advantages(shaped[gid], scale_rewards, eps, batch_std), strict=True))
    return out
