"""The local engine's running batch: its rows and their KV cache, left-padded to a common length.

Requests join between steps: `prefill` runs their prompts together (left padding, one prompt
row per request, then repeated `n` times, since the `n` choices of a request share its
prompt; a background choice set aside mid-way continues from a row of prompt + its tokens),
and `Batch.merge` adds the new rows' KV cache to the running one. One decode step
(`Batch.step_logits`) feeds every row its last token; `Batch.select` drops the rows that
finished, and the cache columns that are padding in every row left. Requests for different
adapters share a batch through peft's mixed-adapter forward (`LocalModel.forward`).

Only the worker thread touches a batch.
"""

from __future__ import annotations

from typing import Any

from gateway.engines.local.jobs import Job, Row
from gateway.engines.local.model import LocalModel


def new_cache(layers: list | None = None):
    """A transformers DynamicCache, empty or over (keys, values) per layer."""
    from transformers import DynamicCache

    return DynamicCache(layers) if layers is not None else DynamicCache()


def prefill(model: LocalModel, jobs: list[Job]):
    """Run these jobs' sequences together, left-padded: one prompt row per job, repeated once
    per choice that starts here (the `n` choices of a job share its prompt), and one row of
    prompt + its tokens per choice that continues after being set aside (`Job.parked`).
    Returns the rows, the logits of their last position [R, V], their cache and their
    attention mask [R, T]."""
    import torch

    device = model.device
    sequences: list[tuple[list[int], str | None]] = []  # (token ids, adapter) per prefilled row
    rows: list[Row] = []
    repeat: list[int] = []  # the prefilled row each new row takes its cache from
    for job in jobs:
        fresh = [index for index in job.unfinished if index not in job.parked]
        if fresh:
            repeat += [len(sequences)] * len(fresh)
            sequences.append((job.prompt_ids, job.adapter))
            rows += [Row(job, index) for index in fresh]
        for index in [index for index in job.unfinished if index in job.parked]:
            # Its last token was sampled but never fed: the prefill's last logits are the
            # next position's, as the decode step would have computed them.
            row = job.parked.pop(index)
            repeat.append(len(sequences))
            sequences.append((job.prompt_ids + row.ids, job.adapter))
            rows.append(row)
    width = max(len(ids) for ids, _ in sequences)
    ids_JT = torch.full((len(sequences), width), model.pad_id, dtype=torch.long)
    mask_JT = torch.zeros((len(sequences), width), dtype=torch.long)
    for j, (ids, _) in enumerate(sequences):
        ids_JT[j, width - len(ids) :] = torch.tensor(ids)
        mask_JT[j, width - len(ids) :] = 1
    ids_JT, mask_JT = ids_JT.to(device), mask_JT.to(device)
    cache = new_cache()
    logits_JV = model.forward(ids_JT, mask_JT, cache, [adapter for _, adapter in sequences], logits_to_keep=1)
    repeat_R = torch.tensor(repeat, device=device)
    cache.batch_select_indices(repeat_R)
    return rows, logits_JV[repeat_R], cache, mask_JT[repeat_R]


class Batch:
    """The rows being decoded, with their cache, attention mask and next input token."""

    def __init__(self, device: Any):
        import torch

        self.torch = torch
        self.device = device
        self.rows: list[Row] = []
        self.cache = None  # DynamicCache over `rows`, left-padded to a common length
        self.mask_BT = None  # 1 for real tokens, 0 for padding
        self.next_B = None  # each row's last sampled token, not yet in the cache

    def step_logits(self, model: LocalModel):
        """One decode step: every row's last token through the model; the logits [B, V]."""
        self.mask_BT = self.torch.cat([self.mask_BT, self.torch.ones_like(self.mask_BT[:, :1])], dim=1)
        return model.forward(self.next_B[:, None], self.mask_BT, self.cache, [row.job.adapter for row in self.rows])

    def merge(self, rows: list[Row], keep: list[int], cache, mask_RT, next_R) -> None:
        """Add the prefilled rows numbered in `keep` to the running batch, left-padding the
        shorter side's cache."""
        torch = self.torch
        keep_R = torch.tensor(keep, device=self.device)
        cache.batch_select_indices(keep_R)
        rows, mask_RT, next_R = [rows[i] for i in keep], mask_RT[keep_R], next_R[keep_R]
        if not self.rows:
            self.rows, self.cache, self.mask_BT, self.next_B = rows, cache, mask_RT, next_R
            return
        width = max(self.mask_BT.shape[1], mask_RT.shape[1])

        def pad(t, dim_from_end: int):
            missing = width - t.shape[-dim_from_end]
            if missing == 0:
                return t
            spec = [0, 0] * (dim_from_end - 1) + [missing, 0]
            return torch.nn.functional.pad(t, spec)

        layers = []
        for old, new in zip(self.cache.layers, cache.layers, strict=False):
            layers.append(
                (torch.cat([pad(old.keys, 2), pad(new.keys, 2)]), torch.cat([pad(old.values, 2), pad(new.values, 2)]))
            )
        self.cache = new_cache(layers)
        self.mask_BT = torch.cat([pad(self.mask_BT, 1), pad(mask_RT, 1)])
        self.next_B = torch.cat([self.next_B, next_R])
        self.rows = self.rows + rows

    def select(self, keep: list[int]) -> None:
        """Keep only these rows; drop cache columns that are padding in every remaining row."""
        if not keep:
            self.clear()
            return
        keep_K = self.torch.tensor(keep, device=self.device)
        self.rows = [self.rows[i] for i in keep]
        self.cache.batch_select_indices(keep_K)
        self.mask_BT, self.next_B = self.mask_BT[keep_K], self.next_B[keep_K]
        first = int(self.mask_BT.any(dim=0).nonzero()[0])
        if first > 0:
            self.mask_BT = self.mask_BT[:, first:]
            self.cache = new_cache(
                [(layer.keys[:, :, first:], layer.values[:, :, first:]) for layer in self.cache.layers]
            )

    def clear(self) -> None:
        self.rows, self.cache, self.mask_BT, self.next_B = [], None, None, None
