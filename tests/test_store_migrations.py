"""Forward migrations from the first released schema, on both backends: a database made by
rlproxy's first release (SQLite: commit 73c84b3's schema, kept in tests/golden; PostgreSQL: its
version 1) opens with today's code, keeps every row, gains the later columns and tables, and
takes new writes; a database newer than the code is refused."""

import sqlite3
from pathlib import Path

import psycopg
import pytest

from gateway.errors import ConfigError
from gateway.store import postgres_schema as store_pg_schema
from gateway.store import sqlite_schema as store_schema
from gateway.store.postgres import PostgresStore
from gateway.store.sqlite import SQLiteStore
from tests.test_store import call

V1_SQLITE = (Path(__file__).parent / "golden" / "store_schema_v1_sqlite.sql").read_text()

# Rows as the first release wrote them (its columns only).
_V1_ROWS = [
    "INSERT INTO calls (id, session_id, group_id, split, model, served, step, engine, stream, status, http_status,"
    " request, response, latency_ms, created_at) VALUES ('old-1', 'old-s', 'old-g', 'train', 'agent', 'agent@0', 0,"
    " 'local', 0, 'ok', 200, '{\"messages\": []}', '{\"choices\": []}', 1.5, 100.0)",
    "INSERT INTO sessions (id, group_id, split, model, n_calls, reward, metrics, created_at, updated_at)"
    " VALUES ('old-s', 'old-g', 'train', 'agent', 1, 1.0, '{}', 100.0, 100.0)",
    "INSERT INTO sessions (id, group_id, split, model, n_calls, reward, metrics, created_at, updated_at)"
    " VALUES ('old-t', 'old-g', 'train', 'agent', 1, 0.0, '{}', 101.0, 101.0)",
    "INSERT INTO groups (id, model, split, closed, created_at, updated_at)"
    " VALUES ('old-g', 'agent', 'train', 1, 100.0, 100.0)",
]


async def _check_upgraded(store) -> None:
    old = store.get_session("old-s")
    assert old["reward"] == 1.0 and not old["discarded"] and old["calls"][0]["id"] == "old-1"
    assert old["calls"][0]["sampling"] is None  # a column added later reads as empty
    assert old["trained_reward"] is None  # the newest: what a step trained with (none yet)
    assert [g["id"] for g in store.ready_groups("agent")] == ["old-g"]
    await store.record_call(call(1, "new-s", group="old-g", sampling={"temperature": 0.7}))
    assert store.get_session("new-s")["calls"][0]["sampling"] == {"temperature": 0.7}
    await store.discard_session("new-s", "failed rollout")
    store.mark_failed(["old-g"], "a reason")
    assert store.ready_groups("agent") == []


async def test_sqlite_from_the_first_release(tmp_path):
    import sqlite3

    path = tmp_path / "rlproxy.db"
    conn = sqlite3.connect(path)
    conn.executescript(V1_SQLITE)
    for sql in _V1_ROWS:
        conn.execute(sql)
    conn.commit()
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 0
    conn.close()

    store = SQLiteStore(path)
    await store.start()
    try:
        await _check_upgraded(store)
        assert store._conn.execute("PRAGMA user_version").fetchone()[0] == store_schema.SCHEMA_VERSION
    finally:
        await store.close()
    reopened = SQLiteStore(path)  # already current: nothing to do, nothing lost
    assert reopened.get_session("old-s")["calls"][0]["id"] == "old-1"
    await reopened.close()


async def test_sqlite_newer_than_the_code_is_refused(tmp_path):
    import sqlite3

    path = tmp_path / "rlproxy.db"
    SQLiteStore(path)._conn.close()
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {store_schema.SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(ConfigError, match="newer than this rlproxy"):
        SQLiteStore(path)


def _make_v1_postgres(url: str, record_version: bool) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(store_pg_schema.MIGRATIONS[1])
        if record_version:
            conn.execute(
                "CREATE TABLE schema_version (version INTEGER PRIMARY KEY,"
                " applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
            )
            conn.execute("INSERT INTO schema_version (version) VALUES (1)")
        for sql in _V1_ROWS:
            conn.execute(sql)


@pytest.mark.parametrize("record_version", [True, False], ids=["versioned", "unversioned"])
async def test_postgres_from_the_first_release(postgres_db, record_version):
    _make_v1_postgres(postgres_db, record_version)
    store = PostgresStore(postgres_db)
    await store.start()
    try:
        await _check_upgraded(store)
        assert store.schema_version() == store_pg_schema.VERSION
    finally:
        await store.close()
    with psycopg.connect(postgres_db) as conn:
        versions = [r[0] for r in conn.execute("SELECT version FROM schema_version ORDER BY version")]
        columns = {
            r[0] for r in conn.execute("SELECT column_name FROM information_schema.columns WHERE table_name = 'calls'")
        }
    assert versions == list(range(1, store_pg_schema.VERSION + 1))
    assert {column for table, column, _ in store_schema._ADDED_COLUMNS if table == "calls"} <= columns


async def test_postgres_newer_than_the_code_is_refused(postgres_db):
    store = PostgresStore(postgres_db)
    await store.close()
    with psycopg.connect(postgres_db, autocommit=True) as conn:
        conn.execute("INSERT INTO schema_version (version) VALUES (%s)", (store_pg_schema.VERSION + 1,))
    with pytest.raises(ConfigError, match="newer than this rlproxy"):
        PostgresStore(postgres_db)


async def test_postgres_with_columns_of_a_newer_rlproxy_is_refused(postgres_db, monkeypatch):
    # A newer rlproxy adds a column (as most releases do): SQLite's user_version counts it and
    # older code refuses the file; PostgreSQL recorded no such count and older code went on.
    newer = (*store_schema._ADDED_COLUMNS, ("sessions", "from_the_future", "TEXT"))
    with monkeypatch.context() as later:
        later.setattr(store_schema, "_ADDED_COLUMNS", newer)
        later.setattr(store_schema, "SCHEMA_VERSION", 1 + len(newer))
        PostgresStore(postgres_db).close_sync()
    with pytest.raises(ConfigError, match="newer than this rlproxy"):
        PostgresStore(postgres_db)


async def test_postgres_has_every_index_sqlite_has(postgres_db, tmp_path):
    # The paged lists (keyset on created_at and id) and the calls per minute read through
    # SQLite's sessions_created, groups_created and calls_created; PostgreSQL had none of
    # them, so every page sorted the whole table and every dashboard poll scanned all calls.
    await SQLiteStore(tmp_path / "rlproxy.db").close()
    with sqlite3.connect(tmp_path / "rlproxy.db") as conn:
        named = conn.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL")
        sqlite_indexes = {r[0] for r in named}
    PostgresStore(postgres_db).close_sync()
    with psycopg.connect(postgres_db) as conn:
        pg_indexes = {r[0] for r in conn.execute("SELECT indexname FROM pg_indexes WHERE schemaname = 'public'")}
    assert {"sessions_created", "groups_created", "calls_created"} <= sqlite_indexes
    assert sqlite_indexes <= pg_indexes, sqlite_indexes - pg_indexes


def test_postgres_a_role_that_may_not_change_the_schema_runs_on_a_migrated_database(postgres_db):
    # Least privilege: the tables' owner migrates, the gateways and trainers log in as a role that
    # only reads and writes rows. That role could not start at all (CREATE TABLE IF NOT EXISTS
    # needs the right to create, even when the table is there), in a psycopg traceback.
    import re
    import uuid

    role = "app_" + uuid.uuid4().hex[:12]
    with psycopg.connect(postgres_db, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'app-secret'")
        conn.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")  # PostgreSQL 15's default, on any version
        conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
        conn.execute(f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {role}")
    as_app = re.sub(r"://[^/@]*@", f"://{role}:app-secret@", postgres_db, count=1)
    if "@" not in as_app:
        as_app = as_app.replace("://", f"://{role}:app-secret@", 1)
    try:
        with pytest.raises(ConfigError, match="start rlproxy once with the role that owns the tables"):
            PostgresStore(as_app)  # an empty database: the owner has to migrate it first
        PostgresStore(postgres_db).close_sync()  # the owner migrates
        with psycopg.connect(postgres_db, autocommit=True) as conn:
            conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
            conn.execute(f"GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {role}")
        store = PostgresStore(as_app)
        try:
            store.record_call_sync(call(1, "s-app", group="g"))
            assert [c["id"] for c in store.get_session("s-app")["calls"]] == ["req1"]
            assert store.schema_version() == store_pg_schema.VERSION
        finally:
            store.close_sync()
    finally:
        with psycopg.connect(postgres_db, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")
