"""The store's PostgreSQL schema, its versions and the forward migrations between them.

Version 1 is the first released schema (rlproxy's SQLite tables at its first release, in
PostgreSQL types, plus `calls.seq`: the order of a session's calls, handed out by the database
so replicas' clocks never decide it). Each later version is a list of statements; `migrate`
runs the missing ones in order, in one transaction under an advisory lock, so gateways and
trainers starting together migrate once. Columns the SQLite schema gains later
(`sqlite_schema._ADDED_COLUMNS`) are added here too, so both backends hold the same rows, and
counted in `schema_columns` as SQLite counts them. A database newer than this code (in either
count) is refused: running old code on it could lose columns' data.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import ConfigError
from gateway.store import gateways, sqlite_schema
from gateway.store.postgres_conn import PgConn

_V1 = """
CREATE TABLE IF NOT EXISTS calls (
    seq BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    group_id TEXT,
    split TEXT NOT NULL,
    model TEXT NOT NULL,
    served TEXT,
    step INTEGER,
    engine TEXT NOT NULL,
    stream INTEGER NOT NULL,
    status TEXT NOT NULL,
    http_status INTEGER NOT NULL,
    error TEXT,
    request TEXT NOT NULL,
    response TEXT,
    prompt_ids BYTEA,
    completion_ids BYTEA,
    completion_logprobs BYTEA,
    completion_lengths TEXT,
    latency_ms DOUBLE PRECISION NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    client_request_id TEXT
);
CREATE INDEX IF NOT EXISTS calls_session ON calls (session_id, seq);
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    group_id TEXT,
    split TEXT NOT NULL,
    model TEXT NOT NULL,
    n_calls INTEGER NOT NULL DEFAULT 0,
    reward DOUBLE PRECISION,
    metrics TEXT,
    rewarded_at DOUBLE PRECISION,
    discarded INTEGER NOT NULL DEFAULT 0,
    discard_reason TEXT,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS sessions_group ON sessions (group_id);
CREATE TABLE IF NOT EXISTS groups (
    id TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    split TEXT NOT NULL,
    closed INTEGER NOT NULL DEFAULT 0,
    expected_sessions INTEGER,
    trained_step INTEGER,
    skipped TEXT,
    ruler_status TEXT,
    ruler_error TEXT,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS steps (
    model TEXT NOT NULL,
    step INTEGER NOT NULL,
    path TEXT NOT NULL,
    metrics TEXT,
    groups TEXT,
    created_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (model, step)
);
CREATE TABLE IF NOT EXISTS judgements (
    id BIGSERIAL PRIMARY KEY,
    group_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    judge_model TEXT NOT NULL,
    score DOUBLE PRECISION NOT NULL,
    explanation TEXT,
    created_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS judgements_group ON judgements (group_id);
CREATE TABLE IF NOT EXISTS triggers (
    id BIGSERIAL PRIMARY KEY,
    model TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    consumed_at DOUBLE PRECISION
);
CREATE TABLE IF NOT EXISTS gpu_leases (
    model TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    holder TEXT,
    step INTEGER,
    updated_at DOUBLE PRECISION NOT NULL
);
"""

# Version 2: what rlproxy needs to run on several machines. Claims (two trainers never take
# the same group) and the adapter files of each step (content-addressed, checksummed), so a
# replica or a trainer elsewhere needs no shared filesystem.
_V2 = """
CREATE TABLE IF NOT EXISTS group_claims (
    group_id TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS blobs (
    sha256 TEXT PRIMARY KEY,
    size BIGINT NOT NULL,
    data BYTEA NOT NULL
);
CREATE TABLE IF NOT EXISTS step_files (
    model TEXT NOT NULL,
    step INTEGER NOT NULL,
    name TEXT NOT NULL,
    sha256 TEXT NOT NULL REFERENCES blobs (sha256),
    PRIMARY KEY (model, step, name)
);
"""

# Written and emptied by the store's probe while it is degraded (gateway/store/health.py).
_V3 = """
CREATE TABLE IF NOT EXISTS store_probe (
    id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    payload BYTEA,
    created_at DOUBLE PRECISION NOT NULL
);
"""
# Version 4: the columns added since (`sqlite_schema._ADDED_COLUMNS`, which have no version of
# their own here) counted as SQLite's `user_version` counts them, so that a database a newer
# rlproxy added columns to is refused here too, not written without them.
_V4 = """
CREATE TABLE IF NOT EXISTS schema_columns (
    version INTEGER PRIMARY KEY,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
"""
# Version 5: the indexes SQLite's schema has had from the start for the paged lists (keyset on
# created_at and id, newest first) and the calls per minute: without them each page of
# GET /v1/sessions or /v1/groups sorted the whole table, and each dashboard poll scanned every call.
_V5 = """
CREATE INDEX IF NOT EXISTS sessions_created ON sessions (created_at, id);
CREATE INDEX IF NOT EXISTS groups_created ON groups (created_at, id);
CREATE INDEX IF NOT EXISTS calls_created ON calls (created_at);
"""
# Version 6: each running gateway's heartbeat (gateway/store/gateways.py): a gateway killed left
# the judgements it ran "running" for ever; one whose row expired has them handed on.
_V6 = """
CREATE TABLE IF NOT EXISTS gateways (
    id TEXT PRIMARY KEY,
    started_at DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL
);
"""
MIGRATIONS: dict[int, str] = {1: _V1, 2: _V2, 3: _V3, 4: _V4, 5: _V5, 6: _V6}
VERSION = max(MIGRATIONS)

READY_GROUPS = """
SELECT * FROM (
  SELECT g.*, SUM(CASE WHEN s.discarded = 0 THEN 1 ELSE 0 END) AS n_sessions,
         COUNT(CASE WHEN s.discarded = 0 THEN s.reward END) AS n_rewarded,
         SUM(s.discarded) AS n_discarded
  FROM groups g JOIN sessions s ON s.group_id = g.id
  WHERE g.model = :model AND g.split = :split AND g.trained_step IS NULL AND g.skipped IS NULL
    AND g.failed IS NULL
  GROUP BY g.id
) r
WHERE n_sessions > 0 AND n_rewarded = n_sessions
  AND (closed = 1 OR (expected_sessions IS NOT NULL AND n_sessions + n_discarded >= expected_sessions))
ORDER BY created_at
"""

_LOCK_KEY = 0x726C7078  # "rlpx": one advisory lock for schema changes
_INSUFFICIENT_PRIVILEGE = "42501"


def _pg_type(definition: str) -> str:
    return definition.replace("REAL", "DOUBLE PRECISION").replace("BLOB", "BYTEA")


def migrate(conn: Any) -> int:
    """Bring the database to `VERSION` (created from nothing, or from any earlier version).
    Returns the version it started at (0: empty). A database user that may not change the
    schema (a least-privilege role, not the tables' owner) runs on a database already migrated:
    `CREATE TABLE IF NOT EXISTS` and `ALTER TABLE ... IF NOT EXISTS` need the rights even when
    there is nothing to do, which stopped such a role from starting at all."""
    try:
        return _migrate(conn)
    except Exception as exc:
        if getattr(exc, "sqlstate", None) != _INSUFFICIENT_PRIVILEGE:
            raise
        current, columns = _versions(conn)
        _refuse_newer(current, columns)
        if current == VERSION and columns == sqlite_schema.SCHEMA_VERSION:
            return current
        reason = str(exc).strip().splitlines()[0]
        raise ConfigError(
            f"the store's schema needs migrating (version {current} of {VERSION}) and this database user "
            f"may not change it ({reason}): start rlproxy once with the role that owns the tables, then "
            "with this one"
        ) from None


def _versions(conn: Any) -> tuple[int, int]:
    """The recorded schema and columns versions (0 where none is recorded), read only."""

    def latest(table: str) -> int:
        if conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()[0] is None:
            return 0
        return int(conn.execute(f"SELECT COALESCE(MAX(version), 0) FROM {table}").fetchone()[0])

    return latest("schema_version"), latest("schema_columns")


def _refuse_newer(current: int, columns: int) -> None:
    if current > VERSION:
        raise ConfigError(
            f"the store's schema is version {current}, newer than this rlproxy's "
            f"({VERSION}): upgrade rlproxy on this machine"
        )
    if columns > sqlite_schema.SCHEMA_VERSION:
        raise ConfigError(
            f"the store's columns are version {columns}, newer than this rlproxy's "
            f"({sqlite_schema.SCHEMA_VERSION}): upgrade rlproxy on this machine"
        )


def _migrate(conn: Any) -> int:
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
        conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY,"
            " applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
        )
        current = conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_version").fetchone()[0]
        if current == 0 and conn.execute("SELECT to_regclass('calls')").fetchone()[0] is not None:
            current = 1  # tables made before versions were recorded: the first release
            conn.execute("INSERT INTO schema_version (version) VALUES (1)")
        _refuse_newer(current, 0)
        for version in range(current + 1, VERSION + 1):
            conn.execute(MIGRATIONS[version])
            conn.execute("INSERT INTO schema_version (version) VALUES (%s)", (version,))
        columns = conn.execute("SELECT COALESCE(MAX(version), 0) FROM schema_columns").fetchone()[0]
        _refuse_newer(current, columns)
        named = conn.execute(
            "SELECT 1 FROM information_schema.columns WHERE table_name = 'groups' AND column_name = 'judged_by'"
            " AND table_schema = current_schema()"
        ).fetchone()
        # Columns the SQLite schema gained (both backends hold the same rows).
        for table, column, definition in sqlite_schema._ADDED_COLUMNS:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {_pg_type(definition)}")
        for statement in sqlite_schema.ADDED_INDEXES:
            conn.execute(statement)
        if named is None:  # judgements from before the heartbeat: handed on too
            gateways.adopt_unnamed(PgConn(conn))
        if columns < sqlite_schema.SCHEMA_VERSION:
            conn.execute("INSERT INTO schema_columns (version) VALUES (%s)", (sqlite_schema.SCHEMA_VERSION,))
    return current
