"""A trainer's lock in the store, and the claims of a trainer that no longer holds it given back.

A step claims its groups (`training.claim_for_step`): from then on their rewards are refused (409,
"is being trained") and their new calls marked late, until the step is recorded or gives them
back. A trainer killed mid-step (SIGKILL, out of memory, its machine gone) does neither: only the
next trainer's start (`release_model_claims`) gave them back, and with `serve --trainer off` and no
trainer started again its groups were blocked for ever. Whether the trainer still lives is what
its lock in the store says, a lock that dies with the process:

- SQLite: an `flock` on a file beside the database, one per model (`FileTrainerLock`): the kernel
  drops it when the process dies, and it is per open file, so even a gateway and a trainer of
  one process (the tests') tell each other apart.
- PostgreSQL: the session advisory lock (`locks.try_lock_trainer`), dropped with its connection.

`give_back_if_dead` (a gateway's upkeep, every --poll-interval) takes that lock for the length of
one transaction: taken, no trainer holds it, and the claims are given back inside it, so a trainer
starting meanwhile waits for it (`TAKE_WAIT_S`) and cannot claim in between: exactly once, and
never a live trainer's. A trainer whose lock was dropped while it lived (PostgreSQL restarted
under a long step) may have its claims given back: its step then records nothing
(`insert_step(claimed=True)` refuses), and its groups train again.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.errors import TrainerBusy
from gateway.store.locks import NoTrainerLock, TrainerLock, try_lock_trainer_for_transaction

TAKE_WAIT_S = 3.0  # how long a trainer waits for a lock a gateway holds to check it (one transaction)

# The groups a step of `model` claimed and never recorded: the claims a dead trainer leaves.
CLAIMED = "SELECT COUNT(*) AS n FROM groups WHERE model = ? AND claimed_step IS NOT NULL AND trained_step IS NULL"


def lock_path(database: Path, model: str) -> Path:
    """The lock file of `model`'s trainer beside the SQLite `database` (a model name may hold anything)."""
    return database.with_name(f"{database.name}.trainer-{hashlib.sha256(model.encode()).hexdigest()[:16]}.lock")


def _open(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def waiting(take: Callable[[], bool]) -> bool:
    """`take()` again for up to `TAKE_WAIT_S`: a gateway checking the lock holds it for a moment."""
    deadline = time.monotonic() + TAKE_WAIT_S
    while not take():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class FileTrainerLock:
    """SQLite's `TrainerLock`: one trainer per model and database file, whatever its state dir."""

    def __init__(self, database: Path, model: str) -> None:
        fd = _open(lock_path(database, model))
        if not waiting(lambda: _try_flock(fd)):
            os.close(fd)
            raise TrainerBusy(
                f"another trainer is training model '{model}' on the store {database}: one trainer per model "
                "and store; stop it, or train under another --model-name"
            )
        self._fd: int | None = fd

    def ensure(self) -> None:
        return None  # an flock is lost only with its process

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def give_back_sqlite(database: Path, model: str, release: Callable[[], int]) -> int:
    """`release()` (the claims given back, in one transaction) while holding `model`'s trainer lock
    file, where no trainer holds it; 0 where one does, or none ever took it (no file)."""
    path = lock_path(database, model)
    if not path.exists():
        return 0
    fd = _open(path)
    try:
        if not _try_flock(fd):
            return 0  # a live trainer: its claims are its own
        return release()
    finally:
        os.close(fd)  # the flock with it


def give_back_postgres(conn: Any, model: str, release: Callable[[Any], int]) -> int:
    """In the transaction of `conn`: `release(conn)` if no trainer holds `model`'s advisory lock,
    which this transaction then holds until it ends (a trainer starting meanwhile waits)."""
    if not try_lock_trainer_for_transaction(conn, model):
        return 0
    return release(conn)


class TrainerLockRows:
    """The trainer lock's part of `Store`, as a store without one answers (a mixin: the class
    stays within its size limit); each backend's store overrides both."""

    def lock_trainer(self, model: str) -> TrainerLock:
        """Hold `model`'s trainer lock on this store until it is released (TrainerBusy: held elsewhere).
        Nothing to hold in an SQLite store in memory (one process's, its tests')."""
        return NoTrainerLock()

    def give_back_dead_claims(self, model: str) -> int:
        """The claims of a trainer of `model` that no longer holds its lock given back (`trainer_lock`)."""
        return 0  # a store with no trainer lock (in memory) cannot tell a dead trainer from a live one
