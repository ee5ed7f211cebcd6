"""The store: one SQLite file (WAL) that is the only channel between gateway and trainer.

Writes from the gateway go through one writer task that batches them into a
single transaction per round (group commit); a caller's `await` returns only
after its transaction committed, so a response acknowledged to a client is on
disk. The trainer, in its own process, opens the same file with `Store(path)`
and uses the synchronous methods.

Token ids and logprobs are stored as packed int32 / float32 arrays.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import orjson
import sqlite_utils

from gateway.errors import Conflict, NotFound

# ------------------------------------------------------------------ array codec


def pack_ids(ids: Iterable[int] | None) -> bytes | None:
    return None if ids is None else array("i", ids).tobytes()


def unpack_ids(blob: bytes | None) -> list[int] | None:
    if blob is None:
        return None
    values = array("i")
    values.frombytes(blob)
    return values.tolist()


def pack_floats(values: Iterable[float] | None) -> bytes | None:
    return None if values is None else array("f", values).tobytes()


def unpack_floats(blob: bytes | None) -> list[float] | None:
    if blob is None:
        return None
    values = array("f")
    values.frombytes(blob)
    return values.tolist()


def _split(flat: list | None, lengths: list[int]) -> list[list] | None:
    if flat is None:
        return None
    out, start = [], 0
    for length in lengths:
        out.append(flat[start : start + length])
        start += length
    return out


# ------------------------------------------------------------------ records


@dataclass
class CallRecord:
    """One chat completion call as the gateway saw it."""

    id: str  # the request id (X-Request-Id)
    session_id: str
    group_id: str | None
    split: str  # "train" | "val"
    model: str  # the name the client asked for
    served: str | None  # what the engine answered with: base id or adapter name such as "agent@3"
    step: int | None  # adapter step that produced the answer; None for the base model or an upstream
    engine: str
    stream: bool
    status: str  # "ok" | "error"
    request: dict
    response: dict | None
    latency_ms: float
    error: str | None = None
    http_status: int = 200
    prompt_ids: list[int] | None = None
    completion_ids: list[list[int]] | None = None  # one list per choice
    completion_logprobs: list[list[float]] | None = None  # one list per choice, or None
    created_at: float = field(default_factory=time.time)
    client_request_id: str | None = None  # the client's own X-Request-Id, kept for tracing


_SCHEMA = """
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
"""

# Columns added after the first release: (table, column, definition). `CREATE TABLE IF NOT
# EXISTS` leaves an older file's tables as they were, so start-up adds what is missing.
_ADDED_COLUMNS = (
    ("sessions", "discarded", "INTEGER NOT NULL DEFAULT 0"),
    ("sessions", "discard_reason", "TEXT"),
    ("calls", "client_request_id", "TEXT"),
)

# A group is ready when it is closed (or has its expected number of sessions) and every
# session in it has a reward. Discarded sessions (failed rollouts) are left out: they need
# no reward and are never trained. They still count towards `expected_sessions`, because
# that number says how many rollouts will arrive, and a failed one has arrived.
_READY_GROUPS = """
SELECT g.*, SUM(s.discarded = 0) AS n_sessions, COUNT(CASE WHEN s.discarded = 0 THEN s.reward END) AS n_rewarded,
       SUM(s.discarded) AS n_discarded
FROM groups g JOIN sessions s ON s.group_id = g.id
WHERE g.model = :model AND g.split = :split AND g.trained_step IS NULL AND g.skipped IS NULL
GROUP BY g.id
HAVING n_sessions > 0 AND n_rewarded = n_sessions
   AND (g.closed = 1 OR (g.expected_sessions IS NOT NULL AND n_sessions + n_discarded >= g.expected_sessions))
ORDER BY g.created_at
"""


def _connect(path: Path | str, synchronous: str = "normal") -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), timeout=30.0, check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    # NORMAL (WAL): a committed transaction is in the WAL file before COMMIT returns, so it
    # survives the process crashing or being killed; only an OS crash or power loss can undo
    # the newest ones. FULL also survives those, for an fsync per group commit (1-15 ms on a
    # shared VM's disk: most of a call's added latency at low concurrency).
    if synchronous.lower() not in ("normal", "full"):
        raise ValueError(f"synchronous must be 'normal' or 'full', not {synchronous!r}")
    conn.execute(f"PRAGMA synchronous={synchronous.upper()}")
    conn.execute("PRAGMA busy_timeout=30000")
    conn.execute("PRAGMA foreign_keys=ON")
    return conn


def _add_missing_columns(conn: sqlite3.Connection) -> None:
    """Bring a file made by an older rlproxy up to the current schema. In one IMMEDIATE
    transaction, so a gateway and a trainer starting together do not both add a column."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        for table, column, definition in _ADDED_COLUMNS:
            present = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
            if column not in present:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


class Store:
    """The SQLite store. `Store(path)` for a file, `Store(memory=True)` for tests."""

    def __init__(self, path: Path | str | None = None, *, memory: bool = False, synchronous: str = "normal"):
        if memory:
            # One shared in-memory database, reachable from the writer thread too.
            uri = f"file:rlproxy-{id(self)}?mode=memory&cache=shared"
            self._conn = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
            self._read_conn = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
        else:
            if path is None:
                raise ValueError("Store needs a path, or memory=True")
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._conn = _connect(path, synchronous)
            self._read_conn = _connect(path, synchronous)
        self.path = path
        self.db = sqlite_utils.Database(self._conn)
        self._write_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._conn.executescript(_SCHEMA)
        _add_missing_columns(self._conn)
        self._queue: asyncio.Queue | None = None
        self._writer: asyncio.Task | None = None
        self.commits = 0  # transactions the writer committed (for /metrics and tests)

    # -------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the writer task (call from the event loop that will write)."""
        self._queue = asyncio.Queue()
        self._writer = asyncio.create_task(self._write_loop(), name="rlproxy-store-writer")

    async def close(self) -> None:
        if self._writer is not None:
            await self._queue.put(None)
            await self._writer
            self._writer = None
        self._conn.close()
        self._read_conn.close()

    # -------------------------------------------------------------- writer

    async def _submit(self, op: Callable[[sqlite3.Connection], Any]) -> Any:
        if self._queue is None:
            # No writer running (trainer process, scripts): write synchronously.
            return await asyncio.to_thread(self._run_sync, op)
        future = asyncio.get_running_loop().create_future()
        await self._queue.put((op, future))
        return await future

    def _run_sync(self, op: Callable[[sqlite3.Connection], Any]) -> Any:
        with self._write_lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                result = op(self._conn)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
            return result

    async def _write_loop(self) -> None:
        assert self._queue is not None
        stopping = False
        while not stopping:
            batch = [await self._queue.get()]
            while not self._queue.empty() and len(batch) < 512:
                batch.append(self._queue.get_nowait())
            if None in batch:
                stopping = True
                batch = [item for item in batch if item is not None]
            if not batch:
                continue
            try:
                outcomes = await asyncio.to_thread(self._apply_batch, [op for op, _ in batch])
            except BaseException as exc:  # the commit itself failed: nobody is acknowledged
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                continue
            for (_, future), (ok, value) in zip(batch, outcomes):
                if future.done():
                    continue
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)

    def _apply_batch(self, ops: list[Callable[[sqlite3.Connection], Any]]) -> list[tuple[bool, Any]]:
        """Run every op in one transaction; an op that raises is rolled back alone (savepoint)."""
        outcomes: list[tuple[bool, Any]] = []
        with self._write_lock:
            conn = self._conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                for op in ops:
                    conn.execute("SAVEPOINT op")
                    try:
                        outcomes.append((True, op(conn)))
                        conn.execute("RELEASE op")
                    except Exception as exc:  # noqa: BLE001 - handed to the caller
                        conn.execute("ROLLBACK TO op")
                        conn.execute("RELEASE op")
                        outcomes.append((False, exc))
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            self.commits += 1
        return outcomes

    # -------------------------------------------------------------- writes

    async def record_call(self, call: CallRecord) -> None:
        await self._submit(lambda conn: _insert_call(conn, call))

    def record_call_sync(self, call: CallRecord) -> None:
        self._run_sync(lambda conn: _insert_call(conn, call))

    async def set_reward(self, session_id: str, reward: float, metrics: dict[str, float] | None = None) -> dict:
        return await self._submit(lambda conn: _set_reward(conn, session_id, reward, metrics or {}))

    async def close_group(self, group_id: str, expected_sessions: int | None = None) -> dict:
        return await self._submit(lambda conn: _close_group(conn, group_id, expected_sessions))

    async def discard_session(self, session_id: str, reason: str | None = None) -> dict:
        """Leave a session (a failed rollout) out of its group: it needs no reward and is
        never trained; its calls stay recorded. Discarding twice is harmless."""
        await self._submit(lambda conn: _discard_session(conn, session_id, reason))
        return self.get_session(session_id)

    async def set_ruler_status(self, group_id: str, status: str, error: str | None = None) -> None:
        def op(conn: sqlite3.Connection) -> None:
            _require_group(conn, group_id)
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
            _require_group(conn, group_id)
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
                "UPDATE groups SET ruler_status = 'scored', ruler_error = NULL, closed = closed OR ?, updated_at = ?"
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
        self, model: str, step: int, path: str, metrics: dict, group_ids: list[str]
    ) -> None:
        """Insert a step row and mark its groups trained, in one transaction."""

        def op(conn: sqlite3.Connection) -> None:
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
        return rows[0] if rows else {"model": model, "state": "idle", "holder": None, "step": None,
                                     "updated_at": None}

    def move_gpu_lease(self, model: str, to_state: str, *, expect: tuple[str, ...], holder: str | None = None,
                       expect_holder: str | None = None, step: int | None = None) -> bool:
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
            cursor = self._read_conn.execute(sql, params)
            names = [d[0] for d in cursor.description]
            return [dict(zip(names, row)) for row in cursor.fetchall()]

    def get_session(self, session_id: str) -> dict:
        rows = self._query("SELECT * FROM sessions WHERE id = ?", (session_id,))
        if not rows:
            raise NotFound(f"session '{session_id}' not found", param="session_id")
        session = _decode_session(rows[0])
        session["calls"] = self.session_calls(session_id)
        return session

    def session_calls(self, session_id: str) -> list[dict]:
        rows = self._query("SELECT * FROM calls WHERE session_id = ? ORDER BY created_at, rowid", (session_id,))
        return [_decode_call(row) for row in rows]

    def get_group(self, group_id: str) -> dict:
        rows = self._query("SELECT * FROM groups WHERE id = ?", (group_id,))
        if not rows:
            raise NotFound(f"group '{group_id}' not found", param="group_id")
        group = rows[0]
        every = [
            _decode_session(row)
            for row in self._query("SELECT * FROM sessions WHERE group_id = ? ORDER BY created_at", (group_id,))
        ]
        # `sessions` are the ones the group is judged and trained on; discarded ones
        # (failed rollouts) are listed apart, as in `_READY_GROUPS`.
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
        sql = _READY_GROUPS + (f" LIMIT {int(limit)}" if limit else "")
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

    def counts(self) -> dict[str, int]:
        out = {}
        for table in ("calls", "sessions", "groups", "steps", "judgements"):
            out[table] = self._query(f"SELECT COUNT(*) AS n FROM {table}")[0]["n"]
        return out


# ------------------------------------------------------------------ ops (run on the writer connection)


def _to_json(value: Any) -> str:
    """orjson on the hot path (a tenth of json's cost); json for what orjson refuses (huge ints)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:
        return json.dumps(value, default=str)


def _insert_call(conn: sqlite3.Connection, call: CallRecord) -> None:
    now = call.created_at
    lengths = [len(ids) for ids in call.completion_ids] if call.completion_ids is not None else None
    flat_ids = [t for ids in call.completion_ids for t in ids] if call.completion_ids is not None else None
    flat_lps = (
        [lp for lps in call.completion_logprobs for lp in lps] if call.completion_logprobs is not None else None
    )
    conn.execute(
        "INSERT INTO calls (id, session_id, group_id, split, model, served, step, engine, stream, status,"
        " http_status, error, request, response, prompt_ids, completion_ids, completion_logprobs,"
        " completion_lengths, latency_ms, created_at, client_request_id)"
        " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (
            call.id,
            call.session_id,
            call.group_id,
            call.split,
            call.model,
            call.served,
            call.step,
            call.engine,
            int(call.stream),
            call.status,
            call.http_status,
            call.error,
            _to_json(call.request),
            _to_json(call.response) if call.response is not None else None,
            pack_ids(call.prompt_ids),
            pack_ids(flat_ids),
            pack_floats(flat_lps),
            json.dumps(lengths) if lengths is not None else None,
            call.latency_ms,
            now,
            call.client_request_id,
        ),
    )
    base_model = call.model.split("@", 1)[0]
    conn.execute(
        "INSERT INTO sessions (id, group_id, split, model, n_calls, created_at, updated_at) VALUES (?,?,?,?,1,?,?)"
        " ON CONFLICT(id) DO UPDATE SET n_calls = n_calls + 1, updated_at = excluded.updated_at,"
        " group_id = COALESCE(sessions.group_id, excluded.group_id)",
        (call.session_id, call.group_id, call.split, base_model, now, now),
    )
    if call.group_id is not None:
        conn.execute(
            "INSERT INTO groups (id, model, split, created_at, updated_at) VALUES (?,?,?,?,?)"
            " ON CONFLICT(id) DO UPDATE SET updated_at = excluded.updated_at",
            (call.group_id, base_model, call.split, now, now),
        )


def _set_reward(conn: sqlite3.Connection, session_id: str, reward: float, metrics: dict[str, float]) -> dict:
    row = conn.execute("SELECT metrics FROM sessions WHERE id = ?", (session_id,)).fetchone()
    if row is None:
        raise NotFound(
            f"session '{session_id}' not found: post a reward after the session's first chat completion",
            param="session_id",
        )
    merged = {**json.loads(row[0] or "{}"), **metrics}
    now = time.time()
    conn.execute(
        "UPDATE sessions SET reward = ?, metrics = ?, rewarded_at = ?, updated_at = ? WHERE id = ?",
        (reward, json.dumps(merged), now, now, session_id),
    )
    return {"session_id": session_id, "reward": reward, "metrics": merged}


def _require_group(conn: sqlite3.Connection, group_id: str) -> None:
    if conn.execute("SELECT 1 FROM groups WHERE id = ?", (group_id,)).fetchone() is None:
        raise NotFound(
            f"group '{group_id}' not found: a group exists once a call was made with its X-Group-Id",
            param="group_id",
        )


def _close_group(conn: sqlite3.Connection, group_id: str, expected_sessions: int | None) -> dict:
    _require_group(conn, group_id)
    now = time.time()
    if expected_sessions is None:
        conn.execute("UPDATE groups SET closed = 1, updated_at = ? WHERE id = ?", (now, group_id))
    else:
        conn.execute(
            "UPDATE groups SET expected_sessions = ?, updated_at = ? WHERE id = ?", (expected_sessions, now, group_id)
        )
    return {"group_id": group_id, "closed": expected_sessions is None, "expected_sessions": expected_sessions}


def _discard_session(conn: sqlite3.Connection, session_id: str, reason: str | None) -> None:
    row = conn.execute(
        "SELECT s.group_id, g.trained_step FROM sessions s LEFT JOIN groups g ON g.id = s.group_id WHERE s.id = ?",
        (session_id,),
    ).fetchone()
    if row is None:
        raise NotFound(
            f"session '{session_id}' not found: a session exists once it made a chat completion "
            "(a rollout that failed before its first call has nothing to discard)",
            param="session_id",
        )
    group_id, trained_step = row
    if trained_step is not None:
        raise Conflict(
            f"session '{session_id}' cannot be discarded: its group '{group_id}' was already trained "
            f"(step {trained_step})",
            param="session_id",
        )
    # A second discard keeps the first reason unless it gives one.
    conn.execute(
        "UPDATE sessions SET discarded = 1, discard_reason = COALESCE(?, discard_reason), updated_at = ?"
        " WHERE id = ?",
        (reason, time.time(), session_id),
    )


def _decode_session(row: dict) -> dict:
    row = dict(row)
    row["metrics"] = json.loads(row["metrics"] or "{}")
    row["discarded"] = bool(row["discarded"])
    return row


def _decode_call(row: dict) -> dict:
    row = dict(row)
    lengths = json.loads(row.pop("completion_lengths") or "null")
    row["stream"] = bool(row["stream"])
    row["request"] = json.loads(row["request"])
    row["response"] = json.loads(row["response"]) if row["response"] else None
    row["prompt_ids"] = unpack_ids(row["prompt_ids"])
    if lengths is not None:
        row["completion_ids"] = _split(unpack_ids(row["completion_ids"]), lengths)
        row["completion_logprobs"] = _split(unpack_floats(row["completion_logprobs"]), lengths)
    else:
        row["completion_ids"] = None
        row["completion_logprobs"] = None
    return row
