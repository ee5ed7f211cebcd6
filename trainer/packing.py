"""Samples -> model inputs: packed rows (training) and padded batches (the baseline).

Packing puts several samples end to end in one row so no compute is spent on padding.
Samples must not see each other: every row gets a causal, block-diagonal attention mask
and position ids that restart at 0 for each sample, so each token's logprob is the one
the sample would get alone. A sample is never split across rows (its later tokens need
all of its earlier ones), which also keeps each sequence-level quantity (GSPO's ratio)
inside one row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.types import Sample


@dataclass(frozen=True, eq=False)
class PackedRow:
    """Several samples end to end in one row of T tokens (T <= max_tokens_per_row)."""

    input_ids_T: torch.Tensor
    """long; the samples' token ids, concatenated."""

    position_ids_T: torch.Tensor
    """long; restart at 0 at the start of each sample."""

    segment_ids_T: torch.Tensor
    """long; index of the token's sample in the list given to `pack` (-1: padding)."""

    loss_mask_T: torch.Tensor
    """bool; True on trained (sampled completion) tokens."""

    old_logprobs_T: torch.Tensor
    """float32; behaviour logprobs (log mu, recorded at sampling time), NaN where unknown."""

    advantages_T: torch.Tensor
    """float32; the token's trajectory advantage."""

    temperatures_T: torch.Tensor
    """float32; the sampling temperature of token t (logits at t-1 are divided by it)."""

    trajectory_tokens_T: torch.Tensor
    """float32; trained tokens of the token's trajectory over the whole batch (its
    samples may sit in other rows). Losses divide by it to weigh trajectories equally."""

    weights_T: torch.Tensor
    """float32; the loss weight of token t (`Sample.weights`, 1 where the sample has none)."""

    sample_indices: tuple[int, ...]
    """The samples in this row, in row order (indices into the list given to `pack`)."""


@dataclass(frozen=True, eq=False)
class PaddedBatch:
    """One sample per row, right-padded to the longest: [B, T_max]. The baseline packing
    is measured against; the fields mean what `PackedRow`'s do."""

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    """bool; False on padding."""
    position_ids_BT: torch.Tensor
    segment_ids_BT: torch.Tensor
    loss_mask_BT: torch.Tensor
    old_logprobs_BT: torch.Tensor
    advantages_BT: torch.Tensor
    trajectory_tokens_BT: torch.Tensor
    temperatures_BT: torch.Tensor
    weights_BT: torch.Tensor


def _trajectory_tokens(samples: Sequence[Sample]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in samples:
        counts[s.trajectory_id] = counts.get(s.trajectory_id, 0) + s.num_loss_tokens
    return counts


def _row(samples: Sequence[Sample], indices: Sequence[int], traj_tokens: dict[str, int]) -> PackedRow:
    ids: list[int] = []
    pos: list[int] = []
    seg: list[int] = []
    mask: list[bool] = []
    old: list[float] = []
    adv: list[float] = []
    ttok: list[int] = []
    temp: list[float] = []
    weights: list[float] = []
    for i in indices:
        s = samples[i]
        n = len(s.token_ids)
        temp += s.temperatures if s.temperatures is not None else [1.0] * n
        weights += s.weights if s.weights is not None else [1.0] * n
        ids += s.token_ids
        pos += range(n)
        seg += [i] * n
        mask += s.loss_mask
        old += s.old_logprobs
        adv += [s.advantage] * n
        ttok += [traj_tokens[s.trajectory_id]] * n
    return PackedRow(
        input_ids_T=torch.tensor(ids, dtype=torch.long),
        position_ids_T=torch.tensor(pos, dtype=torch.long),
        segment_ids_T=torch.tensor(seg, dtype=torch.long),
        loss_mask_T=torch.tensor(mask, dtype=torch.bool),
        old_logprobs_T=torch.tensor(old, dtype=torch.float32),
        advantages_T=torch.tensor(adv, dtype=torch.float32),
        temperatures_T=torch.tensor(temp, dtype=torch.float32),
        trajectory_tokens_T=torch.tensor(ttok, dtype=torch.float32),
        weights_T=torch.tensor(weights, dtype=torch.float32),
        sample_indices=tuple(indices),
    )


def pack(samples: Sequence[Sample], max_tokens_per_row: int) -> list[PackedRow]:
    """First-fit-decreasing bin packing of samples into rows of at most
    `max_tokens_per_row` tokens.

    Longest first, each into the first row it fits; within a row, samples keep their
    batch order. A sample longer than the limit is an error rather than truncated: cutting
    its start changes every later token's context (so its logprobs), and cutting its end
    drops what was trained on.
    """
    if max_tokens_per_row <= 0:
        raise ValueError(f"max_tokens_per_row must be positive, got {max_tokens_per_row}")
    for i, s in enumerate(samples):
        if len(s.token_ids) > max_tokens_per_row:
            raise ValueError(
                f"sample {i} (trajectory {s.trajectory_id!r}) has {len(s.token_ids)} tokens, "
                f"more than max_tokens_per_row={max_tokens_per_row}; raise --max-tokens-per-row "
                f"to at least {len(s.token_ids)}"
            )
    order = sorted(range(len(samples)), key=lambda i: (-len(samples[i].token_ids), i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = len(samples[i].token_ids)
        for b in range(len(bins)):
            if n <= room[b]:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(max_tokens_per_row - n)
    traj_tokens = _trajectory_tokens(samples)
    return [_row(samples, sorted(b), traj_tokens) for b in bins]


def padded_batch(samples: Sequence[Sample], pad_token_id: int = 0) -> PaddedBatch:
    """One sample per row, right-padded to the longest sample."""
    if not samples:
        raise ValueError("padded_batch needs at least one sample")
    B, T = len(samples), max(len(s.token_ids) for s in samples)
    traj_tokens = _trajectory_tokens(samples)
    input_ids = torch.full((B, T), pad_token_id, dtype=torch.long)
    attention = torch.zeros((B, T), dtype=torch.bool)
    position = torch.zeros((B, T), dtype=torch.long)
    segment = torch.full((B, T), -1, dtype=torch.long)
    loss_mask = torch.zeros((B, T), dtype=torch.bool)
    old = torch.full((B, T), math.nan, dtype=torch.float32)
    adv = torch.zeros((B, T), dtype=torch.float32)
    ttok = torch.zeros((B, T), dtype=torch.float32)
    temp = torch.ones((B, T), dtype=torch.float32)
    weights = torch.ones((B, T), dtype=torch.float32)
    for b, s in enumerate(samples):
        n = len(s.token_ids)
        input_ids[b, :n] = torch.tensor(s.token_ids)
        attention[b, :n] = True
        position[b, :n] = torch.arange(n)
        segment[b, :n] = b
        loss_mask[b, :n] = torch.tensor(s.loss_mask)
        old[b, :n] = torch.tensor(s.old_logprobs, dtype=torch.float32)
        adv[b, :n] = s.advantage
        ttok[b, :n] = traj_tokens[s.trajectory_id]
        if s.temperatures is not None:
            temp[b, :n] = torch.tensor(s.temperatures, dtype=torch.float32)
        if s.weights is not None:
            weights[b, :n] = torch.tensor(s.weights, dtype=torch.float32)
    return PaddedBatch(input_ids, attention, position, segment, loss_mask, old, adv, ttok, temp, weights)


def attention_mask_4d(
    segment_ids_T: torch.Tensor, dtype: torch.dtype = torch.float32, window: int | None = None
) -> torch.Tensor:
    """Causal, block-diagonal mask [1, 1, T, T] for one packed row, in the additive form
    (0 = attend, dtype's min = blocked); with `window`, a query sees only the keys less than
    `window` positions back (transformers' `sliding_window_overlay`).

    transformers passes a 4D mask through unchanged (`masking_utils`: "If the mask is
    already 4D, simply return as-is"); eager attention adds it to the scores and SDPA
    takes it as `attn_mask`, so the additive float form is the one both accept (a bool
    mask would be *added* as 0/1 by eager attention). `dtype` must be the model's.
    Padding (segment -1) attends only to itself, so no softmax row is empty (NaN).
    """
    T = segment_ids_T.shape[-1]
    same_segment_TT = segment_ids_T[:, None] == segment_ids_T[None, :]
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=segment_ids_T.device).tril()
    if window is not None:
        causal_TT = causal_TT.triu(-(window - 1))  # q - k < window
    allowed_TT = (same_segment_TT & causal_TT & (segment_ids_T[None, :] >= 0)) | torch.eye(
        T, dtype=torch.bool, device=segment_ids_T.device
    )
    mask_TT = torch.zeros(T, T, dtype=dtype, device=segment_ids_T.device)
    mask_TT.masked_fill_(~allowed_TT, torch.finfo(dtype).min)
    return mask_TT[None, None]


def packed_attention_mask(
    config: object, segment_ids_T: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | dict[str, torch.Tensor]:
    """What a model with `config` takes as the attention mask of one packed row. A 4D mask is
    used as given, so a sliding window the mask leaves out is no window at all: the trainer
    would score a long sample with attention the sampler never had. Every layer windowed
    (Mistral: `sliding_window`, no `layer_types`): the windowed mask; some layers (Qwen2 with
    `use_sliding_window`, Gemma 3: `layer_types`): one mask per layer type, as those models
    take it."""
    full = attention_mask_4d(segment_ids_T, dtype)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window or (layer_types is not None and "sliding_attention" not in layer_types):
        return full
    windowed = attention_mask_4d(segment_ids_T, dtype, window=window)
    if layer_types is None or set(layer_types) == {"sliding_attention"}:
        return windowed
    return {"full_attention": full, "sliding_attention": windowed}


def selective_log_softmax(
    logits_NV: torch.Tensor,
    targets_N: torch.Tensor,
    temperatures_N: torch.Tensor | None = None,
    chunk: int = 1024,
) -> torch.Tensor:
    """log_softmax(logits / temperature)[target] per row, as `logit[target] -
    logsumexp(logits)`, in chunks of rows: only one chunk's [chunk, V] float32 temporary
    lives at a time instead of a full [N, V] log_softmax."""
    out = []
    for start in range(0, logits_NV.shape[0], chunk):
        block_nV = logits_NV[start : start + chunk].float()
        if temperatures_N is not None:
            block_nV = block_nV / temperatures_N[start : start + chunk, None]
        picked_n = block_nV.gather(-1, targets_N[start : start + chunk, None]).squeeze(-1)
        out.append(picked_n - torch.logsumexp(block_nV, dim=-1))
    if not out:
        return logits_NV.new_zeros(0, dtype=torch.float32)
    return torch.cat(out)


def _param(model: torch.nn.Module) -> torch.Tensor:
    return next(model.parameters())


def token_logprobs(model: torch.nn.Module, row: PackedRow) -> torch.Tensor:
    """logprobs_T of one packed row: entry t is log p(token t | the earlier tokens of its
    own sample) at token t's sampling temperature (the logits at t-1 divided by it);
    0 at each sample's first token (no context; never trained on).

    Runs the model with the block-diagonal mask and restarting position ids. Gradients
    flow when called outside `torch.no_grad()`.
    """
    p = _param(model)
    ids_T = row.input_ids_T.to(p.device)
    logits_TV = model(
        input_ids=ids_T[None],
        position_ids=row.position_ids_T.to(p.device)[None],
        attention_mask=packed_attention_mask(getattr(model, "config", None), row.segment_ids_T.to(p.device), p.dtype),
        use_cache=False,
    ).logits[0]
    # logits at t-1 predict token t, at the temperature token t was sampled with.
    next_T = selective_log_softmax(logits_TV[:-1], ids_T[1:], row.temperatures_T[1:].to(p.device))
    logprobs_T = torch.cat([next_T.new_zeros(1), next_T])
    # At a sample's first token, position t-1 belongs to the previous sample.
    return logprobs_T.masked_fill(row.position_ids_T.to(p.device) == 0, 0.0)


def padded_token_logprobs(model: torch.nn.Module, batch: PaddedBatch) -> torch.Tensor:
    """logprobs_BT of a padded batch, laid out like `token_logprobs` (0 at t=0 and on
    padding)."""
    p = _param(model)
    ids_BT = batch.input_ids_BT.to(p.device)
    attention_BT = batch.attention_mask_BT.to(p.device)
    logits_BTV = model(
        input_ids=ids_BT,
        attention_mask=attention_BT.long(),
        position_ids=batch.position_ids_BT.to(p.device),
        use_cache=False,
    ).logits
    B, T, V = logits_BTV.shape
    next_BT = selective_log_softmax(
        logits_BTV[:, :-1].reshape(-1, V),
        ids_BT[:, 1:].reshape(-1),
        batch.temperatures_BT[:, 1:].reshape(-1).to(p.device),
    ).view(B, T - 1)
    logprobs_BT = torch.cat([next_BT.new_zeros(B, 1), next_BT], dim=1)
    return logprobs_BT.masked_fill(~attention_BT, 0.0)
