"""One supervised step: the mean negative log-likelihood of the trained (assistant) tokens.

Packed as the GRPO step packs (`trainer.packing`): one forward/backward per row, gradients
accumulating, the loss divided by the batch's trained tokens so the rows add up to the batch's
loss taken at once. Logprobs at temperature 1 (the model's own distribution). A loss or a
gradient norm that is not finite raises `NonFiniteStep` before the optimizer moves.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from gateway.settings import Settings
from trainer.backends.base import TrainingBackend
from trainer.packing import pack
from trainer.step import NonFiniteStep
from trainer.types import Sample


def _trained_tokens(samples: Sequence[Sample]) -> int:
    return sum(sum(s.loss_mask) for s in samples)


def sft_step(backend: TrainingBackend, samples: Sequence[Sample], settings: Settings) -> dict[str, float]:
    """One optimizer step on `samples`: returns loss (mean NLL per trained token), grad_norm,
    tokens, loss_tokens, samples, rows, train_seconds."""
    if not samples:
        raise ValueError("sft_step needs at least one sample")
    started = time.perf_counter()
    rows = pack(samples, settings.max_tokens_per_row)
    total = _trained_tokens(samples)
    device = backend.device
    loss_sum = 0.0
    backend.zero_grad()
    try:
        for index, row in enumerate(rows):
            logprobs_T = backend.token_logprobs(row)
            mask_T = row.loss_mask_T.to(device)
            loss = -(logprobs_T * mask_T).sum() / total
            value = float(loss.detach())
            if not math.isfinite(value):
                raise NonFiniteStep(f"the loss of row {index} is {value}")
            loss.backward()
            loss_sum += value
        grad_norm = backend.optimizer_step(require_finite=True)
        if not math.isfinite(grad_norm):
            raise NonFiniteStep(f"the gradient norm is {grad_norm}")
    except NonFiniteStep:
        backend.zero_grad()
        raise
    return {
        "loss": loss_sum,
        "grad_norm": grad_norm,
        "tokens": float(sum(len(s.token_ids) for s in samples)),
        "loss_tokens": float(total),
        "samples": float(len(samples)),
        "rows": float(len(rows)),
        "train_seconds": time.perf_counter() - started,
    }


def sft_loss(backend: TrainingBackend, samples: Sequence[Sample], settings: Settings) -> float | None:
    """Mean NLL per trained token of `samples` under the current adapter, without gradients
    (the held-out loss); None without samples."""
    if not samples:
        return None
    import torch

    total = _trained_tokens(samples)
    loss = 0.0
    with torch.no_grad():
        for row in pack(samples, settings.max_tokens_per_row):
            logprobs_T = backend.token_logprobs(row)
            loss += float(-(logprobs_T * row.loss_mask_T.to(backend.device)).sum()) / total
    return loss
