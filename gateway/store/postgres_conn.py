"""Connections to PostgreSQL for `PostgresStore`: the pool, the sqlite3-shaped face the store's
ops call (`PgConn`: `execute(sql, params)` with `?` placeholders rewritten to psycopg's `%s`),
and the connection of its own that holds a trainer's lock."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from gateway.errors import ConfigError
from gateway.redact import mask_text
from gateway.store.locks import try_lock_trainer


def open_pool(url: str, min_size: int, max_size: int, timeout: float) -> Any:
    """A psycopg pool of autocommit connections to `url`, connected within `timeout` (else a
    ConfigError that says what to check)."""
    from psycopg_pool import ConnectionPool, PoolTimeout

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
        check=ConnectionPool.check_connection,
    )
    try:
        pool.wait(timeout=timeout)
    except PoolTimeout:
        pool.close()
        raise ConfigError(
            f"cannot connect to the store at {redact(url)} within {timeout:.0f} s: check --store "
            "(host, port, database, user, password) and that PostgreSQL is running"
        ) from None
    return pool


def hold_trainer_lock(url: str, model: str) -> Callable[[], None]:
    """One trainer per model on this database, whatever machine each runs on: a second one would number
    its steps as the first does and train diverging weights under one name. The lock lives on a
    connection of its own (the returned release closes it; so does the process's death)."""
    import psycopg

    raw = psycopg.connect(url, autocommit=True)
    if not try_lock_trainer(PgConn(raw), model):
        raw.close()
        raise ConfigError(
            f"another trainer is training model '{model}' on the store {redact(url)}: one trainer per "
            "model and store; stop it, or train under another --model-name"
        )
    return raw.close


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

    def execute(self, sql: str, params: tuple | list | dict = ()) -> PgCursor:
        if isinstance(params, dict):
            sql = re.sub(r":(\w+)", r"%(\1)s", sql.replace("%", "%%"))
        else:
            sql = translate(sql)
        return PgCursor(self._conn.execute(sql, params or None))
