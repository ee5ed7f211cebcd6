"""Steps counted along the parent chain: how far the policy that sampled some data is from
the one training goes on from. The trainer (`trainer.selection.without_stale`) and live groups
(`gateway.store.live`) measure staleness alike with it, so a session a live group takes is one
the trainer trains, and a step turned down (`--promote canary|manual`) never counts."""

from __future__ import annotations

from typing import Any


def lineage(conn: Any, model: str) -> dict[int, int | None]:
    """Step -> parent step, for every step of `model` (an op on an open connection)."""
    rows = conn.execute("SELECT step, parent FROM steps WHERE model = ?", (model,)).fetchall()
    return {row[0]: row[1] for row in rows}


def training_step(conn: Any, model: str) -> int:
    """The step training goes on from, as `trainer.selection.without_stale` takes it: the serving
    step (the newest promoted; under `--promote always` every step is, so the newest), or 0, the
    base model, while none was promoted."""
    row = conn.execute("SELECT MAX(step) FROM steps WHERE model = ? AND state = 'promoted'", (model,)).fetchone()
    return int(row[0]) if row is not None and row[0] is not None else 0


def chain_distance(parents: dict[int, int | None], current: int, sampled_by: int | None) -> int:
    """Steps between `sampled_by` (None: the base model = step 0) and `current` along the parent
    chain, so a step turned down never counts: depth(current) - depth(sampled_by), where a step's
    depth is its parent's + 1. A row recorded before steps had parents counts as its number (the
    steps before it were one line); a step unknown here counts as its number too."""

    def depth(step: int) -> int:
        hops, node, seen = 0, step, set()
        while node not in seen:
            seen.add(node)
            parent = parents.get(node)
            if parent is None:
                return hops + node  # step 0, or a row without lineage: linear before it
            node, hops = parent, hops + 1
        return hops  # a cycle cannot be recorded; never loop on a hand-edited store

    return depth(current) - depth(sampled_by or 0)
