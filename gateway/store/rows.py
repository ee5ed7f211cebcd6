"""What a store row holds and the writes that make one, as plain functions on a connection.

The array codec (token ids as packed int32, logprobs as packed float32), `CallRecord`
(one chat completion as the gateway saw it), and the ops the store's writer runs inside
its transaction: each takes the writer's `sqlite3.Connection` and neither begins nor
commits, so `Store` decides how they are batched. `decode_*` turn a read row back into
what the API returns.
"""

from __future__ import annotations

import json
import sqlite3
import time
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.errors import Conflict, InvalidRequest, NotFound, other_group
from gateway.store.frozen import frozen_group_reason, joined_late, joined_late_reason, late_call_reason
from gateway.store.live import NO_ANSWER_IN_GROUP, LiveRule, answered, join_live_group
from gateway.store.locks import for_update, lock_group, lock_live_key

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

    id: str  # the gateway's request id (its X-Request-Id response header)
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
    # behaviour logprobs (see engines.base.ChoiceTokens): one list per choice, or None
    behaviour_logprobs: list[list[float]] | None = None
    sampling: dict | None = None  # the sampling parameters in force (engines.base.TokenRecord)
    created_at: float = field(default_factory=time.time)
    client_request_id: str | None = None  # the client's own X-Request-Id, kept for tracing
    protocol: str = "chat"  # what the client spoke; `request`/`response` are always the chat form
    wire_request: dict | None = None  # the client's body, for protocols other than chat
    wire_response: dict | None = None  # what that client got back
    untrainable: str | None = None  # set by the store: why this call can never be trained (a late call)
    task_key: str | None = None  # the session's task (X-Task-Id or derived: gateway.chat.identity.task_key)
    shadow_of: str | None = None  # a shadow group's call: the live call it shadows (gateway/shadow/)


SHADOW_CALL_INFIX = "-shadow-"
"""In the id of every shadow group's call, and in no id the gateway gives a client's call."""


def shadow_call_id(live_call_id: str, index: int) -> str:
    """Call `index` of the shadow group of live call `live_call_id` (0: the copy of the live
    answer; 1..K: its shadow samples). The gateway names them so (gateway/shadow/); the trainer
    finds a live turn's copy by it, to weigh the turn once across its two groups."""
    return f"{live_call_id}{SHADOW_CALL_INFIX}{index}"


# ------------------------------------------------------------------ ops (run on the writer connection)


def _to_json(value: Any) -> str:
    """orjson on the hot path (a tenth of json's cost); json for what orjson refuses (huge ints)."""
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:
        return json.dumps(value, default=str)


class CallWrite:
    """`insert_call` as a write op that can tell afterwards whether it committed. On PostgreSQL a
    COMMIT whose reply is lost (the connection dropped) may have committed or not; answering the
    client 503 for a call that did land makes it retry (the official clients do, twice) and the
    call is recorded twice. The call's id is unique, so its row says which it was."""

    def __init__(self, call: CallRecord) -> None:
        self.call = call

    def __call__(self, conn: Any) -> str | None:
        return insert_call(conn, self.call)

    def landed(self, conn: Any) -> bool:
        return conn.execute("SELECT 1 FROM calls WHERE id = ?", (self.call.id,)).fetchone() is not None


def insert_call(conn: sqlite3.Connection, call: CallRecord) -> str | None:
    """Insert the call and upsert its session and group. Returns why the call can never be
    trained (its group was already claimed by a step or trained: it is kept, marked
    `untrainable`), or None."""
    now = call.created_at
    lengths = [len(ids) for ids in call.completion_ids] if call.completion_ids is not None else None
    flat_ids = [t for ids in call.completion_ids for t in ids] if call.completion_ids is not None else None
    flat_lps = [lp for lps in call.behaviour_logprobs for lp in lps] if call.behaviour_logprobs is not None else None
    conn.execute(
        "INSERT INTO calls (id, session_id, group_id, split, model, served, step, engine, stream, status,"
        " http_status, error, request, response, prompt_ids, completion_ids, completion_logprobs,"
        " completion_lengths, latency_ms, created_at, client_request_id, sampling, protocol, wire_request,"
        " wire_response) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
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
            _to_json(call.sampling) if call.sampling is not None else None,
            call.protocol,
            _to_json(call.wire_request) if call.wire_request is not None else None,
            _to_json(call.wire_response) if call.wire_response is not None else None,
        ),
    )
    base_model = call.model.split("@", 1)[0]
    # Whether the group is claimed is read under the group's row lock (its upsert, or FOR
    # UPDATE): a claim commits before this call (then late) or after it (and reads it). The
    # group's row is locked before the session's (gateway/store/locks.py), except for a call
    # without X-Group-Id, which learns its session's group from the session's upsert.
    group_state: tuple | None = None
    if call.group_id is not None:
        group_state = conn.execute(
            "INSERT INTO groups (id, model, split, created_at, updated_at) VALUES (?,?,?,?,?)"
            " ON CONFLICT(id) DO UPDATE SET updated_at = excluded.updated_at"
            " RETURNING split, trained_step, claimed_step, COALESCE(failed, skipped)",
            (call.group_id, base_model, call.split, now, now),
        ).fetchone()
    # A session keeps one split, and it is its group's: a val rollout inside a train group
    # would be trained on, a train one inside a val group never would. The upserts return the
    # rows as stored, so the checks cost no extra statement; a conflict raises, and the
    # caller's rollback takes the whole call back out.
    split, group_id = conn.execute(
        "INSERT INTO sessions (id, group_id, split, model, n_calls, created_at, updated_at, task_key, shadow_of)"
        " VALUES (?,?,?,?,1,?,?,?,?)"
        " ON CONFLICT(id) DO UPDATE SET n_calls = sessions.n_calls + 1, updated_at = excluded.updated_at,"
        " group_id = COALESCE(sessions.group_id, excluded.group_id),"
        " task_key = COALESCE(sessions.task_key, excluded.task_key) RETURNING split, group_id",
        (call.session_id, call.group_id, call.split, base_model, now, now, call.task_key, call.shadow_of),
    ).fetchone()
    if split != call.split:
        raise Conflict(
            f"session '{call.session_id}' is a '{split}' session; this call says X-Split '{call.split}'. "
            "Keep one split per session.",
            param="split",
        )
    if call.group_id is not None:
        if group_id != call.group_id:  # the session's first group stays (COALESCE): refuse, not record it apart
            raise other_group(call.session_id, group_id, call.group_id)
    elif group_id is not None:  # a call without a group, in a session that has one
        group_state = conn.execute(
            "SELECT split, trained_step, claimed_step, COALESCE(failed, skipped) FROM groups WHERE id = ?"
            + for_update(conn),
            (group_id,),
        ).fetchone()
    else:
        return None
    group_split, trained_step, claimed_step, set_aside = group_state or (call.split, None, None, None)
    if group_split != call.split:
        raise Conflict(
            f"group '{group_id}' holds '{group_split}' sessions; this call says X-Split '{call.split}'. "
            "Use one split per group (a separate group id for val rollouts).",
            param="split",
        )
    reason = late_call_reason(group_id, trained_step, claimed_step, set_aside)
    if reason is not None:
        conn.execute("UPDATE calls SET untrainable = ? WHERE id = ?", (reason, call.id))
    return reason


NO_GROUP = (
    "no group: the session came without X-Group-Id and this gateway forms no live groups "
    "(--live-group-size); the reward is kept, never trained"
)

# A session's metrics are kept with it and returned by every list page that holds it; rewards
# merge theirs by name into it, so the bound is on what it keeps. The same as one reward's
# (`MAX_METRICS` in gateway/protocols/chat.py, checked before the body reaches the store).
MAX_SESSION_METRICS = 64


def set_reward(
    conn: sqlite3.Connection, session_id: str, reward: float, metrics: dict[str, float], live: LiveRule | None = None
) -> dict:
    """Store a session's reward. The answer says whether it can train (`trainable`): a session
    of a group can; an ungrouped one joins a live group under `live` (gateway/store/live.py).
    Decided under the group's lock (gateway/store/locks.py): a claim commits before this
    reward (409) or after it (and trains it)."""
    group_id, task_key, split, model = _reward_target(conn, session_id)
    if group_id is None and live is not None and task_key is not None:
        lock_live_key(conn, model, split, task_key)  # joins of one key, this session's too, take turns
        group_id = _reward_target(conn, session_id)[0]  # as the join before ours left it
    state = lock_group(conn, group_id) if group_id is not None else None
    row = conn.execute(
        "SELECT metrics, group_id, discarded FROM sessions WHERE id = ?" + for_update(conn), (session_id,)
    ).fetchone()
    if row is None:  # deleted while this waited for its lock (`rlproxy forget`, PostgreSQL)
        raise NotFound(f"session '{session_id}' not found: it was forgotten as this reward came", param="session_id")
    if row[1] != group_id:  # a call named a group for it meanwhile
        group_id = row[1]
        state = lock_group(conn, group_id) if group_id is not None else None
    discarded = row[2]
    frozen = frozen_group_reason(group_id, *state) if state is not None else None
    if frozen is not None:
        if state is not None and joined_late(conn, session_id):  # "post earlier" could not have helped it
            raise Conflict(joined_late_reason(session_id, group_id, *state), param="session_id")
        raise Conflict(f"session '{session_id}' takes no reward now: its {frozen}", param="session_id")
    kept = json.loads(row[0] or "{}")
    merged = {**kept, **metrics}
    if len(merged) > max(MAX_SESSION_METRICS, len(kept)):  # one stored before the bound keeps what it has
        raise InvalidRequest(
            f"session '{session_id}' would keep {len(merged)} metrics with this reward's, over the limit of "
            f"{MAX_SESSION_METRICS}: metrics are merged by name across rewards, so reuse the names already sent",
            param="metrics",
        )
    now = time.time()
    conn.execute(
        "UPDATE sessions SET reward = ?, metrics = ?, rewarded_at = ?, updated_at = ? WHERE id = ?",
        (reward, json.dumps(merged), now, now, session_id),
    )
    answer: dict = {"session_id": session_id, "reward": reward, "metrics": merged}
    if group_id is not None:
        answer["group_id"] = group_id
    # `trainable: false` always comes with its reason, a grouped session's too
    if discarded:
        answer.update(trainable=False, reason="discarded: the session was discarded, so it is never trained")
    elif split != "train":
        answer.update(trainable=False, reason=f"split '{split}': recorded and scored, never trained")
    elif group_id is not None and not answered(conn, session_id):  # the trainer leaves it out of its group
        answer.update(trainable=False, reason=NO_ANSWER_IN_GROUP)
    elif group_id is not None:
        answer.update(trainable=True)
    elif live is None or task_key is None:
        answer.update(trainable=False, reason=NO_GROUP)
    else:
        answer.update(join_live_group(conn, session_id, model, split, task_key, live))
    return answer


def _reward_target(conn: sqlite3.Connection, session_id: str) -> tuple:
    """(group id, task key, split, model) of a session, read without a lock."""
    row = conn.execute("SELECT group_id, task_key, split, model FROM sessions WHERE id = ?", (session_id,)).fetchone()
    if row is None:
        raise NotFound(
            f"session '{session_id}' not found: post a reward after the session's first chat completion",
            param="session_id",
        )
    return tuple(row)


def require_group(conn: sqlite3.Connection, group_id: str) -> None:
    if conn.execute("SELECT 1 FROM groups WHERE id = ?", (group_id,)).fetchone() is None:
        raise NotFound(
            f"group '{group_id}' not found: a group exists once a call was made with its X-Group-Id",
            param="group_id",
        )


def close_group(conn: sqlite3.Connection, group_id: str, expected_sessions: int | None) -> dict:
    require_group(conn, group_id)
    now = time.time()
    if expected_sessions is None:
        conn.execute("UPDATE groups SET closed = 1, updated_at = ? WHERE id = ?", (now, group_id))
    else:
        conn.execute(
            "UPDATE groups SET expected_sessions = ?, updated_at = ? WHERE id = ?", (expected_sessions, now, group_id)
        )
    return {"group_id": group_id, "closed": expected_sessions is None, "expected_sessions": expected_sessions}


def decode_session(row: dict) -> dict:
    row = dict(row)
    row["metrics"] = json.loads(row["metrics"] or "{}")
    row["discarded"] = bool(row["discarded"])
    return row


def decode_call(row: dict) -> dict:
    row = dict(row)
    lengths = json.loads(row.pop("completion_lengths") or "null")
    row["stream"] = bool(row["stream"])
    row["request"] = json.loads(row["request"])
    row["response"] = json.loads(row["response"]) if row["response"] else None
    for key in ("wire_request", "wire_response"):
        if key in row:
            row[key] = json.loads(row[key]) if row[key] else None
    row["prompt_ids"] = unpack_ids(row["prompt_ids"])
    if lengths is not None:
        row["completion_ids"] = _split(unpack_ids(row["completion_ids"]), lengths)
        behaviour = unpack_floats(row.pop("completion_logprobs"))
        row["behaviour_logprobs"] = _split(behaviour, lengths) if behaviour is not None else None
    else:
        row.pop("completion_logprobs")
        row["completion_ids"] = None
        row["behaviour_logprobs"] = None
    row["sampling"] = json.loads(row["sampling"]) if row.get("sampling") else None
    return row
