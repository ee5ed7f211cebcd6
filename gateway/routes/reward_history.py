"""The dashboard's reward curve, kept between its polls.

`store.reward_curve` groups every rewarded session of the run by the step that answered its
first call, a subquery over `calls` per session: 330 ms a poll at 100,000 sessions on SQLite,
every 5 s per open dashboard, more each session rewarded. Every write to a session (a call, a
reward, a discard) sets its updated_at, so a poll reads the sessions written since the last one
(an index range) and moves each into the (split, step) it counts for now, or out. The range
starts `OVERLAP` seconds before the newest updated_at seen: a write stamped before a poll but
committed after it (another gateway, the writer's batch) is read by the next one; reading a
session twice changes nothing. A session deleted (`rlproxy forget`, another process) is never
written again, so no poll sees it go: the curve is read again whole every `REREAD_EVERY` seconds
(counting the sessions at each poll would be the full scan this avoids).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from gateway.routes.per_model import PerModel

OVERLAP = 300.0
"""Seconds of writes each poll reads again: a stamp taken this long before its commit is still seen
(a call is stamped when it is recorded, a reward or a discard inside its write)."""

REREAD_EVERY = 600.0
"""Seconds between whole reads: how long sessions `rlproxy forget` deleted stay in the curve."""


class RewardHistory:
    """One model's rewarded sessions by (split, step), and each bucket's figures."""

    def __init__(self) -> None:
        self.newest: float | None = None  # the newest updated_at read; None: read what counts from the start
        self.where: dict[str, tuple[str, int]] = {}  # session -> its (split, step) bucket
        self.buckets: dict[tuple[str, int], dict[str, float]] = {}  # (split, step) -> session -> reward
        self.figures: dict[tuple[str, int], dict] = {}
        self._lock = threading.Lock()  # polls read in worker threads, maybe two at once
        self._whole_read_at = -math.inf  # time.monotonic() of the last read from the start

    def read(self, store: Any, model: str) -> list[dict]:
        with self._lock:
            if time.monotonic() - self._whole_read_at > REREAD_EVERY:  # drops what was deleted meanwhile
                self.newest, self.where, self.buckets, self.figures = None, {}, {}, {}
            if self.newest is None:
                self._whole_read_at = time.monotonic()
            since = None if self.newest is None else self.newest - OVERLAP
            changed = self._apply(store.reward_changes(model, since))
            for key in changed:
                self._figure(key)
            return [self.figures[key] for key in sorted(self.figures, key=lambda k: (k[1], k[0]))]

    def _apply(self, rows: list[dict]) -> set[tuple[str, int]]:
        changed: set[tuple[str, int]] = set()
        for row in rows:
            changed |= self._move(row)
            if self.newest is None or row["updated_at"] > self.newest:
                self.newest = row["updated_at"]
        return changed

    def _move(self, row: dict) -> set[tuple[str, int]]:
        """Put the session where it counts now (nowhere if it does not); the buckets changed."""
        old = self.where.pop(row["id"], None)
        new = (row["split"], int(row["step"])) if row["counted"] else None
        if old is not None:
            self.buckets[old].pop(row["id"], None)
        if new is not None:
            self.where[row["id"]] = new
            self.buckets.setdefault(new, {})[row["id"]] = float(row["reward"])
        return {key for key in (old, new) if key is not None}

    def _figure(self, key: tuple[str, int]) -> None:
        rewards = list(self.buckets.get(key, {}).values())
        if not rewards:
            self.buckets.pop(key, None)
            self.figures.pop(key, None)
            return
        n = len(rewards)
        mean = sum(rewards) / n
        mean_sq = sum(r * r for r in rewards) / n
        self.figures[key] = {
            "split": key[0],
            "step": key[1],
            "n": n,
            "mean": mean,
            "min": min(rewards),
            "max": max(rewards),
            "std": math.sqrt(max(mean_sq - mean**2, 0.0)),  # as `store.reward_curve` has it
        }


_HISTORIES = PerModel(RewardHistory)


def reward_history(store: Any, model: str) -> list[dict]:
    """`store.reward_curve(model)`, read incrementally: the sessions written since the last poll."""
    return _HISTORIES.get(store, model).read(store, model)
