"""Steps counted along the parent chain: how far the policy that sampled some data is from
the one training goes on from. The trainer (`trainer.selection.without_stale`) and live groups
(`gateway.store.live`) measure staleness alike with it, so a session a live group takes is one
the trainer trains, and a step turned down (`--promote canary|manual`) never counts."""

from __future__ import annotations

from typing import Any


class StepParents:
    """Step -> parent of one model's steps, read a range at a time as a walk down the chain asks
    (an op's view on an open connection). Live rewards measure staleness inside the reward's
    write transaction: reading every step row there cost a run more each step it took (25 ms at
    5,000 steps, SQLite's write lock held), for the few steps between two that are close."""

    def __init__(self, conn: Any, model: str, span: int = 16):
        self.conn, self.model, self.span = conn, model, span
        self.known: dict[int, int | None] = {}
        self.low: int | None = None  # steps in [low, high] were read (those absent are not recorded)
        self.high: int | None = None
        self.rows_read = 0

    def get(self, step: int) -> int | None:
        """The step's parent; None for a row without one, or a step not recorded."""
        if self.low is None or self.high is None:
            self._read(step - self.span + 1, step)
        elif step > self.high:
            self._read(self.high + 1, step)
        elif step < self.low:
            self.span *= 2  # a walk that went below reads further ahead each time: rows read stay ~2x those needed
            self._read(min(step, self.low - self.span), self.low - 1)
        return self.known.get(step)

    def everything(self) -> dict[int, int | None]:
        self._read(None, None)
        return self.known

    def _read(self, low: int | None, high: int | None) -> None:
        if low is None or high is None:
            rows = self.conn.execute("SELECT step, parent FROM steps WHERE model = ?", (self.model,)).fetchall()
        else:
            rows = self.conn.execute(
                "SELECT step, parent FROM steps WHERE model = ? AND step >= ? AND step <= ?", (self.model, low, high)
            ).fetchall()
        self.known.update((row[0], row[1]) for row in rows)
        self.rows_read += len(rows)
        self.low = low if self.low is None or low is None else min(self.low, low)
        self.high = high if self.high is None or high is None else max(self.high, high)


class QueryConn:
    """A store's reads (`Store._query`: rows as dicts, `?` placeholders in either backend) as the
    connection `StepParents` reads from, so the trainer walks the chain as a live reward does."""

    def __init__(self, query: Any):
        self.query = query

    def execute(self, sql: str, params: tuple = ()) -> Any:
        rows = [tuple(row.values()) for row in self.query(sql, params)]

        class Rows:
            def fetchall(self) -> list[tuple]:
                return rows

        return Rows()


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


def further_than(parents: StepParents, current: int, sampled_by: int | None, limit: int) -> bool:
    """`chain_distance(every step's parent, current, sampled_by) > limit`, reading only the steps
    down to where the two chains meet: two steps of one chain have the depths of the step where
    they meet plus their hops to it. Steps are recorded after their parents (a parent is always a
    smaller number), so stepping the larger of the two down finds that step; a chain that ends (a
    row without a parent, or a step not recorded) has its end's number as depth, as in `chain_distance`."""
    a, b, a_hops, b_hops = current, sampled_by or 0, 0, 0
    a_end = b_end = False
    while a != b and not (a_end and b_end):
        if a_hops - b_hops - b > limit:
            # The distance is this at least: a's depth is >= 0, b's <= b (a parent is a smaller
            # number). A session the base model (step 0) or a step long gone answered is found
            # stale without walking the chain down to it.
            return True
        walk_a = b_end or (a > b and not a_end)
        node = a if walk_a else b
        parent = parents.get(node)
        if parent is not None and parent >= node:  # a hand-edited store: count as chain_distance does
            return chain_distance(parents.everything(), current, sampled_by) > limit
        if walk_a:
            a, a_hops, a_end = (a, a_hops, True) if parent is None else (parent, a_hops + 1, False)
        else:
            b, b_hops, b_end = (b, b_hops, True) if parent is None else (parent, b_hops + 1, False)
    if a == b:
        return a_hops - b_hops > limit
    return (a_hops + a) - (b_hops + b) > limit
