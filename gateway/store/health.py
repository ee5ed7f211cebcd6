"""What to say when the store cannot write, and whether it can now.

`classify` turns SQLite's failures of the disk or the file (full, read-only, locked by
another process, gone, damaged) into `StoreUnavailable`/`StoreFull`, with the cause and what
to do; anything else (a constraint, a bug) is not the store's health and stays as it is.
`StoreHealth` remembers the failure until a write commits again, for `/healthz`, for the
chat service (which then probes before doing engine work) and for `/metrics`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sqlite3
import time
from pathlib import Path

from gateway.errors import StoreFull, StoreUnavailable

log = logging.getLogger("rlproxy.store")

_RECOVERS = "the gateway recovers by itself once that is fixed, no restart needed"


def at_start(message: str) -> str:
    """A failure's message as said when the store could not be opened: the command stops there,
    so it does not recover by itself; it has to be run again."""
    return message.replace(f"; {_RECOVERS}.", "; then run the command again.")


# SQLite's primary result codes (the low byte of the extended code).
_FULL, _READONLY, _BUSY, _LOCKED, _IOERR, _CANTOPEN, _CORRUPT, _PROTOCOL, _NOTADB = 13, 8, 5, 6, 10, 14, 11, 15, 26

_BY_MESSAGE = (
    ("disk is full", _FULL),
    ("readonly", _READONLY),
    ("is locked", _BUSY),
    ("disk I/O", _IOERR),
    ("unable to open", _CANTOPEN),
    ("malformed", _CORRUPT),
    ("not a database", _NOTADB),
)


def classify(exc: BaseException, busy_timeout: float = 30.0) -> StoreUnavailable | None:
    """The store failure `exc` amounts to, or None when it is not one."""
    if isinstance(exc, StoreUnavailable):
        return exc
    if type(exc).__module__.split(".")[0] in ("psycopg", "psycopg_pool"):
        return _classify_postgres(exc, busy_timeout)
    if not isinstance(exc, sqlite3.Error) or isinstance(exc, sqlite3.IntegrityError):
        return None
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+
    if code is None:
        code = next((c for text, c in _BY_MESSAGE if text in str(exc)), None)
        if code is None:
            return None
    primary, name = code & 0xFF, getattr(exc, "sqlite_errorname", f"SQLite error {code}")
    if primary == _FULL:
        return StoreFull(
            f"the store cannot record: the disk holding the gateway's state dir is full ({name}). "
            f"Free space on that disk (or give the store a page limit it can grow into); {_RECOVERS}.",
            cause="full",
        )
    if primary == _READONLY:
        return StoreUnavailable(
            f"the store cannot record: its file is read-only ({name}). Make the state dir and "
            f"its files writable by the gateway (and the disk mounted read-write); {_RECOVERS}.",
            cause="read_only",
        )
    if primary in (_BUSY, _LOCKED):
        return StoreUnavailable(
            f"the store cannot record: another process has held its write lock for over "
            f"{busy_timeout:g} s ({name}). Stop whatever keeps a long write transaction open "
            f"on the store (a backup, a sqlite3 shell); {_RECOVERS}.",
            cause="locked",
        )
    if primary in (_IOERR, _CANTOPEN, _PROTOCOL):
        return StoreUnavailable(
            f"the store is unavailable: the disk or file under the state dir failed ({name}: "
            f"{exc}). Check that the disk is mounted, writable and has room; {_RECOVERS}.",
            cause="unavailable",
        )
    if primary in (_CORRUPT, _NOTADB):
        return StoreUnavailable(
            f"the store file is damaged ({name}). Restore it from a backup or move it away "
            "(the gateway starts a new one).",
            cause="damaged",
        )
    return None


def file_identity(path: Path | str) -> tuple[int, int] | None:
    """The file now at `path` (device, inode), or None when there is none."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return None
    return found.st_dev, found.st_ino


def moved(path: Path | str, *, replaced: bool = False) -> StoreUnavailable:
    """The store's file (or its WAL) was deleted or replaced under the running gateway (`rm -rf` of
    the state dir, a clean-up of `-wal` files, a restore by copy): SQLite carried on writing to the
    open, deleted file and every call was answered 200, then lost when the process ended. `replaced`:
    another database file lies at the path now, which a restart opens (a restore from a backup)."""
    if replaced:
        return StoreUnavailable(
            f"the store cannot record: its file {path} was replaced while the gateway ran (restored from a "
            "backup, or copied over), so what it wrote would go to the file no longer there. A restore takes "
            "effect at a restart: stop the gateway and the trainer (every process using the store) and start "
            f"them again on the file now at that path (a restore into the running store, `sqlite3 {path} "
            f'".restore BACKUP"`, needs none). If it was replaced by mistake, put the original back; {_RECOVERS}.',
            cause="moved",
        )
    return StoreUnavailable(
        f"the store cannot record: its file {path} (or its WAL, {path}-wal) was deleted, moved or "
        "replaced while the gateway ran, so what it wrote would be lost. Put the file back where it "
        f"was (move it back); {_RECOVERS}. If it is gone for good, restart the gateway (and the "
        "trainer): they start on the files at that path.",
        cause="moved",
    )


def replaced(opened: list, now: list) -> bool:
    """Whether another database file lies at the store's path `now` than the one `opened` (their
    [file, WAL] identities): a restore from a backup, a copy over it; not a file deleted or moved away."""
    return now[0] is not None and now[0] != opened[0]


def wal_copied_back(conn: sqlite3.Connection, path: str) -> bool:
    """Copy what the WAL holds into the database file it belongs to, replaced at `path` and wherever it
    went now (a FULL checkpoint, through the connection's open file; readers waited for up to the busy
    timeout). Whether all of it went: only then may the WAL go (`old_wal_removed`)."""
    try:
        busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(FULL)").fetchone()
    except sqlite3.Error:
        busy, frames, copied = 1, 0, 0
    if busy or copied < frames:
        log.error(
            "the store file %(p)s was replaced while open, and %(p)s-wal still holds writes of the file it "
            "replaced: once every process using the store has stopped, remove %(p)s-wal and %(p)s-shm before "
            "starting on the file now there (else they are read over it)",
            {"p": path},
        )
        return False
    return True


def old_wal_removed(path: str, wal: tuple[int, int] | None, shm: tuple[int, int] | None) -> None:
    """At the close of a store whose file was replaced at `path` (a restore from a backup): remove the
    WAL and shared-memory files beside it where they are still the replaced file's (`wal`, `shm`: their
    identities when it opened), as SQLite does at its last close of an unmoved file and skips for a moved
    one. Left there, the next start read the replaced file's last writes from that WAL over the file
    restored (the restore undone, or the two mixed: a damaged store). Their content went into the
    replaced file first (`wal_copied_back`), wherever it was moved to."""
    for suffix, identity in (("-wal", wal), ("-shm", shm)):
        if identity is not None and file_identity(path + suffix) == identity:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path + suffix)
                log.warning(
                    "the store file %s was replaced while open: %s%s, the old file's, removed", path, path, suffix
                )


def stalled(seconds: float, what: str = "a write") -> StoreUnavailable:
    """The store's writer (or `what`) has waited `seconds`: the database does not answer."""
    return StoreUnavailable(
        f"the store is unavailable: {what} has waited {seconds:.0f} s for the database without an "
        "answer (the server or the disk under it hangs, or another session keeps its locks). Check "
        f"the database server or the disk; {_RECOVERS}.",
        cause="unavailable",
    )


def stalled_at_exit(seconds: float) -> StoreUnavailable:
    """The gateway stopped while a write of its store had gone `seconds` without an answer."""
    return StoreUnavailable(
        f"the store did not answer for {seconds:.0f} s while the gateway stopped (the disk or the database "
        "server hangs): what it was writing is not recorded; nothing of it had been acknowledged",
        cause="unavailable",
    )


def _classify_postgres(exc: BaseException, busy_timeout: float) -> StoreUnavailable | None:
    """psycopg's failures of the server or the connection (by SQLSTATE; a pool timeout or a
    lost connection has none). A constraint, a syntax error, a bug: None, not the store's health."""
    state = getattr(exc, "sqlstate", None) or ""
    if state == "53100":
        return StoreFull(
            "the store cannot record: PostgreSQL's disk is full (53100 disk_full). Free space on the "
            f"database server's disk; {_RECOVERS}.",
            cause="full",
        )
    if state == "25006":
        return StoreUnavailable(
            "the store cannot record: the PostgreSQL server is read-only (25006; a standby, or "
            f"default_transaction_read_only). Point --store at the primary; {_RECOVERS}.",
            cause="read_only",
        )
    if state == "55P03":
        return StoreUnavailable(
            "the store cannot record: another session has held a lock the store needs (a row, a table) "
            f"for over {busy_timeout:g} s (55P03 lock_not_available). End whatever keeps a long transaction "
            f"open on the database (see pg_stat_activity: an idle psql `BEGIN`, a stuck job); {_RECOVERS}.",
            cause="locked",
        )
    if state.startswith("23") or state.startswith("42") or state.startswith("22"):
        return None  # the statement's fault (constraint, SQL, data), not the server's
    kind = type(exc).__name__
    if state[:2] in ("08", "53", "57", "58") or (
        not state and kind in ("OperationalError", "PoolTimeout", "PoolClosed", "InterfaceError")
    ):
        return StoreUnavailable(
            f"the store is unavailable: PostgreSQL cannot be reached or refused the work "
            f"({kind}{' ' + state if state else ''}: {str(exc).strip()[:200]}). Check that the "
            f"server is running and reachable at --store; {_RECOVERS}.",
            cause="unavailable",
        )
    return None


class StoreHealth:
    """The store's last failure, until a write commits again; error counts by cause."""

    def __init__(self) -> None:
        self.failure: StoreUnavailable | None = None
        self.since: float | None = None
        self.errors: collections.Counter[str] = collections.Counter()

    @property
    def degraded(self) -> bool:
        return self.failure is not None

    def failed(self, error: StoreUnavailable) -> None:
        self.errors[error.cause] += 1
        if self.failure is None or self.failure.cause != error.cause:
            log.error("store failure: %s", error.message)
            self.since = time.time()
        self.failure = error

    def check_writer(self, waited: float, timeout: float) -> None:
        """Raise, noted here, while the writer's round has `waited` past `timeout`: a database or
        disk that does not answer (PostgreSQL frozen, its host gone without a word, an NFS stall).
        Queued behind that round, every call and reward hung for as long as it did while /healthz
        said ok; now they are refused and the store is degraded until a probe commits. What was
        queued before still lands, or fails, with that round."""
        if waited > timeout:
            failure = stalled(waited)
            self.failed(failure)
            raise failure

    def recovered(self) -> None:
        if self.failure is not None:
            log.warning(
                "store recovered after %.1f s (%s)", time.time() - (self.since or time.time()), self.failure.cause
            )
            self.failure = None
            self.since = None

    def report(self) -> dict:
        if self.failure is None:
            return {"status": "ok"}
        return {"status": "degraded", "cause": self.failure.cause, "reason": self.failure.message, "since": self.since}
