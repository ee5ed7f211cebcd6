"""Which recorded sessions an export covers.

The filters are ANDed. `since_step` looks at the policy that produced the data, not at
when it was trained: a session is kept when every one of its calls was answered by adapter
step `since_step` or later (the base model counts as step 0), the way one takes "what
`agent@40` and its successors did" for distillation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

from gateway.errors import NotFound
from gateway.store import SessionFilter, Store
from gateway.store.open import open_store as open_backend
from trainer.data import sampling_step


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
    ids = store.select_session_ids(where)
    for session_id in ids:
        session = store.get_session(session_id)
        if where.since_step is not None:
            answered = [c for c in session["calls"] if c.get("status") == "ok"]
            if not answered or sampling_step(answered) < where.since_step:
                continue
        yield session
