"""The step rows the dashboard's overview plots, kept between its polls.

The overview charts every step's metrics, and the dashboard asks for them every 5 s: reading
and decoding every step row each time cost more each step the run took (100-170 ms at 5,000
steps, per open dashboard). A step's number, time, metrics and groups never change once it is
recorded (a decision changes its state only), so a poll reads the steps recorded since the last
one. The count of rows tells when one was recorded below the newest kept (another gateway's
trainer, a step recorded out of order): then every row is read again.
"""

from __future__ import annotations

import threading
from typing import Any

from gateway.routes.per_model import PerModel


class StepHistory:
    """One model's step rows as `store.steps` gives them, less what can change (state, decision)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self._lock = threading.Lock()  # polls read in worker threads, maybe two at once

    def read(self, store: Any, model: str) -> list[dict]:
        with self._lock:
            newest = self.rows[-1]["step"] if self.rows else None
            count, added = store.step_history(model, newest)
            if len(self.rows) + len(added) != count:  # a row came below the newest kept, or went
                count, added = store.step_history(model, None)
                self.rows = []
            self.rows = self.rows + added  # a new list: a response being written keeps its own
            return self.rows


_HISTORIES = PerModel(StepHistory)


def step_history(store: Any, model: str) -> list[dict]:
    """`model`'s step rows (step, created_at, metrics, groups), oldest first, read incrementally."""
    return _HISTORIES.get(store, model).read(store, model)
