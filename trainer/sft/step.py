"""One supervised step: the mean negative log-likelihood of the trained (assistant) tokens.

Packed as the GRPO step packs (`trainer.packing`): one forward/backward per row, gradients
accumulating, the loss divided by the batch's trained tokens so the rows add up to the batch's
loss taken at once. Logprobs at temperature 1 (the model's own distribution). A loss or a
gradient norm that is not finite raises `NonFiniteStep` before the optimizer moves.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence

from gateway.settings import Settings
from trainer.backends.base import TrainingBackend
from trainer.distributed.share import rank_rows, sync
from trainer.step import NonFiniteStep
from trainer.types import Sample


def _trained_tokens(samples: Sequence[Sample]) -> int:
    return sum(sum(s.loss_mask) for s in samples)


def sft_step(backend: TrainingBackend, samples: Sequence[Sample], settings: Settings) -> dict[str, float]:
    """One optimizer step on `samples`: returns loss (mean NLL per trained token), grad_norm,
    tokens, loss_tokens, samples, rows, train_seconds. Under a team every rank calls it with the
    whole batch (rank 0 announces it) and trains its rows, divided by the batch's trained tokens."""
    if not samples:
        raise ValueError("sft_step needs at least one sample")
    if backend.team is None:
        return _sft_step(backend, samples, settings)
    with backend.team.command("sft", list(samples), agreed=(NonFiniteStep,)):
        return _sft_step(backend, samples, settings)


def _sft_step(backend: TrainingBackend, samples: Sequence[Sample], settings: Settings) -> dict[str, float]:
    team = backend.team
    started = time.perf_counter()
    rows, padding = rank_rows(backend, samples, settings.max_tokens_per_row)
    passes = rows + padding
    total = _trained_tokens(samples)
    device = backend.device
    scale = backend.replication.loss_scale if backend.replication is not None else 1.0
    loss_sum = 0.0
    not_finite: str | None = None
    backend.zero_grad()
    try:
        for index, row in enumerate(passes):
            with sync(backend, last=index == len(passes) - 1):
                logprobs_T = backend.token_logprobs(row)
                mask_T = row.loss_mask_T.to(device)
                loss = -(logprobs_T * mask_T).sum() / total
                value = float(loss.detach())
                if not math.isfinite(value):
                    not_finite = not_finite or f"the loss of row {index} is {value}"
                    if team is None:
                        raise NonFiniteStep(not_finite)
                (loss * scale if scale != 1.0 else loss).backward()  # the ranks' average is the batch's sum
            loss_sum += value if math.isfinite(value) else 0.0
        if team is not None and team.any(not_finite is not None):  # every rank stops, or none
            raise NonFiniteStep(not_finite or "a loss on another training rank is not finite")
        grad_norm = backend.optimizer_step(require_finite=True)
        if not math.isfinite(grad_norm):
            raise NonFiniteStep(f"the gradient norm is {grad_norm}")
    except NonFiniteStep:
        backend.zero_grad()
        raise
    row_count = float(len(rows))
    if team is not None:
        loss_sum, row_count = team.sum([loss_sum, row_count])
    return {
        "loss": loss_sum,
        "grad_norm": grad_norm,
        "tokens": float(sum(len(s.token_ids) for s in samples)),
        "loss_tokens": float(total),
        "samples": float(len(samples)),
        "rows": row_count,
        "train_seconds": time.perf_counter() - started,
    }


def sft_loss(backend: TrainingBackend, samples: Sequence[Sample], settings: Settings) -> float | None:
    """Mean NLL per trained token of `samples` under the current adapter, without gradients
    (the held-out loss); None without samples. Under a team each rank scores its rows."""
    if not samples:
        return None
    import torch

    team = backend.team
    total = _trained_tokens(samples)
    rows, padding = rank_rows(backend, samples, settings.max_tokens_per_row)
    loss = 0.0
    with team.command("sft_loss", list(samples)) if team is not None else contextlib.nullcontext(), torch.no_grad():
        for index, row in enumerate(rows + padding):
            logprobs_T = backend.token_logprobs(row)
            if index < len(rows):
                loss += float(-(logprobs_T * row.loss_mask_T.to(backend.device)).sum()) / total
    return team.sum([loss])[0] if team is not None else loss
