"""The store in one SQLite file (WAL): the embedded default, for one machine.

Writes from the gateway go through the writer thread (group commit, `gateway.store.writer`);
a call recorded while no other is in flight is committed on the event loop at once instead
(`_write_now`), unless that would mean waiting for the lock. The trainer, in its own
process, opens the same file with `SQLiteStore(path)` and uses the synchronous methods. The
schema and connection setup are `gateway.store.sqlite_schema`.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import sqlite_utils

from gateway.store import read_only, sqlite_schema, trainer_lock, training
from gateway.store.base import Store
from gateway.store.health import (
    at_start,
    classify,
    file_identity,
    moved,
    old_wal_removed,
    replaced,
    wal_copied_back,
)
from gateway.store.locks import NoTrainerLock, TrainerLock
from gateway.store.private import private_db_file
from gateway.store.trainer_lock import FileTrainerLock
from gateway.store.writer import Op, Outcome, with_savepoints

CHECKPOINT_EVERY = 256
"""Commits between two WAL checkpoints (SQLite's own default is about every 1,000 pages)."""


class SQLiteStore(Store):
    """`SQLiteStore(path)` for a file, `SQLiteStore(memory=True)` for tests, `SQLiteStore(path,
    read_only=True)` to read a store this user cannot write (export; `gateway.store.read_only`)."""

    backend = "sqlite"

    def __init__(
        self,
        path: Path | str | None = None,
        *,
        memory: bool = False,
        synchronous: str = "normal",
        busy_timeout: float = 30.0,
        read_only: bool = False,
    ):
        super().__init__(busy_timeout)
        self._loop_conn: sqlite3.Connection | None = None  # a file store's `_write_now` connection
        self._memory = memory
        self._writes_on_loop = False  # see `_write_now`
        self._write_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._files: list | None = None  # the database file and its WAL the connections write (`_commit`)
        try:
            if read_only:
                self._open_read_only(path, busy_timeout)
            else:
                self._open(path, memory, synchronous, busy_timeout)
        except sqlite3.Error as exc:
            # A damaged file, one locked by another process, a read-only or full disk: the cause
            # and what to do, as the commands' one line, not a traceback.
            failure = classify(exc, busy_timeout)
            if failure is None:
                raise
            message = f"cannot open the store {path}: {at_start(failure.message)}"
            raise type(failure)(message, cause=failure.cause) from exc
        self.checkpoints = 0  # WAL checkpoints the writer thread ran

    def lock_trainer(self, model: str) -> TrainerLock:
        """An flock beside the database file (`FileTrainerLock`): one trainer per model and file."""
        return NoTrainerLock() if self._memory else FileTrainerLock(Path(self.path), model)

    def give_back_dead_claims(self, model: str) -> int:
        if self._memory or not self._query(trainer_lock.CLAIMED, (model,))[0]["n"]:
            return 0  # nothing claimed: the lock is left alone (a trainer starting never waits for it)
        release = partial(self._run_sync, lambda conn: training.release_model_claims(conn, model))
        return trainer_lock.give_back_sqlite(Path(self.path), model, release)

    def _open_read_only(self, path: Path | str | None, busy_timeout: float) -> None:
        """One read-only connection for reads and writes alike (a write fails as the read-only
        store it is); no schema created or migrated, no modes tightened: nothing is written."""
        if path is None:
            raise ValueError("a read-only store needs a path")
        self._conn = self._read_conn = read_only.connect_read_only(path, busy_timeout)
        self.path = path
        self.db = sqlite_utils.Database(self._conn)

    def _open(self, path: Path | str | None, memory: bool, synchronous: str, busy_timeout: float) -> None:
        if memory:
            # One shared in-memory database, reachable from the writer thread too.
            uri = f"file:rlproxy-{id(self)}?mode=memory&cache=shared"
            self._conn = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
            self._read_conn = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
        else:
            if path is None:
                raise ValueError("Store needs a path, or memory=True")
            private_db_file(path)
            self._conn = sqlite_schema.connect(path, synchronous, busy_timeout)
            self._read_conn = sqlite_schema.connect(path, synchronous, busy_timeout)
            # `_write_now`'s own connection, whose BEGIN never waits for the lock (busy timeout 0):
            # cheaper than switching the writer connection's timeout off and on for each call.
            loop_conn = self._loop_conn = sqlite_schema.connect(path, synchronous, 0)
            # Checkpoints run in the writer thread (`_checkpoint`), never in a commit made on
            # the event loop (`_write_now`): a checkpoint fsyncs the database file.
            for conn in (self._conn, loop_conn):
                conn.execute("PRAGMA wal_autocheckpoint=0")
            self._writes_on_loop = True
            self._file_path = os.path.abspath(path)  # a later chdir changes nothing
        self.path = path
        self.db = sqlite_utils.Database(self._conn)
        self._conn.executescript(sqlite_schema.SCHEMA)
        sqlite_schema.add_missing_columns(self._conn)
        if not memory:  # the WAL exists now (the schema was written), and lasts as long as the connections
            self._files, self._shm = self._files_now(), file_identity(self._file_path + "-shm")

    def _close_connections(self) -> None:
        # Under the locks: a read still running in a worker thread (a poll that outlived the
        # app) finishes first. sqlite3 closed under a running statement can crash the process.
        restored = self._files is not None and replaced(self._files, self._files_now())
        with self._write_lock:
            whole = restored and wal_copied_back(self._conn, self._file_path)  # into the file replaced
            self._conn.close()
            if self._loop_conn is not None:
                self._loop_conn.close()
        with self._read_lock:
            self._read_conn.close()
        if whole and self._files is not None:
            old_wal_removed(self._file_path, self._files[1], self._shm)

    def _write_now(self, op: Op) -> Outcome | None:
        """`op` committed at once on the event loop: for a call recorded while no other is in
        flight and nothing is queued for the writer thread. With one call at a time, the
        hand-off to the thread and back was ~0.1 ms of what the gateway adds to a call
        (bench/README.md); concurrent calls still go through the thread, many to a commit.
        Never waits: None, and the caller queues the write, when the write lock is taken in
        this process (the writer thread) or in another (the trainer): the writer thread does
        the waiting, and says what a failing store failed with."""
        if not self._writes_on_loop or not self._write_lock.acquire(blocking=False):
            return None
        try:
            conn = self._loop_conn
            assert conn is not None  # a file store (`_writes_on_loop`) always has one
            try:
                _begin(conn)
            except sqlite3.Error:
                return None
            return self._commit_round(conn, [op])[0]
        finally:
            self._write_lock.release()

    def _run_sync(self, op: Op) -> Any:
        with self._write_lock:
            conn = self._conn
            try:
                _begin(conn)
                result = op(conn)
                self._commit(conn)
            except BaseException as exc:
                _rollback(conn)
                self._raise_failure(exc)
                raise
            return result

    def _apply_batch(self, ops: list[Op]) -> list[Outcome]:
        """Run every op in one transaction; an op that raises is rolled back alone."""
        with self._write_lock:
            conn = self._conn
            try:
                _begin(conn)
            except BaseException as exc:
                _rollback(conn)
                self._raise_failure(exc)
                raise
            return self._commit_round(conn, ops)

    def _commit_round(self, conn: sqlite3.Connection, ops: list[Op]) -> list[Outcome]:
        """`ops` in the transaction just begun on `conn` (write lock held), then COMMIT."""
        outcomes: list[Outcome] = []
        try:
            if len(ops) == 1:  # one call at a time: the transaction is the op's savepoint
                try:
                    outcomes.append((True, ops[0](conn)))
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    if classify(exc) is not None:
                        raise
                    _rollback(conn)
                    return [(False, exc)]
            else:
                try:  # ops rarely fail: first without a savepoint each (two statements an op)
                    for op in ops:
                        outcomes.append((True, op(conn)))
                except Exception as exc:  # noqa: BLE001 - one op failed: again, each op alone
                    if classify(exc) is not None:
                        raise
                    _rollback(conn)
                    _begin(conn)
                    outcomes = with_savepoints(conn, ops, fails_the_round=lambda exc: classify(exc) is not None)
            self._commit(conn)
        except BaseException as exc:
            _rollback(conn)
            self._raise_failure(exc)
            raise
        self.commits += 1
        if self.commits % CHECKPOINT_EVERY == 0 and self._writer is not None and self._writes_on_loop:
            self._writer.request_checkpoint()
        return outcomes

    def _files_now(self) -> list:
        return [file_identity(self._file_path + suffix) for suffix in ("", "-wal")]

    def _commit(self, conn: sqlite3.Connection) -> None:
        """COMMIT, if the database file and its WAL at `path` are still those the connections
        opened: SQLite writes on into files deleted or replaced under it, and nothing tells it (nor
        a client) until the data is gone at the next start. A WAL deleted (`rm rlproxy.db-wal`, a
        clean-up) lost every call since the last checkpoint at the next crash, acknowledged ones
        too; what the deleted WAL holds is copied into the database file before refusing."""
        if self._files is not None and self._files_now() != self._files:
            _rollback(conn)
            if self._files_now()[0] == self._files[0]:
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
            raise moved(self.path, replaced=replaced(self._files, self._files_now()))
        conn.execute("COMMIT")

    def _checkpoint(self) -> None:
        """Copy the WAL back into the database file (PASSIVE: readers are never waited for),
        in the writer thread: the store's connection checkpoints only here."""
        with self._write_lock:
            try:
                self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
                self.checkpoints += 1
            except sqlite3.Error:  # a failing disk shows in the next write, with its cause
                pass

    async def probe(self) -> None:
        """A write as large as a typical call, committed (and removed in the same
        transaction): succeeds only when calls can be recorded again. Raises the store's
        failure otherwise. Used while the store is degraded (by `/healthz` and before each
        call), so the gateway notices by itself that the cause went away. Only a probe ends
        the degraded state: a small write (a reward) may fit where a call does not."""

        def op(conn: sqlite3.Connection) -> None:
            conn.execute("INSERT INTO store_probe (payload, created_at) VALUES (zeroblob(16384), ?)", (time.time(),))
            conn.execute("DELETE FROM store_probe")

        await self._submit(op)
        self.health.recovered()

    def _query(self, sql: str, params: tuple | dict = ()) -> list[dict]:
        with self._read_lock:
            return self._read(sql, params)

    def _read(self, sql: str, params: tuple | dict = ()) -> list[dict]:
        try:
            cursor = self._read_conn.execute(sql, params)
            names = [d[0] for d in cursor.description]
            return [dict(zip(names, row, strict=False)) for row in cursor.fetchall()]
        except sqlite3.Error as exc:
            self._raise_failure(exc)
            raise

    @contextmanager
    def _snapshot(self) -> Iterator[Callable[[str, tuple], list[dict]]]:
        """Reads in one read transaction (WAL: its snapshot is taken at the first read). Not in
        memory (tests): shared-cache locks are per table, and a writer would fail, not wait."""
        with self._read_lock:
            conn = self._read_conn
            if self._memory:
                yield self._read
                return
            _rollback(conn)
            conn.execute("BEGIN")
            try:
                yield self._read
            finally:
                _rollback(conn)

    def ready_groups(self, model: str, split: str = "train", limit: int | None = None) -> list[dict]:
        sql = sqlite_schema.READY_GROUPS + (f" LIMIT {int(limit)}" if limit else "")
        return self._query(sql, {"model": model, "split": split})


def _begin(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:
        _rollback(conn)  # an earlier round's COMMIT or ROLLBACK failed half-way and left it open
    conn.execute("BEGIN IMMEDIATE")


def _rollback(conn: sqlite3.Connection) -> None:
    """Roll back whatever is open; a failing ROLLBACK (the disk that failed the COMMIT) must
    not hide the first error nor leave the next round inside this transaction."""
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass
