"""The store: one SQLite file (WAL) that is the only channel between gateway and trainer.

Writes from the gateway go through one writer thread that batches them into a
single transaction per round (group commit); a caller's `await` returns only
after its transaction committed, so a response acknowledged to a client is on
disk. A call recorded while no other is in flight is committed on the event loop
at once instead (`_write_now`), unless that would mean waiting for the lock. The
trainer, in its own process, opens the same file with `Store(path)` and uses the
synchronous methods.

This module is the `Store` class: its lifecycle, the group-commit writer, the
write and read methods. The schema and connection setup live in
`gateway/store_schema.py`; the row types, the packed-array codec and the ops the
writer runs live in `gateway/store_rows.py`. `CallRecord` and the codec are
re-exported here, so `from gateway.store import ...` stays the one import callers need.
"""

from __future__ import annotations

import asyncio
import json
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import sqlite_utils

from gateway import store_lists, store_rows, store_schema
from gateway.errors import Conflict, NotFound
from gateway.store_health import StoreHealth, classify
from gateway.store_rows import CallRecord, pack_floats, pack_ids, unpack_floats, unpack_ids

__all__ = ["CallRecord", "Store", "pack_floats", "pack_ids", "unpack_floats", "unpack_ids"]


CHECKPOINT_EVERY = 256
"""Commits between two WAL checkpoints (SQLite's own default is about every 1,000 pages)."""
_CHECKPOINT = object()  # queued for the writer thread: run a checkpoint


class Store:
    """The SQLite store. `Store(path)` for a file, `Store(memory=True)` for tests."""

    def __init__(
        self,
        path: Path | str | None = None,
        *,
        memory: bool = False,
        synchronous: str = "normal",
        busy_timeout: float = 30.0,
    ):
        if memory:
            # One shared in-memory database, reachable from the writer thread too.
            uri = f"file:rlproxy-{id(self)}?mode=memory&cache=shared"
            self._conn = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
            self._read_conn = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
            self._loop_conn: sqlite3.Connection | None = None
        else:
            if path is None:
                raise ValueError("Store needs a path, or memory=True")
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._conn = store_schema.connect(path, synchronous, busy_timeout)
            self._read_conn = store_schema.connect(path, synchronous, busy_timeout)
            # `_write_now`'s own connection, whose BEGIN never waits for the lock (busy timeout 0):
            # cheaper than switching the writer connection's timeout off and on for each call.
            self._loop_conn = store_schema.connect(path, synchronous, 0)
            # Checkpoints run in the writer thread (`_checkpoint`), never in a commit made on
            # the event loop (`_write_now`): a checkpoint fsyncs the database file.
            for conn in (self._conn, self._loop_conn):
                conn.execute("PRAGMA wal_autocheckpoint=0")
        self._writes_on_loop = not memory  # see `_write_now`
        self.path = path
        self.db = sqlite_utils.Database(self._conn)
        self._write_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._conn.executescript(store_schema.SCHEMA)
        store_schema.add_missing_columns(self._conn)
        self._queue: queue.SimpleQueue | None = None
        self._writer: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._in_flight = 0  # writes handed to the writer thread and not yet settled
        self.checkpoints = 0  # WAL checkpoints the writer thread ran
        self.commits = 0  # transactions the writer committed (for /metrics and tests)
        # A disk or file failure (full, read-only, locked, gone) until a write commits again.
        self.busy_timeout = busy_timeout
        self.health = StoreHealth()

    # -------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the writer thread (call from the event loop that will write)."""
        self._loop = asyncio.get_running_loop()
        self._queue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="rlproxy-store-writer", daemon=True)
        self._writer.start()

    async def _stop_writer(self) -> None:
        if self._writer is not None:
            self._queue.put(None)  # after every write already queued: each is committed or failed first
            await asyncio.to_thread(self._writer.join)
            self._writer = None
            self._queue = None

    async def close(self) -> None:
        await self._stop_writer()
        # Under the locks: a read still running in a worker thread (a poll that outlived the
        # app) finishes first. sqlite3 closed under a running statement can crash the process.
        with self._write_lock:
            self._conn.close()
            if self._loop_conn is not None:
                self._loop_conn.close()
        with self._read_lock:
            self._read_conn.close()

    # -------------------------------------------------------------- writer

    async def _submit(self, op: Callable[[sqlite3.Connection], Any], *, at_once: bool = False) -> Any:
        if self._queue is None:
            # No writer running (trainer process, scripts): write synchronously.
            return await asyncio.to_thread(self._run_sync, op)
        if at_once and self._in_flight == 0 and self._writes_on_loop:
            outcome = self._write_now(op)
            if outcome is not None:
                ok, value = outcome
                if ok:
                    return value
                raise value
        future = self._loop.create_future()
        self._in_flight += 1
        self._queue.put((op, future))
        return await future

    def _write_now(self, op: Callable[[sqlite3.Connection], Any]) -> tuple[bool, Any] | None:
        """`op` committed at once on the event loop: for a call recorded while no other is in
        flight and nothing is queued for the writer thread. With one call at a time, the
        hand-off to the thread and back was ~0.1 ms of what the gateway adds to a call
        (bench/README.md); concurrent calls still go through the thread, many to a commit.
        Never waits: None, and the caller queues the write, when the write lock is taken in
        this process (the writer thread) or in another (the trainer): the writer thread does
        the waiting, and says what a failing store failed with."""
        if not self._write_lock.acquire(blocking=False):
            return None
        try:
            conn = self._loop_conn
            try:
                _begin(conn)
            except sqlite3.Error:
                return None
            return self._commit_round(conn, [op])[0]
        finally:
            self._write_lock.release()

    def _run_sync(self, op: Callable[[sqlite3.Connection], Any]) -> Any:
        with self._write_lock:
            conn = self._conn
            try:
                _begin(conn)
                result = op(conn)
                conn.execute("COMMIT")
            except BaseException as exc:
                _rollback(conn)
                self._raise_failure(exc)
                raise
            return result

    def _raise_failure(self, exc: BaseException) -> None:
        """Raise `exc` as the store failure it is (noting it in `health`); return if it is none."""
        failure = classify(exc, self.busy_timeout)
        if failure is not None:
            self.health.failed(failure)
            raise failure from (None if failure is exc else exc)

    def _write_loop(self) -> None:
        """The writer thread: each round takes every write queued so far (up to 512) and
        commits them in one transaction, then hands the outcomes to the event loop in one
        callback. A thread of its own rather than a task handing each round to an executor:
        with one call at a time, those hand-offs were a good part of what the gateway added."""
        assert self._queue is not None and self._loop is not None
        stopping = False
        while not stopping:
            batch = [self._queue.get()]
            while len(batch) < 512:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if None in batch:
                stopping = True
            if _CHECKPOINT in batch:
                self._checkpoint()
            batch = [item for item in batch if item is not None and item is not _CHECKPOINT]
            if not batch:
                continue
            try:
                outcomes: list[tuple[bool, Any]] | BaseException = self._apply_batch([op for op, _ in batch])
            except BaseException as exc:  # noqa: BLE001 - the commit itself failed: nobody is acknowledged
                outcomes = exc
            try:
                self._loop.call_soon_threadsafe(self._settle, batch, outcomes)
            except RuntimeError:  # the loop is closed: nobody is left waiting
                pass

    def _apply_batch(self, ops: list[Callable[[sqlite3.Connection], Any]]) -> list[tuple[bool, Any]]:
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

    def _commit_round(
        self, conn: sqlite3.Connection, ops: list[Callable[[sqlite3.Connection], Any]]
    ) -> list[tuple[bool, Any]]:
        """`ops` in the transaction just begun on `conn` (write lock held), then COMMIT."""
        outcomes: list[tuple[bool, Any]] = []
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
            conn.execute("COMMIT")
        except BaseException as exc:
            _rollback(conn)
            self._raise_failure(exc)
            raise
        self.commits += 1
        if self.commits % CHECKPOINT_EVERY == 0 and self._queue is not None and self._writes_on_loop:
            self._queue.put(_CHECKPOINT)
        return outcomes

    def _checkpoint(self) -> None:
        """Copy the WAL back into the database file (PASSIVE: readers are never waited for),
        in the writer thread: the store's connection checkpoints only here."""
        with self._write_lock:
            try:
                self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
                self.checkpoints += 1
            except sqlite3.Error:  # a failing disk shows in the next write, with its cause
                pass

    def _settle(
        self, batch: list[tuple[Any, asyncio.Future]], outcomes: list[tuple[bool, Any]] | BaseException
    ) -> None:
        """On the event loop: each waiting caller gets its write's outcome, or the round's failure."""
        self._in_flight -= len(batch)
        for index, (_, future) in enumerate(batch):
            if future.done():  # its caller was cancelled meanwhile
                continue
            if isinstance(outcomes, BaseException):
                future.set_exception(outcomes)
                continue
            ok, value = outcomes[index]
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

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

    # -------------------------------------------------------------- writes

    async def record_call(self, call: CallRecord, *, alone: bool = False) -> None:
        """Committed before this returns. `alone`: no other call is in flight, so nothing is
        gained by waiting to share a commit (see `_write_now`)."""
        await self._submit(lambda conn: store_rows.insert_call(conn, call), at_once=alone)

    def record_call_sync(self, call: CallRecord) -> None:
        self._run_sync(lambda conn: store_rows.insert_call(conn, call))

    async def set_reward(self, session_id: str, reward: float, metrics: dict[str, float] | None = None) -> dict:
        return await self._submit(lambda conn: store_rows.set_reward(conn, session_id, reward, metrics or {}))

    async def close_group(self, group_id: str, expected_sessions: int | None = None) -> dict:
        return await self._submit(lambda conn: store_rows.close_group(conn, group_id, expected_sessions))

    async def discard_session(self, session_id: str, reason: str | None = None) -> dict:
        """Leave a session (a failed rollout) out of its group: it needs no reward and is
        never trained; its calls stay recorded. Discarding twice is harmless."""
        await self._submit(lambda conn: store_rows.discard_session(conn, session_id, reason))
        return self.get_session(session_id)

    async def set_ruler_status(self, group_id: str, status: str, error: str | None = None) -> None:
        def op(conn: sqlite3.Connection) -> None:
            store_rows.require_group(conn, group_id)
            conn.execute(
                "UPDATE groups SET ruler_status = ?, ruler_error = ?, updated_at = ? WHERE id = ?",
                (status, error, time.time(), group_id),
            )

        await self._submit(op)

    async def record_judgement(
        self, group_id: str, judge_model: str, scores: list[dict], *, close: bool = True
    ) -> None:
        """Store a RULER judgement: scores become rewards (an earlier reward is kept as
        `independent_reward`), explanations go to `judgements`, and the group closes."""

        def op(conn: sqlite3.Connection) -> None:
            store_rows.require_group(conn, group_id)
            now = time.time()
            for item in scores:
                session_id, score = item["trajectory_id"], float(item["score"])
                row = conn.execute("SELECT reward, metrics FROM sessions WHERE id = ?", (session_id,)).fetchone()
                if row is None:
                    raise NotFound(f"session '{session_id}' not found")
                metrics = json.loads(row[1] or "{}")
                if row[0] is not None and "independent_reward" not in metrics:
                    metrics["independent_reward"] = row[0]
                metrics["ruler_score"] = score
                conn.execute(
                    "UPDATE sessions SET reward = ?, metrics = ?, rewarded_at = ?, updated_at = ? WHERE id = ?",
                    (score, json.dumps(metrics), now, now, session_id),
                )
                conn.execute(
                    "INSERT INTO judgements (group_id, session_id, judge_model, score, explanation, created_at)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    (group_id, session_id, judge_model, score, item.get("explanation"), now),
                )
            conn.execute(
                "UPDATE groups SET ruler_status = 'scored', ruler_error = NULL,"
                " closed = CASE WHEN ? = 1 THEN 1 ELSE closed END, updated_at = ?"  # portable SQL
                " WHERE id = ?",
                (1 if close else 0, now, group_id),
            )

        await self._submit(op)

    async def request_trigger(self, model: str) -> int:
        """Ask the trainer for a step now, with whatever ready groups there are."""

        def op(conn: sqlite3.Connection) -> int:
            cursor = conn.execute("INSERT INTO triggers (model, created_at) VALUES (?, ?)", (model, time.time()))
            return int(cursor.lastrowid)

        return await self._submit(op)

    # -------------------------------------------------------------- trainer writes (sync)

    def consume_triggers(self, model: str) -> bool:
        """True if a step was asked for since the last call (and mark those asks done)."""

        def op(conn: sqlite3.Connection) -> bool:
            cursor = conn.execute(
                "UPDATE triggers SET consumed_at = ? WHERE model = ? AND consumed_at IS NULL", (time.time(), model)
            )
            return cursor.rowcount > 0

        return self._run_sync(op)

    def insert_step(
        self,
        model: str,
        step: int,
        path: str,
        metrics: dict,
        group_ids: list[str],
        session_ids: list[str] | None = None,
    ) -> None:
        """Insert a step row and mark its groups trained, in one transaction. With
        `session_ids` (the sessions the step trained on), a Conflict if any of them was
        discarded meanwhile: the step must then be taken back."""

        def op(conn: sqlite3.Connection) -> None:
            if session_ids:
                marks = ",".join("?" * len(session_ids))
                gone = conn.execute(
                    f"SELECT id FROM sessions WHERE discarded = 1 AND id IN ({marks})", session_ids
                ).fetchall()
                if gone:
                    raise Conflict(
                        f"session(s) {', '.join(r[0] for r in gone)} were discarded while step {step} trained on them"
                    )
            conn.execute(
                "INSERT INTO steps (model, step, path, metrics, groups, created_at) VALUES (?, ?, ?, ?, ?, ?)",
                (model, step, path, json.dumps(metrics), json.dumps(group_ids), time.time()),
            )
            for group_id in group_ids:
                cursor = conn.execute(
                    "UPDATE groups SET trained_step = ?, updated_at = ? WHERE id = ? AND trained_step IS NULL",
                    (step, time.time(), group_id),
                )
                if cursor.rowcount != 1:
                    raise Conflict(f"group '{group_id}' is unknown or already trained")

        self._run_sync(op)

    def mark_failed(self, group_ids: Iterable[str], reason: str) -> None:
        """Set groups aside: training them kept failing (the reason says how). Never retried."""

        def op(conn: sqlite3.Connection) -> None:
            for group_id in group_ids:
                conn.execute(
                    "UPDATE groups SET failed = ?, updated_at = ? WHERE id = ? AND trained_step IS NULL",
                    (reason, time.time(), group_id),
                )

        self._run_sync(op)

    def mark_skipped(self, group_ids: Iterable[str], reason: str) -> None:
        def op(conn: sqlite3.Connection) -> None:
            for group_id in group_ids:
                conn.execute(
                    "UPDATE groups SET skipped = ?, updated_at = ? WHERE id = ?", (reason, time.time(), group_id)
                )

        self._run_sync(op)

    # -------------------------------------------------------------- GPU lease (colocated mode)

    def gpu_lease(self, model: str) -> dict:
        """The GPU lease of `model`: {"model", "state", "holder", "step", "updated_at"}; state "idle" if none."""
        rows = self._query("SELECT * FROM gpu_leases WHERE model = ?", (model,))
        return rows[0] if rows else {"model": model, "state": "idle", "holder": None, "step": None, "updated_at": None}

    def move_gpu_lease(
        self,
        model: str,
        to_state: str,
        *,
        expect: tuple[str, ...],
        holder: str | None = None,
        expect_holder: str | None = None,
        step: int | None = None,
    ) -> bool:
        """Compare-and-set: move the lease to `to_state` if its state is one of `expect` (and its
        holder is `expect_holder`, when given). True if it moved. `holder` None keeps the holder."""

        def op(conn: sqlite3.Connection) -> bool:
            row = conn.execute("SELECT state, holder FROM gpu_leases WHERE model = ?", (model,)).fetchone()
            state, current_holder = row if row else ("idle", None)
            if state not in expect or (expect_holder is not None and current_holder != expect_holder):
                return False
            conn.execute(
                "INSERT INTO gpu_leases (model, state, holder, step, updated_at) VALUES (?, ?, ?, ?, ?)"
                " ON CONFLICT(model) DO UPDATE SET state = excluded.state, holder = excluded.holder,"
                " step = excluded.step, updated_at = excluded.updated_at",
                (model, to_state, holder if holder is not None else current_holder, step, time.time()),
            )
            return True

        return self._run_sync(op)

    # -------------------------------------------------------------- reads

    def _query(self, sql: str, params: tuple | dict = ()) -> list[dict]:
        with self._read_lock:
            try:
                cursor = self._read_conn.execute(sql, params)
                names = [d[0] for d in cursor.description]
                return [dict(zip(names, row, strict=False)) for row in cursor.fetchall()]
            except sqlite3.Error as exc:
                self._raise_failure(exc)
                raise

    def get_session(self, session_id: str) -> dict:
        rows = self._query("SELECT * FROM sessions WHERE id = ?", (session_id,))
        if not rows:
            raise NotFound(f"session '{session_id}' not found", param="session_id")
        session = store_rows.decode_session(rows[0])
        session["calls"] = self.session_calls(session_id)
        return session

    def session_calls(self, session_id: str) -> list[dict]:
        rows = self._query("SELECT * FROM calls WHERE session_id = ? ORDER BY created_at, rowid", (session_id,))
        return [store_rows.decode_call(row) for row in rows]

    def get_call(self, call_id: str) -> dict | None:
        rows = self._query("SELECT * FROM calls WHERE id = ?", (call_id,))
        return store_rows.decode_call(rows[0]) if rows else None

    def get_group(self, group_id: str) -> dict:
        rows = self._query("SELECT * FROM groups WHERE id = ?", (group_id,))
        if not rows:
            raise NotFound(f"group '{group_id}' not found", param="group_id")
        group = rows[0]
        every = [
            store_rows.decode_session(row)
            for row in self._query("SELECT * FROM sessions WHERE group_id = ? ORDER BY created_at", (group_id,))
        ]
        # `sessions` are the ones the group is judged and trained on; discarded ones
        # (failed rollouts) are listed apart, as in `store_schema.READY_GROUPS`.
        sessions = [s for s in every if not s["discarded"]]
        discarded = [s for s in every if s["discarded"]]
        group["closed"] = bool(group["closed"])
        group["sessions"] = sessions
        group["discarded_sessions"] = discarded
        group["n_sessions"] = len(sessions)
        group["n_rewarded"] = sum(1 for s in sessions if s["reward"] is not None)
        group["n_discarded"] = len(discarded)
        expected = group["expected_sessions"]
        group["ready"] = bool(
            sessions
            and group["n_rewarded"] == len(sessions)
            and (group["closed"] or (expected is not None and len(every) >= expected))
        )
        group["judgements"] = self._query(
            "SELECT session_id, judge_model, score, explanation, created_at FROM judgements"
            " WHERE group_id = ? ORDER BY id",
            (group_id,),
        )
        return group

    def ready_groups(self, model: str, split: str = "train", limit: int | None = None) -> list[dict]:
        sql = store_schema.READY_GROUPS + (f" LIMIT {int(limit)}" if limit else "")
        return self._query(sql, {"model": model, "split": split})

    def steps(self, model: str | None = None) -> list[dict]:
        if model is None:
            rows = self._query("SELECT * FROM steps ORDER BY model, step")
        else:
            rows = self._query("SELECT * FROM steps WHERE model = ? ORDER BY step", (model,))
        for row in rows:
            row["metrics"] = json.loads(row["metrics"] or "{}")
            row["groups"] = json.loads(row["groups"] or "[]")
        return rows

    def latest_step(self, model: str) -> int | None:
        rows = self._query("SELECT MAX(step) AS step FROM steps WHERE model = ?", (model,))
        return rows[0]["step"] if rows else None

    # Paged lists and the reward curve (the dashboard, GET /v1/sessions and /v1/groups).
    def list_sessions(self, f: store_lists.ListFilter) -> dict:
        return store_lists.list_sessions(self._query, f)

    def list_groups(self, f: store_lists.ListFilter) -> dict:
        return store_lists.list_groups(self._query, f)

    def reward_curve(self, model: str) -> list[dict]:
        return store_lists.reward_curve(self._query, model)

    def calls_per_minute(self, now: float, minutes: int = 60) -> list[dict]:
        return store_lists.calls_per_minute(self._query, now, minutes)

    def counts(self) -> dict[str, int]:
        out = {}
        for table in ("calls", "sessions", "groups", "steps", "judgements"):
            out[table] = self._query(f"SELECT COUNT(*) AS n FROM {table}")[0]["n"]
        return out


def with_savepoints(
    conn: Any, ops: list[Callable[[Any], Any]], fails_the_round: Callable[[Exception], bool]
) -> list[tuple[bool, Any]]:
    """Every op of a round in a savepoint of its own, so an op that raises is rolled back
    alone and handed to its caller; an exception that `fails_the_round` (the disk or the
    server failing, not the op) is raised: the transaction may be gone already. The SQL is
    both SQLite's and PostgreSQL's."""
    outcomes: list[tuple[bool, Any]] = []
    for op in ops:
        conn.execute("SAVEPOINT op")
        try:
            outcomes.append((True, op(conn)))
            conn.execute("RELEASE SAVEPOINT op")
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            if fails_the_round(exc):
                raise
            conn.execute("ROLLBACK TO SAVEPOINT op")
            conn.execute("RELEASE SAVEPOINT op")
            outcomes.append((False, exc))
    return outcomes


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
