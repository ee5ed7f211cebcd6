-- The SQLite schema of rlproxy's first release (commit 73c84b3), for the migration tests.
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
    client_request_id TEXT
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
    updated_at REAL NOT NULL
);
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
CREATE TABLE IF NOT EXISTS gpu_leases (
    model TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    holder TEXT,
    step INTEGER,
    updated_at REAL NOT NULL
);
