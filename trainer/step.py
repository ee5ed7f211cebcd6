"""One training step over a batch of samples: pack, score pi_old, loss, backward, optimizer step.

No store, no files: the worker hands in samples and gets metrics back. The loss of the
whole batch is computed row by row (one forward/backward per packed row, gradients
accumulating), normalised by batch-wide counts (`LossNorm`), so the update equals the one
of the batch taken at once while only one row's activations live at a time.

pi_old, the policy the step starts from, is scored once for every trained token, at each
call's sampling temperature, without gradients, before the first pass; every pass of
`epochs_per_step` is clipped against it. With one pass and no dropout the first pass's own
logprobs, detached, are exactly pi_old (same weights, same inputs), so that forward is not
run twice.

A step whose loss or gradient norm is not finite raises `NonFiniteStep` before the
optimizer moves: the adapter and the optimizer state are as they were before the step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from gateway.errors import RLProxyError
from gateway.settings import Settings
from trainer import reward_kl
from trainer.backends.base import TrainingBackend
from trainer.distributed.share import rank_rows, sync, team_metrics
from trainer.losses import compute_loss
from trainer.packing import PackedRow, pack
from trainer.types import LossConfig, LossNorm, Sample


class NonFiniteStep(RLProxyError):
    """The loss or the gradient norm of a step was NaN or infinite: nothing was updated."""

    status_code = 500
    error_type = "server_error"


def loss_config(settings: Settings, token_budget: int | None = None) -> LossConfig:
    return LossConfig(
        loss_type=settings.loss_type,
        epsilon=settings.epsilon,
        epsilon_high=settings.epsilon_high,
        beta=settings.beta,
        kl_estimator=settings.kl_estimator,
        tis_cap=settings.tis_cap,
        delta=settings.delta,
        max_tokens_norm=settings.max_tokens_norm or token_budget,
    )


def train_step(
    backend: TrainingBackend,
    samples: Sequence[Sample],
    settings: Settings,
    *,
    token_budget: int | None = None,
    advantages_out: dict[str, float] | None = None,
) -> dict[str, float | None]:
    """Train on `samples` for `settings.epochs_per_step` passes, one optimizer step per
    pass. `token_budget` is dr_grpo's fixed divisor when `--max-tokens-norm` is unset.

    Returns metrics: loss, policy_loss, kl (the k3 KL to the base model, mean per trained
    token, whatever beta is), clip_fraction, ratio_mean, the sampler/trainer mismatch
    (mismatch_logprob_abs, tis_weight_mean, tis_capped_fraction,
    behaviour_unknown_fraction; means over passes), grad_norm (last pass), tokens,
    loss_tokens, samples, rows, old_policy_seconds, reference_seconds (the base model's
    forward), train_seconds, with `--reward-kl` reward_kl_mean and reward_kl_max (a
    trajectory's KL to the base, summed over its tokens; `advantages_out`, when given, gets the
    advantage each trajectory trained with), and under a team (`trainer.distributed`) the ranks' figures
    (`team_metrics`). Raises `NonFiniteStep` (with the weights restored) when a loss or
    gradient norm is not finite, on every rank of a team alike.

    Under a team every rank calls this with the whole batch (rank 0 announces it): each trains
    its rows (`trainer.distributed.split`) against the batch's own normalisers, so the reduced
    gradient is the one process's."""
    if not samples:
        raise ValueError("train_step needs at least one sample")
    if backend.team is None:
        return _train_step(backend, samples, settings, token_budget, advantages_out)
    with backend.team.command("grpo", list(samples), token_budget, agreed=(NonFiniteStep,)):
        return _train_step(backend, samples, settings, token_budget, advantages_out)


def _train_step(
    backend: TrainingBackend,
    samples: Sequence[Sample],
    settings: Settings,
    token_budget: int | None,
    advantages_out: dict[str, float] | None,
) -> dict[str, float | None]:
    team = backend.team
    started = time.perf_counter()
    config = loss_config(settings, token_budget)
    padding: list[PackedRow] = []
    if team is None:  # one process: the batch packed as always
        rows = pack(samples, settings.max_tokens_per_row)
    else:
        rows, padding = rank_rows(backend, samples, settings.max_tokens_per_row)
    norm = LossNorm.from_samples(samples)
    device = backend.device
    import torch

    passes_of_rows = rows + padding
    # The reference model does not change during the step: one forward per row. Run with
    # beta = 0 too: the KL to the base is how drift (a reward being gamed) shows on the dashboard.
    ref_started = time.perf_counter()
    refs = [backend.reference_logprobs(row) for row in passes_of_rows]
    ref_seconds = time.perf_counter() - ref_started
    shaped: dict[str, float] = {}  # trajectory id -> the advantage it trains with, under --reward-kl
    trajectory_kls: dict[str, float] = {}
    if settings.reward_kl > 0:
        rows, shaped, trajectory_kls = _shape_rewards(backend, samples, rows, refs[: len(rows)], settings)
        passes_of_rows = rows + padding
    reuse_first_pass = settings.epochs_per_step == 1 and settings.lora_dropout == 0
    old_started = time.perf_counter()
    olds: list[torch.Tensor | None] = [None] * len(passes_of_rows)
    if not reuse_first_pass:
        with torch.no_grad():
            olds = [backend.token_logprobs(row).detach() for row in passes_of_rows]
    old_seconds = time.perf_counter() - old_started

    # A later pass that fails must not leave the earlier passes' updates behind.
    snapshot = backend.snapshot() if settings.epochs_per_step > 1 else None
    totals: dict[str, float] = {}
    grad_norm = 0.0
    scale = backend.replication.loss_scale if backend.replication is not None else 1.0
    try:
        for _ in range(settings.epochs_per_step):
            backend.zero_grad()
            not_finite: str | None = None
            for index, (row, ref_T) in enumerate(zip(passes_of_rows, refs, strict=True)):
                with sync(backend, last=index == len(passes_of_rows) - 1):
                    logprobs_T = backend.token_logprobs(row)
                    if index >= len(
                        rows
                    ):  # a padding pass that keeps this rank in step with the others; trains nothing
                        (logprobs_T.sum() * 0.0).backward()
                        continue
                    old_T = olds[index]
                    if old_T is None:
                        old_T = olds[index] = logprobs_T.detach()
                    loss, metrics = compute_loss(
                        logprobs=logprobs_T,
                        old_logprobs=old_T,
                        behaviour_logprobs=row.old_logprobs_T.to(device),
                        advantages=row.advantages_T.to(device),
                        loss_mask=row.loss_mask_T.to(device),
                        segment_ids=row.segment_ids_T.to(device),
                        trajectory_tokens=row.trajectory_tokens_T.to(device),
                        config=config,
                        ref_logprobs=ref_T,
                        norm=norm,
                        weights=row.weights_T.to(device),
                    )
                    if not math.isfinite(metrics["loss"]):
                        not_finite = not_finite or f"the loss of row {index} is {metrics['loss']}"
                        if team is None:
                            raise NonFiniteStep(not_finite)
                    (loss * scale if scale != 1.0 else loss).backward()  # the ranks' average is the batch's sum
                for key, value in metrics.items():  # each row's share: they add up to the batch's
                    totals[key] = totals.get(key, 0.0) + value
            if team is not None and team.any(not_finite is not None):  # every rank stops, or none
                raise NonFiniteStep(not_finite or "a loss on another training rank is not finite")
            grad_norm = backend.optimizer_step(require_finite=True)
            if not math.isfinite(grad_norm):
                raise NonFiniteStep(f"the gradient norm is {grad_norm}")
    except NonFiniteStep:
        backend.zero_grad()
        if snapshot is not None:
            backend.restore(snapshot)
        raise

    passes = settings.epochs_per_step
    if team is not None:
        keys = team.union(totals)
        totals = dict(zip(keys, team.sum([totals.get(key, 0.0) for key in keys]), strict=True))
    out: dict[str, float | None] = {key: value / passes for key, value in totals.items()}
    out.update(
        grad_norm=grad_norm,
        tokens=sum(len(s.token_ids) for s in samples),
        loss_tokens=norm.num_loss_tokens,
        samples=len(samples),
        rows=len(rows) if team is None else int(team.sum([float(len(rows))])[0]),
        old_policy_seconds=old_seconds,
        reference_seconds=ref_seconds,
        train_seconds=time.perf_counter() - started,
    )
    if trajectory_kls:
        kls = list(trajectory_kls.values())
        out.update(reward_kl_mean=sum(kls) / len(kls), reward_kl_max=max(kls))
        if advantages_out is not None:
            advantages_out.update(shaped)
    if team is not None:
        out.update(team_metrics(team, rows, out["train_seconds"] or 0.0))
    return out


def _shape_rewards(
    backend: TrainingBackend,
    samples: Sequence[Sample],
    rows: list[PackedRow],
    refs: Sequence,
    settings: Settings,
) -> tuple[list[PackedRow], dict[str, float], dict[str, float]]:
    """`--reward-kl`: the rows with advantages from rewards less the KL to the base
    (`trainer.reward_kl`), the advantage and the KL of each trajectory. Under a team each rank
    sums its own rows and the sums are added, so every rank shapes the whole batch alike."""
    kls, ref_logprobs = reward_kl.sample_sums(rows, refs, len(samples))
    if backend.team is not None:
        both = backend.team.sum(kls + ref_logprobs)
        kls, ref_logprobs = both[: len(kls)], both[len(kls) :]
    why = reward_kl.finite(kls, ref_logprobs)
    if why is not None:
        raise NonFiniteStep(why)
    per_sample, advantages, trajectory_kls = reward_kl.shape(
        samples, kls, settings.reward_kl, settings.scale_rewards, ref_logprobs, settings.reward_kl_sharpen
    )
    return reward_kl.with_advantages(rows, per_sample), advantages, trajectory_kls
