"""One worker per model: a lock file in the checkpoint directory, and one in the store.

The kernel releases an `flock` when its process dies, even by SIGKILL, so a lock left by a
crashed worker never blocks the next one; a second live worker fails fast instead. A worker
on another machine shares no checkpoint directory, only the store (PostgreSQL): there the
store's own lock (`Store.lock_trainer`, dropped with its connection) refuses it just as fast,
where it would otherwise number its steps as the first does and train diverging weights.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from gateway.errors import ConfigError
from gateway.store import Store


@dataclass
class WorkerLock:
    """Both locks a worker holds; `close` releases them."""

    file: TextIO
    release_store: Callable[[], None]

    def close(self) -> None:
        self.release_store()
        self.file.close()


def take_lock(root: Path, model: str, store: Store) -> WorkerLock:
    """Lock `root/.worker.lock` and `model` in `store` for this process (keep what is returned,
    close it to release), or raise `ConfigError` naming who holds it."""
    lock_file = _take_file_lock(root, model)
    try:
        release_store = store.lock_trainer(model)
    except BaseException:
        lock_file.close()
        raise
    return WorkerLock(lock_file, release_store)


def _take_file_lock(root: Path, model: str) -> TextIO:
    root.mkdir(parents=True, exist_ok=True)
    lock = open(root / ".worker.lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise ConfigError(
            f"another trainer worker ({holder}) is training model '{model}' in {root}; "
            "stop it, or use --trainer off beside a separate `rlproxy train`"
        ) from None
    lock.truncate(0)
    lock.write(f"pid {os.getpid()}")
    lock.flush()
    return lock
