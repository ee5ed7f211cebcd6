"""The store on PostgreSQL: the same `Store` interface and guarantees, shared by many machines.

`PostgresStore` is a `Store` whose connections come from a psycopg 3 pool. Every write op of
`Store` (and of `gateway/store/rows.py`) runs unchanged: `PgConn` (postgres_conn.py) gives them the sqlite3-shaped
`execute(sql, params)` they call, rewriting `?` placeholders to psycopg's `%s`. What the two
dialects disagree on is overridden here: the schema (`postgres_schema.py`), the ready-groups
query, the order of a session's calls (a database sequence, never a replica's clock), the
transaction handling (group commit with retry on deadlock, acknowledgement after COMMIT) and
row locks (`FOR UPDATE`, advisory locks: `gateway/store/locks.py`).

Several gateways and trainers may share one database:
- calls of one session may land on any replica; they are ordered by `calls.seq`, which the
  database hands out, and a client sends call n+1 only after call n was acknowledged (committed);
- a group is marked trained in the transaction that inserts its step (`Store.insert_step`: its
  `UPDATE ... WHERE trained_step IS NULL` waits on a racing trainer's row lock and then sees the
  group trained, so the second step is refused with Conflict); `claim_groups` lets a trainer
  take ready groups through a claim row, so two trainers never take the same group.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from functools import partial
from pathlib import Path
from typing import Any

from gateway.store import files as store_files
from gateway.store import postgres_schema, trainer_lock, training
from gateway.store.base import Store
from gateway.store.clock import store_now
from gateway.store.deadline import answer_within
from gateway.store.health import classify
from gateway.store.postgres_conn import HeldTrainerLock, PgConn, PgCursor, lock_wait_ms, open_pool
from gateway.store.postgres_files import PostgresStepFiles
from gateway.store.rows import decode_call
from gateway.store.writer import Op, Outcome, with_savepoints

_RETRYABLE = ("40P01", "40001")  # deadlock detected, serialization failure: rerun the batch
_LOCK_NOT_AVAILABLE = "55P03"  # a batch waited for a lock longer than BATCH_LOCK_WAIT
BATCH_LOCK_WAIT = "100ms"
"""The longest a batch of several ops waits for a lock before each op runs alone instead: its
locks are held in the order the ops came, so two replicas' batches can wait on each other, and
PostgreSQL would take `deadlock_timeout` (1 s by default) to notice."""
DEGRADED_WAIT = 2.0
"""The longest a connection is waited for while the store is degraded, not the pool's `timeout`:
with the server gone, each batch (each probe) waited 30 s in turn, so calls and /healthz hung
for a minute or more before their 503."""
RECONNECT_GIVE_UP = 10.0
"""When the pool drops an attempt to reconnect: its retries wait 1, 2, 4 ... s (up to 5 min by
default), so after a long outage the next try came minutes after PostgreSQL was back. Given up,
the next request starts a fresh attempt at once: the store recovers within seconds."""
WRITE_WAIT = 2.0
"""A write transaction's answer waits this many times the store's timeout at most (`answer_within`),
then fails as 503 store_unavailable: a server frozen mid-write (SIGSTOP, a paused VM) held the
writer's round, and the call or reward in it, for as long as it stayed frozen (TCP keepalives are
answered by its kernel). Longer than a statement's wait for a lock (`lock_timeout`: the timeout),
so a held lock still says store_locked."""


def _is_retryable(exc: BaseException) -> bool:
    return getattr(exc, "sqlstate", None) in _RETRYABLE


def _contended(exc: BaseException) -> bool:
    """A batch that waited on another transaction's locks (deadlock, or past `BATCH_LOCK_WAIT`)."""
    return _is_retryable(exc) or getattr(exc, "sqlstate", None) == _LOCK_NOT_AVAILABLE


def _fails_the_round(exc: BaseException) -> bool:
    """Not the op's fault: a lock, or the server failing. The whole batch goes, not this op."""
    return _contended(exc) or classify(exc) is not None


class _OpFailed(Exception):
    """An op of a batch raised (its own fault): the batch runs again with a savepoint per op."""


def _batch(ops: list[Op], *, careful: bool) -> Callable[[PgConn], list[Outcome]]:
    """The body of a batch's transaction: its ops in order, waits for a lock bounded where there
    are several; `careful`, a savepoint per op, so an op that raises is rolled back alone."""

    def body(conn: PgConn) -> list[Outcome]:
        if len(ops) > 1:
            conn.execute(f"SET LOCAL lock_timeout = '{BATCH_LOCK_WAIT}'")
        if careful:
            return with_savepoints(conn, ops, fails_the_round=_fails_the_round)
        outcomes: list[Outcome] = []
        for op in ops:
            try:
                outcomes.append((True, op(conn)))
            except Exception as exc:
                if _fails_the_round(exc):
                    raise
                raise _OpFailed from exc
        return outcomes

    return body


Landed = Callable[[Any], "Callable[[PgConn], bool] | None"]
"""Given what a transaction's body returned: how to tell, on another connection, whether it
committed (None: it cannot tell, so it did not, as far as anyone is told)."""

_UNFINISHED = object()  # a body that raised: nothing of it can have committed


def _batch_landed(ops: list[Op]) -> Landed:
    """A batch committed whole or not at all: any op of it that succeeded and can look for its own
    row (a call, by its id: `rows.CallWrite`) tells for all of them."""

    def landed(outcomes: list[Outcome]) -> Callable[[PgConn], bool] | None:
        for op, (ok, _) in zip(ops, outcomes, strict=True):
            if ok and hasattr(op, "landed"):
                return op.landed
        return None

    return landed


def _op_landed(op: Op) -> Landed:
    return lambda _result: getattr(op, "landed", None)


def _committed_after_all(pool: Any, check: Callable[[PgConn], bool] | None) -> bool:
    """After a COMMIT that failed (its reply lost with the connection, typically): did it land?
    Asked on a fresh connection; a server still gone leaves the failure as it was."""
    if check is None:
        return False
    try:
        with pool.connection(timeout=DEGRADED_WAIT) as raw, answer_within(raw, DEGRADED_WAIT):
            return bool(check(PgConn(raw)))
    except Exception:  # noqa: BLE001 - the COMMIT's own failure is what gets reported
        return False


def _rows(cursor: PgCursor) -> list[dict]:
    names = [d[0] for d in cursor.description]
    return [dict(zip(names, row, strict=False)) for row in cursor.fetchall()]


class PostgresStore(PostgresStepFiles, Store):
    """`PostgresStore(url)`: the store in a PostgreSQL database (created tables if missing)."""

    backend = "postgres"
    group_tables = ("group_claims",)  # a trainer's claims, forgotten with their groups (`gateway.store.retention`)

    def __init__(self, url: str, *, min_size: int = 1, max_size: int = 8, timeout: float = 30.0, **_ignored: Any):
        super().__init__(timeout)
        self.path = url
        self.url = url
        self._pool = open_pool(url, min_size, max_size, timeout)
        self._pool.reconnect_timeout = RECONNECT_GIVE_UP  # not at start: that waits `timeout` for the server
        self._write_lock = threading.Lock()  # group commits of this process, one at a time
        self._read_lock = threading.Lock()
        try:
            with self._pool.connection() as conn:
                # A migration waits for another gateway's or trainer's (its advisory lock) however long it takes.
                conn.execute("SET lock_timeout = 0")
                postgres_schema.migrate(conn)
                conn.execute(f"SET lock_timeout = {lock_wait_ms(timeout)}")
        except BaseException:
            self._pool.close()  # refused (a newer schema, no rights): no pool left connected behind
            raise
        # Every write is a round trip to the server: none is made on the event loop (the base
        # class's `_write_now` queues them all for the writer thread).
        self.retries = 0  # batches rerun after a deadlock with another replica
        self._trainer_locks: dict[str, HeldTrainerLock] = {}  # by model: the trainers of this process

    def _close_connections(self) -> None:
        self._pool.close()

    def _connection(self) -> Any:
        """A pooled connection (a context manager); waited for briefly while the store is degraded."""
        return self._pool.connection(timeout=DEGRADED_WAIT if self.health.degraded else None)

    def close_sync(self) -> None:
        self._pool.close()

    # -------------------------------------------------------------- transactions

    def _transaction(
        self,
        body: Callable[[PgConn], Any],
        attempts: int = 20,
        landed: Landed | None = None,
        short_wait: bool = False,
        answer_s: float | None = None,
    ) -> Any:
        """Run `body` in one transaction, rerun whole (`attempts` times in all, at most) if
        PostgreSQL picked it as a deadlock victim: nothing of it was committed. With `landed`, a
        COMMIT that failed is looked for (`_committed_after_all`) and, found, is a success.
        `short_wait`: a batch waiting `BATCH_LOCK_WAIT` for a lock, whose timeout is no failure.
        `answer_s`: how long each attempt waits for the server's answers (`WRITE_WAIT` by default)."""
        answer_s = answer_s or WRITE_WAIT * self.busy_timeout
        try:
            for attempt in range(attempts):
                with self._connection() as raw, answer_within(raw, answer_s, "a write"):
                    result: Any = _UNFINISHED
                    try:
                        with raw.transaction():
                            result = body(PgConn(raw))
                        return result
                    except Exception as exc:
                        if result is not _UNFINISHED and landed is not None:
                            if _committed_after_all(self._pool, landed(result)):
                                return result
                        if not _is_retryable(exc) or attempt == attempts - 1:
                            raise
                        self.retries += 1
                time.sleep(0.005 * (attempt + 1))
            raise AssertionError("unreachable")
        except Exception as exc:
            if not (short_wait and _contended(exc)):  # a batch's short lock wait: `_apply_batch` reruns its ops
                self._raise_failure(exc)  # the server's failure, said as the store's (503/507)
            raise

    def _run_sync(self, op: Op) -> Any:
        return self._transaction(op, landed=_op_landed(op))

    def _apply_batch(self, ops: list[Op]) -> list[Outcome]:
        """Every op in one transaction (group commit). Ops rarely fail, so the batch first runs
        without savepoints (each is a round trip to the server); if an op raises, that attempt
        is rolled back and the batch runs again with a savepoint per op, so the failing op is
        rolled back alone. A batch that deadlocks, or waits for a lock past `BATCH_LOCK_WAIT`,
        is rolled back, and each op then runs in a transaction of its own (taking its locks in
        the store's order, `gateway.store.locks`; rerun on a deadlock) with an outcome of its
        own: nothing was acknowledged before, each op is after its own COMMIT."""
        with self._write_lock:
            try:
                short_wait = len(ops) > 1  # see `_batch`
                try:
                    outcomes = self._transaction(_batch(ops, careful=False), 1, _batch_landed(ops), short_wait)
                except _OpFailed:
                    outcomes = self._transaction(_batch(ops, careful=True), 1, _batch_landed(ops), short_wait)
                self.commits += 1
            except Exception as exc:
                if not _contended(exc):
                    raise
                self.retries += 1
                outcomes = [self._alone(op) for op in ops]
        return outcomes

    def _alone(self, op: Op) -> Outcome:
        try:
            result = self._transaction(op, landed=_op_landed(op))
        except Exception as exc:  # noqa: BLE001 - this op's outcome (a store failure too), not its neighbours'
            return False, exc
        self.commits += 1
        return True, result

    # -------------------------------------------------------------- dialect differences

    def _query(self, sql: str, params: tuple | dict = ()) -> list[dict]:
        try:
            with self._connection() as raw, answer_within(raw, self.busy_timeout):
                return _rows(PgConn(raw).execute(sql, params))
        except Exception as exc:
            self._raise_failure(exc)
            raise

    async def probe(self) -> None:
        """A call-sized write, committed and removed (`Store.probe`)."""

        def op(conn: PgConn) -> None:
            conn.execute("INSERT INTO store_probe (payload, created_at) VALUES (?, ?)", (bytes(16384), time.time()))
            conn.execute("DELETE FROM store_probe")

        await self._submit(op)
        self.health.recovered()

    @contextmanager
    def _snapshot(self) -> Iterator[Callable[[str, tuple], list[dict]]]:
        """Reads in one REPEATABLE READ transaction: every statement sees the same snapshot."""
        try:
            with self._connection() as raw, answer_within(raw, self.busy_timeout), raw.transaction():
                raw.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                conn = PgConn(raw)

                def read(sql: str, params: tuple = ()) -> list[dict]:
                    return _rows(conn.execute(sql, params))

                yield read
        except Exception as exc:
            self._raise_failure(exc)
            raise

    def _session_calls(self, query: Callable[[str, tuple], list[dict]], session_id: str) -> list[dict]:
        rows = query("SELECT * FROM calls WHERE session_id = ? ORDER BY seq", (session_id,))
        for row in rows:
            row.pop("seq", None)
            for key in ("prompt_ids", "completion_ids", "completion_logprobs"):
                if isinstance(row.get(key), memoryview):
                    row[key] = bytes(row[key])
        return [decode_call(row) for row in rows]

    def ready_groups(self, model: str, split: str = "train", limit: int | None = None) -> list[dict]:
        sql = postgres_schema.READY_GROUPS + (f" LIMIT {int(limit)}" if limit else "")
        return [self._ready_row(row) for row in self._query(sql, {"model": model, "split": split})]

    @staticmethod
    def _ready_row(row: dict) -> dict:
        for key in ("n_sessions", "n_rewarded", "n_discarded"):
            row[key] = int(row[key])
        return row

    def insert_step(self, model: str, step: int, path: str, *args: Any, **kwargs: Any) -> None:
        """As `Store.insert_step`, after the checkpoint's files went into the store as blobs (their own
        transaction, committed first); its file list is written with the step row: a step row is never
        visible without its files, and a record refused changes no recorded step's files."""
        lock = self._trainer_locks.get(model)
        if lock is not None:  # held still (or again): a second trainer may have taken it while it was dropped
            lock.ensure()
        directory, listing = Path(path), []
        if directory.is_dir():
            # As long as the upload takes (a checkpoint may be large): no answer's deadline.
            listing = self._transaction(lambda conn: store_files.upload_blobs(conn, directory), answer_s=math.inf)
            kwargs["also"] = lambda conn: store_files.write_file_list(conn, model, step, listing, directory)
        try:
            super().insert_step(model, step, path, *args, **kwargs)
        except Exception:
            if listing:  # refused: its checkpoint is discarded, and the blobs it uploaded named by no step
                digests = {digest for _, digest in listing}
                with suppress(Exception):  # the store failing: the record's own failure says so
                    self._transaction(lambda conn: store_files.collect_unlisted(conn, digests))
            raise

    def claim_groups(
        self, model: str, holder: str, split: str = "train", limit: int | None = None, ttl_s: float = 3600.0
    ) -> list[dict]:
        """Ready groups that no other trainer holds, claimed for `holder` (for `ttl_s`): the
        claim row is the lock (an upsert that only takes a free or expired claim), so two
        trainers asking at once get disjoint sets."""

        def op(conn: PgConn) -> list[str]:
            # One upsert per group: a racing trainer's claim row makes ours wait for its commit,
            # then the WHERE sees the committed holder, so a group is never claimed twice.
            now, taken = store_now(conn), []  # the database's clock: trainers' hosts may disagree
            for row in self.ready_groups(model, split):
                won = conn.execute(
                    "INSERT INTO group_claims (group_id, holder, expires_at) VALUES (?, ?, ?)"
                    " ON CONFLICT (group_id) DO UPDATE SET holder = excluded.holder, expires_at = excluded.expires_at"
                    " WHERE group_claims.holder = excluded.holder OR group_claims.expires_at < ?"
                    " RETURNING group_id",
                    (row["id"], holder, now + ttl_s, now),
                ).fetchone()
                if won:
                    taken.append(row["id"])
                    if limit and len(taken) >= limit:
                        break
            return taken

        taken = set(self._run_sync(op))
        return [row for row in self.ready_groups(model, split) if row["id"] in taken]

    def lock_trainer(self, model: str) -> HeldTrainerLock:
        """As `Store.lock_trainer`: a session advisory lock on a connection of its own (`HeldTrainerLock`),
        made sure of before each step this store records for `model`."""
        lock = self._trainer_locks[model] = HeldTrainerLock(self.url, model)
        return lock

    def give_back_dead_claims(self, model: str) -> int:
        if not self._query(trainer_lock.CLAIMED, (model,))[0]["n"]:
            return 0  # nothing claimed: the lock is left alone (a trainer starting never waits for it)
        release = partial(training.release_model_claims, model=model)
        return int(self._run_sync(lambda conn: trainer_lock.give_back_postgres(conn, model, release)))

    def release_claims(self, holder: str) -> None:
        self._run_sync(lambda conn: conn.execute("DELETE FROM group_claims WHERE holder = ?", (holder,)))

    def schema_version(self) -> int:
        return int(self._query("SELECT MAX(version) AS v FROM schema_version")[0]["v"])
