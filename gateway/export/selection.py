"""Which recorded sessions an export covers.

The filters are ANDed. `since_step` looks at the policy that produced the data, not at
when it was trained: a session is kept when every one of its calls was answered by adapter
step `since_step` or later (the base model counts as step 0), the way one takes "what
`agent@40` and its successors did" for distillation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gateway.errors import InvalidRequest, NotFound
from gateway.store import Store
from gateway.store_open import open_store as open_backend
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


def store_exists(target: Path | str) -> bool:
    """A store URL (`--store`: its backend says whether it is one), or an SQLite file that is there."""
    return "://" in str(target) or Path(target).is_file()


def open_store(target: Path | str) -> Store:
    """The store at `target`: an SQLite file, or a postgresql:// URL (`--store`)."""
    if not store_exists(target):
        raise NotFound(f"no store at {target}: pass the --state-dir (or --store) the gateway ran with")
    return open_backend(target)


def close_store(store: Store) -> None:
    """Close a store opened for reading (no writer task was started: this closes connections)."""
    asyncio.run(store.close())


def select_sessions(store: Store, where: SessionFilter) -> Iterator[dict]:
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
    # Portable SQL (the PostgreSQL store runs it too): ids break ties between equal times.
    sql = (
        "SELECT id FROM sessions" + (" WHERE " + " AND ".join(clauses) if clauses else "") + " ORDER BY created_at, id"
    )
    ids = [row["id"] for row in store._query(sql, tuple(params))]
    for session_id in ids:
        session = store.get_session(session_id)
        if where.since_step is not None:
            answered = [c for c in session["calls"] if c.get("status") == "ok"]
            if not answered or sampling_step(answered) < where.since_step:
                continue
        yield session
