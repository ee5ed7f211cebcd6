"""An SQLite store opened for reading only: `rlproxy export` from a store it cannot write.

A store copied to read-only media (a mounted backup, a DVD, a `ro` bind mount) or a file
this user may read but not write could not be exported: the store's normal opening sets
WAL mode, creates the schema and migrates it, all writes, and SQLite in WAL mode wants to
create the `-shm` (and `-wal`) file beside the database. Here the file is opened
`mode=ro`, which reads a WAL store whose `-shm` exists or can be created. In a directory
this user cannot write, with no `-shm` there, SQLite refuses that (`_NO_SHM`); then a
store with no WAL content left (closed cleanly: its last connection copied the WAL back into
the file) is read `immutable=1`, which needs no `-shm`. A store whose `-wal` still holds
commits cannot be read that way without losing them: a clear error says to copy it to a
writable directory. Nothing is migrated: a store of an older schema is refused the same way.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from urllib.parse import quote

from gateway.errors import ConfigError
from gateway.store.sqlite_schema import SCHEMA_VERSION

# What SQLite answers `mode=ro` when it cannot create the -shm: CANTOPEN on a read-only mount,
# READONLY_DIRECTORY (READONLY's extended code) in a directory this user may not write.
_NO_SHM = (14, 8)


def writable(path: Path | str) -> bool:
    """Whether this user can write the store at `path` the way SQLite in WAL mode needs: the
    file and its directory (for the -wal and -shm). A read-only mount answers False, for root too."""
    path = Path(path)
    return os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)


def uri(path: Path | str, *, immutable: bool = False) -> str:
    """The SQLite URI that opens `path` read-only (absolute, its characters quoted: a `?` or
    `#` in a directory name is part of the path, not the URI's query)."""
    quoted = quote(str(Path(path).resolve()), safe="/")
    return f"file:{quoted}?{'immutable=1' if immutable else 'mode=ro'}"


def connect_read_only(path: Path | str, busy_timeout: float = 30.0) -> sqlite3.Connection:
    """A read-only connection to the store at `path`, its schema checked (see the module's note)."""
    path = Path(path)
    try:
        conn = _connect(uri(path), busy_timeout)
    except sqlite3.OperationalError as exc:
        if (getattr(exc, "sqlite_errorcode", 14) & 0xFF) not in _NO_SHM:
            raise
        wal = path.with_name(path.name + "-wal")
        if wal.exists() and wal.stat().st_size > 0:
            raise ConfigError(
                f"cannot read the store {path} where it is: its write-ahead log {wal.name} holds commits "
                f"that SQLite reads only with a {path.name}-shm file, which cannot be created in "
                f"{path.parent} (read-only). Copy {path.name} and {wal.name} to a writable directory "
                "and pass that as --state-dir"
            ) from None
        conn = _connect(uri(path, immutable=True), busy_timeout)  # no WAL content: the file is the store
    try:
        check_schema(conn, path)
    except BaseException:
        conn.close()
        raise
    return conn


def check_schema(conn: sqlite3.Connection, path: Path) -> None:
    """The store's schema is this rlproxy's: nothing can be migrated in a store that cannot be written."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'calls'").fetchone() is None:
        raise ConfigError(f"{path} is not an rlproxy store (it has no calls table)")
    found = conn.execute("PRAGMA user_version").fetchone()[0]
    if found > SCHEMA_VERSION:
        raise ConfigError(
            f"the store's schema is version {found}, newer than this rlproxy's ({SCHEMA_VERSION}): "
            "upgrade rlproxy on this machine"
        )
    if found < SCHEMA_VERSION:
        raise ConfigError(
            f"the store {path} was written by an older rlproxy (schema {found}; this one reads {SCHEMA_VERSION}) "
            "and cannot be brought up to date where it is (read-only): copy it to a writable directory "
            "and pass that as --state-dir"
        )


def _connect(target: str, busy_timeout: float) -> sqlite3.Connection:
    conn = sqlite3.connect(target, uri=True, timeout=busy_timeout, check_same_thread=False, isolation_level=None)
    try:
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()  # SQLite opens lazily: fail here, not later
    except BaseException:
        conn.close()
        raise
    return conn
