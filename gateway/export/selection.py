"""Which recorded sessions an export covers.

The filters are ANDed. `since_step` looks at the policy that produced the data, not at
when it was trained: a session is kept when every one of its calls was answered by adapter
step `since_step` or later (the base model counts as step 0), the way one takes "what
`agent@40` and its successors did" for distillation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import sqlite_utils

from gateway.errors import InvalidRequest, NotFound
from gateway.store import Store
from trainer.data import sampling_step


@dataclass(frozen=True)
class SessionFilter:
    split: str | None = None
    """"train" or "val"; None: both."""
    rewarded: bool = False
    """Only sessions with a reward."""
    min_reward: float | None = None
    """Only sessions whose reward is at least this (implies `rewarded`)."""
    since_step: int | None = None
    """Only sessions every call of which was answered by this adapter step or a later one."""
    groups: tuple[str, ...] = ()
    """Only sessions of these groups; empty: any group."""
    include_discarded: bool = False
    """Discarded sessions (failed rollouts) are left out unless asked for."""

    def __post_init__(self) -> None:
        if self.split not in (None, "train", "val"):
            raise InvalidRequest(f"split must be train or val, not {self.split!r}")
        if self.since_step is not None and self.since_step < 0:
            raise InvalidRequest(f"--since-step must be 0 or more, not {self.since_step}")


def open_store(db_path: Path) -> Store:
    if not Path(db_path).is_file():
        raise NotFound(f"no store at {db_path}: pass the --state-dir the gateway ran with")
    return Store(db_path)


def close_store(store: Store) -> None:
    """Close a store opened for reading (no writer task was started)."""
    store._conn.close()
    store._read_conn.close()


def select_sessions(store: Store, db_path: Path, where: SessionFilter) -> Iterator[dict]:
    """Sessions (`Store.get_session` dicts, calls included) that pass `where`, oldest first."""
    clauses, params = [], []
    if where.split:
        clauses.append("split = ?")
        params.append(where.split)
    if where.rewarded or where.min_reward is not None:
        clauses.append("reward IS NOT NULL")
    if where.min_reward is not None:
        clauses.append("reward >= ?")
        params.append(float(where.min_reward))
    if where.groups:
        clauses.append(f"group_id IN ({', '.join('?' for _ in where.groups)})")
        params += list(where.groups)
    if not where.include_discarded:
        clauses.append("discarded = 0")
    db = sqlite_utils.Database(db_path)
    try:
        ids = [row["id"] for row in db["sessions"].rows_where(
            " AND ".join(clauses) or None, params, order_by="created_at, rowid", select="id")]
    finally:
        db.conn.close()
    for session_id in ids:
        session = store.get_session(session_id)
        if where.since_step is not None:
            answered = [c for c in session["calls"] if c.get("status") == "ok"]
            if not answered or sampling_step(answered) < where.since_step:
                continue
        yield session
