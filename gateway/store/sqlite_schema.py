"""The store's SQLite schema and how a connection to it is opened.

`SCHEMA` creates every table (idempotent); `add_missing_columns` brings a file made by
an older rlproxy up to date; `READY_GROUPS` is the query the trainer polls for groups it
can train on; `connect` opens a file in WAL mode with the durability the settings ask for.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from gateway.errors import ConfigError
from gateway.store import gateways

SCHEMA = """
CREATE TABLE IF NOT EXISTS calls (
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
    prompt_ids BLOB,
    completion_ids BLOB,
    completion_logprobs BLOB,
    completion_lengths TEXT,
    latency_ms REAL NOT NULL,
    created_at REAL NOT NULL,
    client_request_id TEXT,
    sampling TEXT
);
CREATE INDEX IF NOT EXISTS calls_session ON calls (session_id, created_at);
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    group_id TEXT,
    split TEXT NOT NULL,
    model TEXT NOT NULL,
    n_calls INTEGER NOT NULL DEFAULT 0,
    reward REAL,
    metrics TEXT,
    rewarded_at REAL,
    discarded INTEGER NOT NULL DEFAULT 0,
    discard_reason TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS sessions_group ON sessions (group_id);
-- Newest-first keyset pages of the dashboard and GET /v1/sessions, /v1/groups (gateway/store/lists.py).
CREATE INDEX IF NOT EXISTS sessions_created ON sessions (created_at, id);
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
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    failed TEXT
);
CREATE INDEX IF NOT EXISTS groups_created ON groups (created_at, id);
CREATE INDEX IF NOT EXISTS calls_created ON calls (created_at);
CREATE TABLE IF NOT EXISTS steps (
    model TEXT NOT NULL,
    step INTEGER NOT NULL,
    path TEXT NOT NULL,
    metrics TEXT,
    groups TEXT,
    created_at REAL NOT NULL,
    PRIMARY KEY (model, step)
);
CREATE TABLE IF NOT EXISTS judgements (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    group_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    judge_model TEXT NOT NULL,
    score REAL NOT NULL,
    explanation TEXT,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS judgements_group ON judgements (group_id);
CREATE TABLE IF NOT EXISTS triggers (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    model TEXT NOT NULL,
    created_at REAL NOT NULL,
    consumed_at REAL
);
-- One GPU shared by vLLM and the trainer (--gpu-mode colocated); see gateway/colocate.py.
-- state: idle -> requested (trainer) -> granted (gateway: drained, vLLM asleep)
--        -> released (trainer: step saved) -> idle (gateway: vLLM awake, adapter loaded).
-- Written and emptied by the store's probe while it is degraded (gateway/store/health.py).
CREATE TABLE IF NOT EXISTS store_probe (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    payload BLOB,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS gpu_leases (
    model TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    holder TEXT,
    step INTEGER,
    updated_at REAL NOT NULL
);
-- Each running gateway's heartbeat: a row past `expires_at` is a gateway gone (gateway/store/gateways.py).
CREATE TABLE IF NOT EXISTS gateways (
    id TEXT PRIMARY KEY,
    started_at REAL NOT NULL,
    expires_at REAL NOT NULL
);
"""

# Columns added after the first release: (table, column, definition). `CREATE TABLE IF NOT
# EXISTS` leaves an older file's tables as they were, so start-up adds what is missing.
_ADDED_COLUMNS = (
    ("sessions", "discarded", "INTEGER NOT NULL DEFAULT 0"),
    ("sessions", "discard_reason", "TEXT"),
    ("calls", "client_request_id", "TEXT"),
    ("calls", "sampling", "TEXT"),
    ("groups", "failed", "TEXT"),
    # The protocol a call came in by (chat, responses, messages, completions) and, for any but
    # chat, the client's own request and response; `request`/`response` hold the chat form.
    ("calls", "protocol", "TEXT NOT NULL DEFAULT 'chat'"),
    ("calls", "wire_request", "TEXT"),
    ("calls", "wire_response", "TEXT"),
    # Training by state (trainer.attempts): the step that claimed a group (its rewards no longer
    # change), the attempts that took it without recording a step (a crash counts: the claim
    # adds one before training) and the last failure's reason.
    ("groups", "claimed_step", "INTEGER"),
    ("groups", "attempts", "INTEGER NOT NULL DEFAULT 0"),
    ("groups", "last_error", "TEXT"),
    # What a trained group's session trained with: its advantage, over exactly the sessions
    # trained; or why it left its group (no trainable sample).
    ("sessions", "advantage", "REAL"),
    ("sessions", "untrained_reason", "TEXT"),
    # A call recorded after its group was claimed or trained: served and kept, never trained.
    ("calls", "untrainable", "TEXT"),
    # Live traffic (gateway/store/live.py): the task key an ungrouped session was answered under
    # (X-Task-Id, or derived from its system prompt); how a group was formed (harness, live or
    # shadow) and, for live and shadow groups, their task key; a shadow group's sessions name the
    # live call they shadow.
    ("sessions", "task_key", "TEXT"),
    ("sessions", "shadow_of", "TEXT"),
    ("groups", "origin", "TEXT NOT NULL DEFAULT 'harness'"),
    ("groups", "task_key", "TEXT"),
    # The reward a trained session's step trained with (beside its `advantage`): what a reward's
    # 200 or 409 answer can be checked against (gateway/store/locks.py).
    ("sessions", "trained_reward", "REAL"),
    # Promotion (gateway/store/steps.py): a step's state (rows made before it served at once:
    # promoted), the step it was trained from, the decision's record (JSON), and whether a
    # rejection was cleared by POST /v1/training/resume (it no longer counts towards the pause).
    ("steps", "state", "TEXT NOT NULL DEFAULT 'promoted'"),
    ("steps", "parent", "INTEGER"),
    ("steps", "decision", "TEXT"),
    ("steps", "resumed", "INTEGER NOT NULL DEFAULT 0"),
    # The gateway a group's unfinished judgement waits on (gateway/store/gateways.py): one running
    # there, or a shadow group its sampler has still to judge; handed on once that gateway is gone.
    ("groups", "judged_by", "TEXT"),
)

# Indexes on added columns: made after them, in both backends.
ADDED_INDEXES = (
    # The open live group of a task key, looked up on every reward of an ungrouped session. Not
    # on `model`: that is the request's model name, of any length, and a PostgreSQL index entry
    # holds about 2.7 kB at most (a longer one failed the reward with a 500); a task key is an
    # id or a hash, and one key has an open group per model at most, so the model filters few rows.
    "DROP INDEX IF EXISTS groups_open_live",
    "CREATE INDEX IF NOT EXISTS groups_open_live_key ON groups (split, task_key) WHERE origin = 'live' AND closed = 0",
    # The judgements of a gateway gone, looked up by every gateway's reap (`gateways.reap`); only
    # unfinished ones name a gateway, so the index stays small.
    "CREATE INDEX IF NOT EXISTS groups_judged_by ON groups (judged_by) WHERE judged_by IS NOT NULL",
    # The shadow groups a gateway with shadow samples looks for every few seconds
    # (`shadows.claim_stopped_shadow_group`): its WHERE, so the look never scans every group.
    "CREATE INDEX IF NOT EXISTS groups_shadow_unjudged ON groups (created_at, id) WHERE origin = 'shadow'"
    " AND trained_step IS NULL AND claimed_step IS NULL AND failed IS NULL AND skipped IS NULL"
    " AND ruler_status = 'failed'",
    # The sessions changed since a dashboard poll (`lists.reward_changes`): every write to a
    # session (a call, a reward, a discard) sets updated_at, so a poll reads a range, not the run.
    "CREATE INDEX IF NOT EXISTS sessions_updated ON sessions (updated_at)",
)

# The schema's version (`PRAGMA user_version`): 1 is the first release, each added column one more.
SCHEMA_VERSION = 1 + len(_ADDED_COLUMNS)

# A group is ready when it is closed (or has its expected number of sessions) and every
# session in it has a reward. Discarded sessions (failed rollouts) are left out: they need
# no reward and are never trained. They still count towards `expected_sessions`, because
# that number says how many rollouts will arrive, and a failed one has arrived.
READY_GROUPS = """
SELECT g.*, SUM(s.discarded = 0) AS n_sessions, COUNT(CASE WHEN s.discarded = 0 THEN s.reward END) AS n_rewarded,
       SUM(s.discarded) AS n_discarded
FROM groups g JOIN sessions s ON s.group_id = g.id
WHERE g.model = :model AND g.split = :split AND g.trained_step IS NULL AND g.skipped IS NULL
  AND g.failed IS NULL
GROUP BY g.id
HAVING n_sessions > 0 AND n_rewarded = n_sessions
   AND (g.closed = 1 OR (g.expected_sessions IS NOT NULL AND n_sessions + n_discarded >= g.expected_sessions))
ORDER BY g.created_at
"""


WAL_SIZE_LIMIT = 64 * 1024 * 1024
"""Bytes the WAL file is cut back to once a checkpoint has copied it all and writes start over
at its beginning. SQLite reuses the file but never shrinks it: a WAL that grew while a long
read held the checkpoints back (an export, a backup, a sqlite3 shell left in BEGIN) kept its
gigabytes on disk for as long as the store was open, several times the database's size."""


def connect(path: Path | str, synchronous: str = "normal", busy_timeout: float = 30.0) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), timeout=busy_timeout, check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
    # NORMAL (WAL): a committed transaction is in the WAL file before COMMIT returns, so it
    # survives the process crashing or being killed; only an OS crash or power loss can undo
    # the newest ones. FULL also survives those, for an fsync per group commit (1-15 ms on a
    # shared VM's disk: most of a call's added latency at low concurrency).
    if synchronous.lower() not in ("normal", "full"):
        raise ValueError(f"synchronous must be 'normal' or 'full', not {synchronous!r}")
    conn.execute(f"PRAGMA synchronous={synchronous.upper()}")
    conn.execute(f"PRAGMA busy_timeout={int(busy_timeout * 1000)}")
    conn.execute("PRAGMA foreign_keys=ON")
    return conn


def add_missing_columns(conn: sqlite3.Connection) -> None:
    """Bring a file made by an older rlproxy up to the current schema. In one IMMEDIATE
    transaction, so a gateway and a trainer starting together do not both add a column."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        found = conn.execute("PRAGMA user_version").fetchone()[0]
        if found > SCHEMA_VERSION:
            raise ConfigError(
                f"the store's schema is version {found}, newer than this rlproxy's "
                f"({SCHEMA_VERSION}): upgrade rlproxy on this machine"
            )
        added = set()
        for table, column, definition in _ADDED_COLUMNS:
            present = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
            if column not in present:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
                added.add((table, column))
        for statement in ADDED_INDEXES:
            conn.execute(statement)
        if ("groups", "judged_by") in added:  # judgements from before the heartbeat: handed on too
            gateways.adopt_unnamed(conn)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
