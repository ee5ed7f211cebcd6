"""One worker per model: a lock file in the checkpoint directory.

The kernel releases an `flock` when its process dies, even by SIGKILL, so a lock left by a
crashed worker never blocks the next one; a second live worker fails fast instead.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import TextIO

from gateway.errors import ConfigError


def take_lock(root: Path, model: str) -> TextIO:
    """Lock `root/.worker.lock` for this process (the open file holds the lock: keep it,
    close it to release), or raise `ConfigError` naming the worker that holds it."""
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
