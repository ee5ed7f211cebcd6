"""`--reward-kl`: each trajectory's reward less its KL to the base model, before the group's
advantages are taken (`trainer.advantages.kl_shaped_advantages` has the why).

`--reward-kl-sharpen A` takes the KL to the base sharpened to pi_ref^A instead (`shape` has the
why). A trajectory's KL is the k1 estimate summed over its trained tokens, log mu - log pi_ref, where
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
    return sample_sums(rows, refs, n_samples)[0]


def sample_sums(
    rows: Sequence[PackedRow], refs: Sequence[torch.Tensor], n_samples: int
) -> tuple[list[float], list[float]]:
    """Per sample: (its KL, log mu - log pi_ref, and its log pi_ref), each summed over the same
    tokens: its trained tokens with a known behaviour logprob."""
    kl = torch.zeros(n_samples, dtype=torch.float64)
    ref = torch.zeros(n_samples, dtype=torch.float64)
    for row, ref_T in zip(rows, refs, strict=True):
        behaviour_T = row.old_logprobs_T
        known_T = row.loss_mask_T & ~torch.isnan(behaviour_T) & (row.segment_ids_T >= 0)
        ref_known = ref_T.detach().double().cpu()[known_T]
        kl.index_add_(0, row.segment_ids_T[known_T], behaviour_T.double()[known_T] - ref_known)
        ref.index_add_(0, row.segment_ids_T[known_T], ref_known)
    return kl.tolist(), ref.tolist()


def shape(
    samples: Sequence[Sample],
    kls: Sequence[float],
    coef: float,
    scale_rewards: str,
    ref_logprobs: Sequence[float] | None = None,
    sharpen: float = 1.0,
) -> tuple[list[float], dict[str, float], dict[str, float]]:
    """(advantage per sample, advantage per trajectory, KL per trajectory) from the samples'
    rewards less `coef` times their trajectory's KL (a trajectory's samples add up).

    With `sharpen` A > 1 the penalty is the KL to the base sharpened to pi_ref^A / Z,
    log mu - A log pi_ref = KL - (A - 1) log pi_ref (Z is the same for every trajectory, so
    it leaves the group's advantages alone; `ref_logprobs` are the samples' log pi_ref). The
    optimum of r - C KL(pi || pi_ref^A / Z) is pi_ref^A exp(r / C) / Z': the base reweighted
    by its own likelihood as well as by the reward, which a plain KL (A = 1), whose optimum
    reweights by the reward alone, cannot do (`bench/shout_frontier.py`). The KL returned and
    shown stays the plain one."""
    if sharpen != 1.0 and ref_logprobs is None:
        raise ValueError("a sharpened KL needs each sample's log pi_ref")
    refs = ref_logprobs if ref_logprobs is not None else [0.0] * len(kls)
    rewards: dict[str, dict[str, float]] = {}
    by_trajectory: dict[str, float] = {}
    penalties: dict[str, float] = {}
    for sample, kl, ref in zip(samples, kls, refs, strict=True):
        if sample.reward is None:
            raise ValueError(f"--reward-kl needs each sample's reward; trajectory {sample.trajectory_id!r} has none")
        rewards.setdefault(sample.group_id, {})[sample.trajectory_id] = sample.reward
        by_trajectory[sample.trajectory_id] = by_trajectory.get(sample.trajectory_id, 0.0) + kl
        penalties[sample.trajectory_id] = penalties.get(sample.trajectory_id, 0.0) + kl - (sharpen - 1.0) * ref
    advantages = kl_shaped_advantages(rewards, penalties, coef, scale_rewards)
    return [advantages[s.trajectory_id] for s in samples], advantages, by_trajectory


def with_advantages(rows: Sequence[PackedRow], advantages: Sequence[float]) -> list[PackedRow]:
    """`rows` whose tokens carry `advantages[their sample]` (0 on padding)."""
    table = torch.tensor([*advantages, 0.0], dtype=torch.float32)  # index -1 (padding) reads the 0
    return [dataclasses.replace(row, advantages_T=table[row.segment_ids_T]) for row in rows]


def finite(kls: Sequence[float], ref_logprobs: Sequence[float] = ()) -> str | None:
    """Why the KLs cannot shape rewards (one, or a log pi_ref, is NaN or infinite), or None."""
    bad = [k for k in kls if not math.isfinite(k)]
    if bad:
        return f"a trajectory's KL to the base is {bad[0]}"
    bad = [x for x in ref_logprobs if not math.isfinite(x)]
    return f"a trajectory's log-probability under the base is {bad[0]}" if bad else None
