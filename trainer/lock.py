"""One worker per model: a lock file in the checkpoint directory, and one in the store.

The kernel releases an `flock` when its process dies, even by SIGKILL, so a lock left by a
crashed worker never blocks the next one; a second live worker fails fast instead. A worker
on another machine shares no checkpoint directory, only the store (PostgreSQL): there the
store's own lock (`Store.lock_trainer`, dropped with its connection) refuses it just as fast,
where it would otherwise number its steps as the first does and train diverging weights. That
lock goes when its connection does (PostgreSQL restarted): `WorkerLock.check`, before each step,
takes it again, or stops this worker where another took it meanwhile.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from gateway.errors import TrainerBusy
from gateway.store import Store
from gateway.store.locks import TrainerLock


@dataclass
class WorkerLock:
    """Both locks a worker holds; `close` releases them."""

    file: TextIO
    store_lock: TrainerLock

    def check(self) -> None:
        """Still this worker's (the store's lock taken again if its connection dropped), else TrainerBusy."""
        self.store_lock.ensure()

    def close(self) -> None:
        self.store_lock.release()
        self.file.close()


def take_lock(root: Path, model: str, store: Store) -> WorkerLock:
    """Lock `root/.worker.lock` and `model` in `store` for this process (keep what is returned,
    close it to release), or raise `TrainerBusy` naming who holds it."""
    lock_file = _take_file_lock(root, model)
    try:
        store_lock = store.lock_trainer(model)
    except BaseException:
        lock_file.close()
        raise
    return WorkerLock(lock_file, store_lock)


def _take_file_lock(root: Path, model: str) -> TextIO:
    root.mkdir(parents=True, exist_ok=True)
    return hold_pid_file(
        root / ".worker.lock",
        lambda holder: TrainerBusy(
            f"another trainer worker ({holder}) is training model '{model}' in {root}; "
            "stop it, or use --trainer off beside a separate `rlproxy train`"
        ),
    )


def hold_pid_file(path: Path, busy: Callable[[str], Exception]) -> TextIO:
    """An exclusive `flock` on `path`, with this process's pid written in it (keep the file
    returned, close it to release; the kernel drops it when the process dies, even by SIGKILL),
    or raise `busy(holder)`, the holder read from the file."""
    lock = open(path, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise busy(holder) from None
    lock.truncate(0)
    lock.write(f"pid {os.getpid()}")
    lock.flush()
    return lock
