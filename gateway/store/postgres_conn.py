"""Connections to PostgreSQL for `PostgresStore`: the pool, the sqlite3-shaped face the store's
ops call (`PgConn`: `execute(sql, params)` with `?` placeholders rewritten to psycopg's `%s`),
and the connection of its own that holds a trainer's lock."""

from __future__ import annotations

import logging
import re
from typing import Any

from gateway.errors import StoreUnavailable, StoreUnreachable, TrainerBusy
from gateway.redact import mask_text
from gateway.store.deadline import answer_within
from gateway.store.health import classify
from gateway.store.locks import try_lock_trainer
from gateway.store.trainer_lock import waiting

log = logging.getLogger("rlproxy.store")

LOCK_CONNECT_TIMEOUT = 10
"""Seconds the trainer lock's connection waits for the server (libpq waits forever by default)."""


def open_pool(url: str, min_size: int, max_size: int, timeout: float) -> Any:
    """A psycopg pool of autocommit connections to `url`, connected within `timeout` (else a
    StoreUnreachable, a ConfigError, that says what to check). A statement of theirs waits
    `timeout` at most for a lock (`lock_timeout`, SQLite's busy timeout)."""
    from psycopg_pool import ConnectionPool, PoolTimeout

    def configure(conn: Any) -> None:
        # PostgreSQL waits for a lock for ever by default: one session left holding a row (a psql
        # `BEGIN; UPDATE sessions ...`, a stuck job) hung every call and reward of the gateway, whose
        # writes share one writer, with /healthz saying ok. Past the wait: 503 store_locked.
        conn.execute(f"SET lock_timeout = {lock_wait_ms(timeout)}")

    # check: a connection the server dropped (a restart) is replaced before use, so the
    # store recovers by itself once PostgreSQL is back.
    pool = ConnectionPool(
        url,
        min_size=min_size,
        max_size=max_size,
        open=True,
        timeout=timeout,
        kwargs={"autocommit": True},
        name="rlproxy-store",
        check=_check_within(timeout),
        configure=configure,
    )
    try:
        pool.wait(timeout=timeout)
    except PoolTimeout:
        pool.close()
        raise StoreUnreachable(
            f"cannot connect to the store at {redact(url)} within {timeout:.0f} s: check --store "
            "(host, port, database, user, password) and that PostgreSQL is running"
        ) from None
    return pool


def _check_within(timeout: float) -> Any:
    """The pool's check of a connection before use, cut after `timeout` (`answer_within`): on a
    frozen server that check hung as long as the server did."""
    from psycopg_pool import ConnectionPool

    def check(conn: Any) -> None:
        with answer_within(conn, timeout):
            ConnectionPool.check_connection(conn)

    return check


def lock_wait_ms(timeout: float) -> int:
    """`lock_timeout`'s value for a wait of `timeout` seconds (0 would mean no limit)."""
    return max(1, int(timeout * 1000))


class HeldTrainerLock:
    """One trainer per model on this database, whatever machine each runs on: a second one would number
    its steps as the first does and train diverging weights under one name. The lock lives on a
    connection of its own (`release` closes it; so does the process's death).

    The server drops the lock with that connection: PostgreSQL restarted, or the connection was killed or
    cut. Nothing tells the trainer, and a second `rlproxy train` then took the lock and trained beside
    it. So the trainer calls `ensure` before each step and the store before it records one: the lock is
    taken again on a new connection, or, where another trainer took it meanwhile, TrainerBusy stops this
    one (StoreUnavailable while the server cannot be reached: the trainer waits, as for any store failure)."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self._conn: Any = None  # None while lost (the server down): taken again at the next `ensure`
        self._released = False
        if not self._take():
            raise TrainerBusy(
                f"another trainer is training model '{model}' on the store {redact(url)}: one trainer per "
                "model and store; stop it, or train under another --model-name"
            )

    def _take(self) -> bool:
        import psycopg

        raw = psycopg.connect(self.url, autocommit=True, connect_timeout=LOCK_CONNECT_TIMEOUT)
        # Waited for a moment: a gateway checking whether the trainer is gone holds it for one transaction.
        if not waiting(lambda: try_lock_trainer(PgConn(raw), self.model)):
            raw.close()
            return False
        self._conn = raw
        return True

    def ensure(self) -> None:
        import psycopg

        if self._released:  # this trainer is done
            return
        if self._conn is not None:
            try:
                self._conn.execute("SELECT 1")  # a session alive holds its advisory lock
                return
            except psycopg.Error:
                self._conn.close()
                self._conn = None
                log.warning("the trainer lock's connection to the store was lost (PostgreSQL restarted?)")
        try:
            taken = self._take()
        except psycopg.Error as exc:
            failure = classify(exc) or StoreUnavailable(f"the trainer lock cannot be taken: {exc}", cause="unavailable")
            raise failure from exc
        if not taken:
            raise TrainerBusy(
                f"this trainer lost its lock on model '{self.model}' (its connection to the store "
                f"{redact(self.url)} dropped: PostgreSQL restarted?) and another trainer took it meanwhile: "
                "this one stops (recording no step), so that one trainer trains the model"
            )
        log.warning("trainer lock on model '%s' taken again", self.model)

    def release(self) -> None:
        self._released = True
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def redact(url: str) -> str:
    """The URL without its password, for messages and logs: libpq takes one in the user-info
    (`user:PW@host`) and as a query parameter (`?password=PW`); both are masked."""
    return mask_text(url)


class PgCursor:
    def __init__(self, cursor: Any) -> None:
        self._cursor = cursor
        self._conn = cursor.connection

    def fetchone(self) -> Any:
        return self._cursor.fetchone()

    def fetchall(self) -> list:
        return self._cursor.fetchall()

    @property
    def rowcount(self) -> int:
        return self._cursor.rowcount

    @property
    def description(self) -> Any:
        return self._cursor.description

    @property
    def lastrowid(self) -> int:
        # The id a serial column just handed out in this session (triggers, judgements).
        return int(self._conn.execute("SELECT lastval()").fetchone()[0])


_QMARK = re.compile(r"\?")


def translate(sql: str) -> str:
    """sqlite3 placeholders to psycopg's: `?` -> `%s` (a literal `%` doubled first)."""
    return _QMARK.sub("%s", sql.replace("%", "%%"))


class PgConn:
    """The sqlite3.Connection surface the store's ops use, on one psycopg connection."""

    row_lock = " FOR UPDATE"  # rows lock one by one here (gateway/store/locks.py)

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def server_time(self) -> float:
        """The database server's time, seconds since the epoch (`gateway.store.clock`): the wall clock
        at this statement, not the transaction's start (a batch may have waited for a lock)."""
        return float(self._conn.execute("SELECT EXTRACT(EPOCH FROM clock_timestamp())").fetchone()[0])

    def execute(self, sql: str, params: tuple | list | dict = ()) -> PgCursor:
        if isinstance(params, dict):
            sql = re.sub(r":(\w+)", r"%(\1)s", sql.replace("%", "%%"))
        else:
            sql = translate(sql)
        return PgCursor(self._conn.execute(sql, params or None))
