"""The state dir and the database files are this user's alone: 0700 and 0600.

The state dir holds every recorded conversation (the SQLite file), the adapters trained on them
and the managed vLLM's socket: no other local user may read or reach any of it. Modes are set
with chmod after creating, not left to the process umask (022 is common and would leave
everything readable). A state dir or database that an older rlproxy left looser is tightened
at start, and the log says so in one line; only group and other bits are taken away.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from gateway.errors import ConfigError

log = logging.getLogger("rlproxy.store")

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
DB_NAME = "rlproxy.db"
# SQLite's own files beside the database: it creates them with the database's mode.
DB_SUFFIXES = ("", "-wal", "-shm", "-journal")
SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file


def private_state_dir(state_dir: Path | str) -> Path:
    """Create the state dir 0700, or tighten an existing one and its database files. One that
    cannot be a directory of ours (a file, under a file, read-only) is a ConfigError naming it:
    the CLI prints that in one line, not an OSError's traceback from deep in the store."""
    path = Path(state_dir)
    if path.exists() and not path.is_dir():  # checked first: _tighten would chmod the file
        raise ConfigError(f"--state-dir {path} is a file, not a directory: pass a directory (it is created if missing)")
    try:
        changes = [] if make_private_dir(path) else _tighten(path, PRIVATE_DIR)
        changes += _tighten_db(path / DB_NAME)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(
            f"--state-dir {path} cannot be used ({reason}): pass a directory this user can create and write"
        ) from exc
    _say(changes)
    return path


def private_db_file(path: Path | str) -> None:
    """The SQLite file 0600 before SQLite opens it (its -wal and -shm then get the same mode);
    an existing one, and its -wal and -shm, tightened. One that cannot be created: ConfigError."""
    path = Path(path)
    try:
        make_private_dir(path.parent)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, PRIVATE_FILE)
    except FileExistsError:
        _say(_tighten_db(path))
        return
    except OSError as exc:  # a directory not ours, a read-only disk: one line, not a traceback
        raise ConfigError(
            f"cannot create the store {path} ({exc.strerror or exc}): make {path.parent} writable by "
            "this user (and its disk mounted read-write), or pass another --state-dir"
        ) from exc
    os.fchmod(fd, PRIVATE_FILE)
    os.close(fd)


def make_private_dir(path: Path) -> bool:
    """Create `path` 0700 (its parents as the umask has them); True if it is new. An existing
    one is left as it is."""
    try:
        path.mkdir(parents=True, mode=PRIVATE_DIR)
    except FileExistsError:
        return False
    path.chmod(PRIVATE_DIR)  # the umask may have taken owner bits away
    return True


def _tighten_db(db: Path) -> list[str]:
    # A WAL beside it: SQLite's, and maybe open in this process (create_app given a store). Its header is
    # not read then: closing any descriptor of the file drops every POSIX lock this process holds on it,
    # SQLite's included, and another process closing the store next deleted the WAL under the open store.
    wal = db.with_name(db.name + "-wal")
    if not wal.exists() and not is_sqlite(db):  # SQLite refuses it in a moment, saying why; its mode is not ours
        return []
    return [change for suffix in DB_SUFFIXES for change in _tighten(db.with_name(db.name + suffix), PRIVATE_FILE)]


def is_sqlite(path: Path) -> bool:
    """Whether `path` is a file SQLite opens as a database: its header, or empty (a new one). `--store
    /etc/passwd` (any existing file, a directory) was made 0600 first and refused by SQLite after."""
    try:
        with path.open("rb") as file:
            head = file.read(len(SQLITE_HEADER))
    except FileNotFoundError:
        return True  # nothing to tighten: _tighten says so
    except OSError:  # a directory, a file this user cannot read
        return False
    return head in (b"", SQLITE_HEADER)


def _tighten(path: Path, private: int) -> list[str]:
    """Take group and other bits off `path` (not through a link); what changed, as text."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return []
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode) or not mode & ~private:
        return []
    try:
        path.chmod(mode & private)
    except OSError as exc:  # not ours (another user's state dir): say it, serve anyway
        log.warning("%s is readable by other local users (mode %o) and cannot be made private: %s", path, mode, exc)
        return []
    return [f"{path} {mode:o} -> {mode & private:o}"]


def _say(changes: list[str]) -> None:
    if changes:
        log.warning("other local users could read the recorded calls; made them private: %s", ", ".join(changes))
