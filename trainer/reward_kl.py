"""`--reward-kl`: each trajectory's reward less its KL to the base model, before the group's
advantages are taken (`trainer.advantages.kl_shaped_advantages` has the why).

A trajectory's KL is the k1 estimate summed over its trained tokens, log mu - log pi_ref, where
mu is the behaviour policy that sampled the token (its logprob recorded at sampling time) and
pi_ref the base model scored by the step's reference forward, at the same temperature. A token
whose behaviour logprob is unknown (an upstream's reply recorded without logprobs) adds nothing.
The step runs this once the reference forward is done and before the first policy pass, so its
rows train with the shaped advantages; under a team each rank sums its own rows and the sums are
added across ranks, so every rank shapes with the whole batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from trainer.advantages import kl_shaped_advantages
from trainer.packing import PackedRow
from trainer.types import Sample


def sample_kls(rows: Sequence[PackedRow], refs: Sequence[torch.Tensor], n_samples: int) -> list[float]:
    """Per sample (indices as in `pack`'s list): the sum over its trained tokens, in `rows`, of
    log mu - log pi_ref. `refs` are the rows' reference logprobs, aligned with their tokens."""
    kl = torch.zeros(n_samples, dtype=torch.float64)
    for row, ref_T in zip(rows, refs, strict=True):
        behaviour_T = row.old_logprobs_T
        known_T = row.loss_mask_T & ~torch.isnan(behaviour_T) & (row.segment_ids_T >= 0)
        per_token = (behaviour_T.double() - ref_T.detach().double().cpu())[known_T]
        kl.index_add_(0, row.segment_ids_T[known_T], per_token)
    return kl.tolist()


def shape(
    samples: Sequence[Sample],
    kls: Sequence[float],
    coef: float,
    scale_rewards: str,
) -> tuple[list[float], dict[str, float], dict[str, float]]:
    """(advantage per sample, advantage per trajectory, KL per trajectory) from the samples'
    rewards less `coef` times their trajectory's KL (a trajectory's samples add up)."""
    rewards: dict[str, dict[str, float]] = {}
    by_trajectory: dict[str, float] = {}
    for sample, kl in zip(samples, kls, strict=True):
        if sample.reward is None:
            raise ValueError(f"--reward-kl needs each sample's reward; trajectory {sample.trajectory_id!r} has none")
        rewards.setdefault(sample.group_id, {})[sample.trajectory_id] = sample.reward
        by_trajectory[sample.trajectory_id] = by_trajectory.get(sample.trajectory_id, 0.0) + kl
    advantages = kl_shaped_advantages(rewards, by_trajectory, coef, scale_rewards)
    return [advantages[s.trajectory_id] for s in samples], advantages, by_trajectory


def with_advantages(rows: Sequence[PackedRow], advantages: Sequence[float]) -> list[PackedRow]:
    """`rows` whose tokens carry `advantages[their sample]` (0 on padding)."""
    table = torch.tensor([*advantages, 0.0], dtype=torch.float32)  # index -1 (padding) reads the 0
    return [dataclasses.replace(row, advantages_T=table[row.segment_ids_T]) for row in rows]


def finite(kls: Sequence[float]) -> str | None:
    """Why the KLs cannot shape rewards (one is NaN or infinite), or None."""
    bad = [k for k in kls if not math.isfinite(k)]
    return f"a trajectory's KL to the base is {bad[0]}" if bad else None
