"""The model cache: where built-in models are built or converted, once per machine.

A build goes to a temporary sibling directory that is renamed into place, so a crash never
leaves a half-written model behind and concurrent builders agree; where the OS has `flock`, a
second process (the trainer beside the gateway) waits for the first's build instead of
repeating minutes of it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def model_cache_dir(state_dir: Path) -> Path:
    """Where the tiny built-in models are built: `RLPROXY_CACHE_DIR` if set (one build per
    machine, shared by every state dir), else the state dir's `cache/` (they take seconds and a
    few MB, so a state dir stays whole on its own)."""
    shared = os.environ.get("RLPROXY_CACHE_DIR")
    return Path(shared).expanduser() if shared else Path(state_dir) / "cache"


def user_cache_dir() -> Path:
    """Where a large built-in model is converted, once per user and machine whatever the state
    dir (`smollm2`: a 93 MB download and 517 MB converted): `RLPROXY_CACHE_DIR` if set, else
    `$XDG_CACHE_HOME/rlproxy`, else `~/.cache/rlproxy`, as pip and Hugging Face keep theirs."""
    shared = os.environ.get("RLPROXY_CACHE_DIR")
    if shared:
        return Path(shared).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "rlproxy"


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """`target`, made by `build(tmp_dir)` unless a `config.json` says it is already there."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _builders_take_turns(target.parent):
        if (target / "config.json").is_file():  # built by the process we waited for
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            build(tmp)
            try:
                os.rename(tmp, target)
            except OSError:
                if not (target / "config.json").is_file():  # not a lost race: a real failure
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def _builders_take_turns(cache_dir: Path):
    """An exclusive `flock` on the cache directory itself (no lock file to leave behind)."""
    try:
        import fcntl
    except ImportError:  # no flock: concurrent builds stay correct (atomic rename), only slower
        yield
        return
    fd = os.open(cache_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
