"""One rank's share of a step: its rows, the padding passes that keep it in step, the team's figures.

With one process (`backend.team` is None) the share is the whole batch packed as always, so the
one-process step is unchanged.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from trainer.distributed.split import assign_rows, row_cap
from trainer.packing import PackedRow, pack
from trainer.types import Sample

if TYPE_CHECKING:
    from trainer.backends.base import TrainingBackend
    from trainer.distributed.team import Team


def padding_row(pad_token_id: int) -> PackedRow:
    """Two untrained tokens (the second's logprob depends on every weight, so the backward reaches
    each LoRA parameter): a pass that runs the model (each pass is a collective) for nothing."""
    sample = Sample(
        token_ids=(pad_token_id, pad_token_id),
        loss_mask=(False, False),
        old_logprobs=(math.nan, math.nan),
        advantage=0.0,
        trajectory_id="padding",
        group_id="padding",
    )
    return pack([sample], 2)[0]


def rank_rows(
    backend: TrainingBackend, samples: Sequence[Sample], max_tokens_per_row: int
) -> tuple[list[PackedRow], list[PackedRow]]:
    """The rows this rank trains and the padding passes it adds after them."""
    team = backend.team
    if team is None:
        return pack(samples, max_tokens_per_row), []
    rows = pack(samples, row_cap([len(s.token_ids) for s in samples], team.world_size, max_tokens_per_row))
    mine = assign_rows([len(row.input_ids_T) for row in rows], team.world_size)[team.rank]
    return [rows[i] for i in mine.rows], [padding_row(backend.pad_token_id)] * mine.padding


@contextlib.contextmanager
def sync(backend: TrainingBackend, last: bool) -> Iterator[None]:
    """Gradients reduced over the ranks in the rank's last backward of a pass (no-op alone)."""
    if backend.replication is None:
        yield
        return
    timed = backend.team.timed("sync_backward") if last and backend.team else contextlib.nullcontext()
    with backend.replication.sync(last), timed:
        yield


def team_metrics(team: Team, rows: Sequence[PackedRow], seconds: float) -> dict[str, float]:
    """The job's and each rank's throughput: tokens/s of the whole step, the slowest and fastest
    rank's, the share of the step the ranks spent waiting for the slowest (stragglers), the seconds
    of the backward passes that reduce the gradients (the slowest rank's) and, under DDP, of the
    gradient all-reduce itself (0 under FSDP2, whose reduce-scatters run inside those passes)."""
    tokens = team.gather(float(sum(len(row.input_ids_T) for row in rows)))
    took = team.gather(seconds)
    synced = team.gather(team.take_seconds("sync_backward"))
    reduced = team.gather(team.take_seconds("allreduce"))
    rates = [n / max(s, 1e-9) for n, s in zip(tokens, took, strict=True)]
    slowest = max(took)
    return {
        "ranks": float(team.world_size),
        "tokens_per_second": sum(tokens) / max(slowest, 1e-9),
        "rank_tokens_per_second_min": min(rates),
        "rank_tokens_per_second_max": max(rates),
        "straggler_share": 1.0 - (sum(took) / len(took)) / max(slowest, 1e-9),
        "sync_seconds": max(synced),
        "allreduce_seconds": max(reduced),
    }
