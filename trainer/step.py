"""One training step over a batch of samples: pack, loss, backward, optimizer step.

No store, no files: the worker hands in samples and gets metrics back. The loss of the
whole batch is computed row by row (one forward/backward per packed row, gradients
accumulating), normalised by batch-wide counts (`LossNorm`), so the update equals the one
of the batch taken at once while only one row's activations live at a time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from gateway.settings import Settings
from trainer.backends.base import TrainingBackend
from trainer.losses import compute_loss
from trainer.packing import pack
from trainer.types import LossConfig, LossNorm, Sample


def loss_config(settings: Settings) -> LossConfig:
    return LossConfig(
        loss_type=settings.loss_type,
        epsilon=settings.epsilon,
        epsilon_high=settings.epsilon_high,
        beta=settings.beta,
    )


def train_step(backend: TrainingBackend, samples: Sequence[Sample], settings: Settings) -> dict:
    """Train on `samples` for `settings.epochs_per_step` passes, one optimizer step per
    pass. Returns metrics: loss, policy_loss, kl (None when beta is 0: the reference
    forward is skipped), clip_fraction, ratio_mean (means over passes), grad_norm (last
    pass), tokens, loss_tokens, samples, rows, train_seconds."""
    if not samples:
        raise ValueError("train_step needs at least one sample")
    started = time.perf_counter()
    config = loss_config(settings)
    rows = pack(samples, settings.max_tokens_per_row)
    norm = LossNorm.from_samples(samples)
    device = backend.device

    # The reference model does not change during the step: one forward per row.
    refs = [backend.reference_logprobs(row) for row in rows] if config.beta > 0 else [None] * len(rows)

    totals: dict[str, float] = {}
    grad_norm = 0.0
    for _ in range(settings.epochs_per_step):
        backend.zero_grad()
        for row, ref_T in zip(rows, refs):
            logprobs_T = backend.token_logprobs(row)
            loss, metrics = compute_loss(
                logprobs=logprobs_T,
                old_logprobs=row.old_logprobs_T.to(device),
                advantages=row.advantages_T.to(device),
                loss_mask=row.loss_mask_T.to(device),
                segment_ids=row.segment_ids_T.to(device),
                trajectory_tokens=row.trajectory_tokens_T.to(device),
                config=config,
                ref_logprobs=ref_T,
                norm=norm,
            )
            loss.backward()
            for key, value in metrics.items():  # each row's share: they add up to the batch's
                totals[key] = totals.get(key, 0.0) + value
        grad_norm = backend.optimizer_step()

    passes = settings.epochs_per_step
    out = {key: value / passes for key, value in totals.items()}
    if config.beta == 0:
        out["kl"] = None
    out.update(
        grad_norm=grad_norm,
        tokens=sum(len(s.token_ids) for s in samples),
        loss_tokens=norm.num_loss_tokens,
        samples=len(samples),
        rows=len(rows),
        train_seconds=time.perf_counter() - started,
    )
    return out
