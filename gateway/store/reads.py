"""The store's reads that take more than one query: a group with its sessions and its
judgements, a session with its calls, the steps of a model, the sessions an export or a
distillation selects. Each function takes `query(sql, params) -> list[dict]` (the backend's
read connection), as `gateway.store.lists` does, so both backends share the SQL."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from gateway.errors import InvalidRequest, NotFound
from gateway.store.rows import decode_session

Query = Callable[..., list[dict]]


@dataclass(frozen=True)
class SessionFilter:
    """Which recorded sessions to take (export, the model card): the filters are ANDed."""

    split: str | None = None
    """"train" or "val"; None: both."""
    rewarded: bool = False
    """Only sessions with a reward."""
    min_reward: float | None = None
    """Only sessions whose reward is at least this (implies `rewarded`)."""
    since_step: int | None = None
    """Only sessions every call of which was answered by this adapter step or a later one
    (applied by the caller, on the calls: `gateway.export.selection`)."""
    groups: tuple[str, ...] = ()
    """Only sessions of these groups; empty: any group."""
    include_discarded: bool = False
    """Discarded sessions (failed rollouts) are left out unless asked for."""
    model: str | None = None
    """Only sessions recorded under this model name (the name clients asked for, less any
    `@step`: a teacher's traffic behind the openai engine, say)."""
    since: float | None = None
    """Only sessions started at or after this time (Unix seconds)."""
    until: float | None = None
    """Only sessions started before this time (Unix seconds)."""

    def __post_init__(self) -> None:
        if self.split not in (None, "train", "val"):
            raise InvalidRequest(f"split must be train or val, not {self.split!r}")
        if self.since_step is not None and self.since_step < 0:
            raise InvalidRequest(f"--since-step must be 0 or more, not {self.since_step}")
        if self.since is not None and self.until is not None and self.until <= self.since:
            raise InvalidRequest("--until must be later than --since")


def session_ids(query: Query, where: SessionFilter) -> list[str]:
    """Ids of the sessions that pass `where` (all but `since_step`), oldest first."""
    clauses: list[str] = []
    params: list = []
    if where.split:
        clauses.append("split = ?")
        params.append(where.split)
    if where.rewarded or where.min_reward is not None:
        clauses.append("reward IS NOT NULL")
    if where.min_reward is not None:
        clauses.append("reward >= ?")
        params.append(float(where.min_reward))
    if where.groups:
        clauses.append(f"group_id IN ({', '.join('?' for _ in where.groups)})")
        params += list(where.groups)
    if not where.include_discarded:
        clauses.append("discarded = 0")
    if where.model is not None:
        clauses.append("model = ?")
        params.append(where.model.split("@", 1)[0])
    if where.since is not None:
        clauses.append("created_at >= ?")
        params.append(float(where.since))
    if where.until is not None:
        clauses.append("created_at < ?")
        params.append(float(where.until))
    # Portable SQL (both backends run it): ids break ties between equal times.
    where_sql = " WHERE " + " AND ".join(clauses) if clauses else ""
    sql = f"SELECT id FROM sessions{where_sql} ORDER BY created_at, id"
    return [row["id"] for row in query(sql, tuple(params))]


def session_row(query: Query, session_id: str) -> dict:
    rows = query("SELECT * FROM sessions WHERE id = ?", (session_id,))
    if not rows:
        raise NotFound(f"session '{session_id}' not found", param="session_id")
    return decode_session(rows[0])


def group(query: Query, group_id: str) -> dict:
    rows = query("SELECT * FROM groups WHERE id = ?", (group_id,))
    if not rows:
        raise NotFound(f"group '{group_id}' not found", param="group_id")
    found = rows[0]
    every = [
        decode_session(row)
        for row in query("SELECT * FROM sessions WHERE group_id = ? ORDER BY created_at", (group_id,))
    ]
    # `sessions` are the ones the group is judged and trained on; discarded ones
    # (failed rollouts) are listed apart, as in the schema's READY_GROUPS.
    sessions = [s for s in every if not s["discarded"]]
    discarded = [s for s in every if s["discarded"]]
    found["closed"] = bool(found["closed"])
    found["sessions"] = sessions
    found["discarded_sessions"] = discarded
    found["n_sessions"] = len(sessions)
    found["n_rewarded"] = sum(1 for s in sessions if s["reward"] is not None)
    found["n_discarded"] = len(discarded)
    expected = found["expected_sessions"]
    found["ready"] = bool(
        sessions
        and found["n_rewarded"] == len(sessions)
        and (found["closed"] or (expected is not None and len(every) >= expected))
    )
    found["judgements"] = query(
        "SELECT session_id, judge_model, score, explanation, created_at FROM judgements WHERE group_id = ? ORDER BY id",
        (group_id,),
    )
    return found


def steps(query: Query, model: str | None) -> list[dict]:
    if model is None:
        rows = query("SELECT * FROM steps ORDER BY model, step")
    else:
        rows = query("SELECT * FROM steps WHERE model = ? ORDER BY step", (model,))
    return _decoded_steps(rows)


def recent_steps(query: Query, model: str, newest: int) -> list[dict]:
    """The step rows a poll of the serving state needs: the newest `newest` and every one not
    superseded (the serving step, candidates, those turned down). Each promotion supersedes the
    step before, so these stay a handful while the steps grow by thousands: read whole, with
    their metrics and group lists, every second, they cost a gateway more each day it ran."""
    rows = query(
        "SELECT * FROM steps WHERE model = ? AND (state <> 'superseded' OR step > "
        "(SELECT MAX(step) FROM steps WHERE model = ?) - ?) ORDER BY step",
        (model, model, newest),
    )
    return _decoded_steps(rows)


def step_history(query: Query, model: str, after: int | None) -> tuple[int, list[dict]]:
    """How many step rows `model` has, and those after step `after` (None: all) with what never
    changes once a step is recorded: its number, time, metrics and groups (`StepHistory` keeps them)."""
    columns = "SELECT step, created_at, metrics, groups FROM steps WHERE model = ?"
    if after is None:
        rows = query(columns + " ORDER BY step", (model,))
    else:
        rows = query(columns + " AND step > ? ORDER BY step", (model, after))
    count = query("SELECT COUNT(*) AS n FROM steps WHERE model = ?", (model,))[0]["n"]
    for row in rows:
        row["metrics"] = json.loads(row["metrics"] or "{}")
        row["groups"] = json.loads(row["groups"] or "[]")
    return int(count), rows


def _decoded_steps(rows: list[dict]) -> list[dict]:
    for row in rows:
        row["metrics"] = json.loads(row["metrics"] or "{}")
        row["groups"] = json.loads(row["groups"] or "[]")
        row["decision"] = json.loads(row["decision"]) if row.get("decision") else None
    return rows


def gpu_lease(query: Query, model: str) -> dict:
    rows = query("SELECT * FROM gpu_leases WHERE model = ?", (model,))
    return rows[0] if rows else {"model": model, "state": "idle", "holder": None, "step": None, "updated_at": None}


def counts(query: Query) -> dict[str, int]:
    """Rows per table, plus `live_counts` (the dashboard's live-traffic panel)."""
    tables = {
        table: query(f"SELECT COUNT(*) AS n FROM {table}")[0]["n"]
        for table in ("calls", "sessions", "groups", "steps", "judgements")
    }
    return {**tables, **live_counts(query)}


ORIGINS = ("harness", "live", "shadow")  # groups.origin: a harness's X-Group-Id, live traffic, shadow samples


def live_counts(query: Query) -> dict[str, int]:
    """Groups per origin (`groups_<origin>`, and `groups_<origin>_trained`), and the sessions a
    stale reward left untrained (`sessions_stale`). One pass over groups; a stale session has
    left its group (`gateway.store.live`), so the sessions' group index finds it."""
    out = {f"groups_{origin}{part}": 0 for origin in ORIGINS for part in ("", "_trained")}
    for row in query("SELECT origin, COUNT(*) AS n, COUNT(trained_step) AS trained FROM groups GROUP BY origin"):
        out[f"groups_{row['origin']}"] = row["n"]
        out[f"groups_{row['origin']}_trained"] = row["trained"]
    stale = "SELECT COUNT(*) AS n FROM sessions WHERE group_id IS NULL AND untrained_reason LIKE ?"
    out["sessions_stale"] = query(stale, ("stale%",))[0]["n"]
    return out
