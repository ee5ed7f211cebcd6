"""Which packed rows each rank trains: the batch split by tokens, pure functions.

The batch is packed once, as one process packs it (so a trajectory's token count and GSPO's
sequence-level ratio still see the whole batch), but into rows no longer than an even share of
its tokens, so that every rank gets rows; the rows then go to ranks longest first, each to the
rank with the fewest tokens so far (LPT). Every rank must run as many forward and backward passes
as the others (each is a collective under DDP and FSDP), so ranks with fewer rows also run
`padding` passes: a one-token row whose loss is zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def row_cap(lengths: Sequence[int], world_size: int, max_tokens_per_row: int) -> int:
    """The row length to pack at: an even share of the batch's tokens, never below the longest
    sample (a sample is never split) nor above `max_tokens_per_row`."""
    if not lengths:
        return max_tokens_per_row
    share = math.ceil(sum(lengths) / world_size)
    return min(max_tokens_per_row, max(max(lengths), share))


@dataclass(frozen=True)
class Assignment:
    """Rows given to one rank: indices into the packed rows, and the padding passes it adds."""

    rows: tuple[int, ...]
    padding: int


def assign_rows(row_tokens: Sequence[int], world_size: int) -> list[Assignment]:
    """Rows to ranks, longest first to the least-loaded rank (ties: the lower rank), then padding
    so that every rank runs as many passes as the busiest."""
    loads = [0] * world_size
    given: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(row_tokens)), key=lambda i: (-row_tokens[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += row_tokens[index]
        given[rank].append(index)
    passes = max((len(rows) for rows in given), default=0)
    passes = max(passes, 1)  # a rank with nothing still takes part in the one sync pass
    return [Assignment(rows=tuple(sorted(rows)), padding=passes - len(rows)) for rows in given]
