"""Paged, filtered lists of sessions and groups, and the reward curve per step.

Read-only queries for the dashboard and `GET /v1/sessions`, `GET /v1/groups`. Paging is
keyset paging on `(created_at, id)`, newest first: a page costs the same with 10 rows or
a million behind it (no OFFSET scan), and rows that arrive meanwhile do not shift it.
Each function takes `query(sql, params) -> list[dict]` (the store's read connection), so
the SQL stays next to the filters it serves.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from gateway.errors import InvalidRequest
from gateway.store.reads import ORIGINS
from gateway.store.rows import SHADOW_CALL_INFIX

Query = Callable[[str, tuple], list[dict]]
MAX_LIMIT = 500
MAX_CURSOR_CHARS = 1024  # a cursor is a time and an id (of 128 characters at most): well under this


@dataclass(frozen=True)
class ListFilter:
    """What `GET /v1/sessions` and `GET /v1/groups` accept (all optional)."""

    limit: int = 50
    cursor: str | None = None  # `next_cursor` of the previous page
    split: str | None = None  # train | val
    group_id: str | None = None  # sessions only
    min_reward: float | None = None  # sessions: reward; groups: mean reward of its sessions
    max_reward: float | None = None
    since: float | None = None  # unix seconds, created at or after
    until: float | None = None  # unix seconds, created before
    state: str | None = None  # groups: trained | skipped | failed | pending
    origin: str | None = None  # groups: harness | live | shadow (how the group was formed)


def encode_cursor(created_at: float, row_id: str) -> str:
    return base64.urlsafe_b64encode(json.dumps([created_at, row_id]).encode()).decode()


def decode_cursor(cursor: str) -> tuple[float, str]:
    """`(created_at, id)` from a `next_cursor`; anything else a client sends is a 400, never a 500
    (nested brackets, numbers past a float, the wrong shape, a NUL that PostgreSQL refuses)."""
    try:
        if len(cursor) > MAX_CURSOR_CHARS:
            raise ValueError("too long")
        created_at, row_id = json.loads(base64.urlsafe_b64decode(cursor.encode()))
        if isinstance(created_at, bool) or not isinstance(created_at, (int, float)) or not isinstance(row_id, str):
            raise TypeError("not [number, id]")
        created_at = float(created_at)  # OverflowError for an integer past a float
        if not math.isfinite(created_at) or "\x00" in row_id:
            raise ValueError("not a time and an id")
        return created_at, row_id
    except (ValueError, TypeError, ArithmeticError, RecursionError):
        raise InvalidRequest(
            "cursor is not one this gateway returned: pass `next_cursor` from the previous page", param="cursor"
        ) from None


def check_filter(f: ListFilter) -> None:
    if not 1 <= f.limit <= MAX_LIMIT:
        raise InvalidRequest(f"limit must be between 1 and {MAX_LIMIT}", param="limit")
    if f.split not in (None, "train", "val"):
        raise InvalidRequest("split must be 'train' or 'val'", param="split")
    if f.state not in (None, "trained", "skipped", "failed", "pending"):
        raise InvalidRequest("state must be 'trained', 'skipped', 'failed' or 'pending'", param="state")
    if f.origin not in (None, *ORIGINS):
        raise InvalidRequest("origin must be 'harness', 'live' or 'shadow'", param="origin")
    for name in ("min_reward", "max_reward", "since", "until"):
        value = getattr(f, name)
        if value is not None and not math.isfinite(value):
            raise InvalidRequest(f"{name} must be a finite number", param=name)


def _page(rows: list[dict], limit: int) -> dict:
    more = len(rows) > limit
    rows = rows[:limit]
    cursor = encode_cursor(rows[-1]["created_at"], rows[-1]["id"]) if more and rows else None
    return {"object": "list", "data": rows, "has_more": more, "next_cursor": cursor}


def _common(f: ListFilter, alias: str, where: list[str], params: list) -> None:
    if f.split is not None:
        where.append(f"{alias}.split = ?")
        params.append(f.split)
    if f.since is not None:
        where.append(f"{alias}.created_at >= ?")
        params.append(f.since)
    if f.until is not None:
        where.append(f"{alias}.created_at < ?")
        params.append(f.until)
    if f.cursor is not None:
        created_at, row_id = decode_cursor(f.cursor)
        where.append(f"({alias}.created_at < ? OR ({alias}.created_at = ? AND {alias}.id < ?))")
        params += [created_at, created_at, row_id]


# The step that sampled a session: its first call's adapter step (the base model counts as 0),
# as `trainer.data.sampling_step` and the demo's curve count it.
_SESSION_STEP = "(SELECT COALESCE(MIN(COALESCE(c.step, 0)), 0) FROM calls c WHERE c.session_id = s.id)"


def list_sessions(query: Query, f: ListFilter) -> dict:
    check_filter(f)
    where: list[str] = ["1 = 1"]
    params: list = []
    _common(f, "s", where, params)
    if f.group_id is not None:
        where.append("s.group_id = ?")
        params.append(f.group_id)
    if f.min_reward is not None:
        where.append("s.reward >= ?")
        params.append(f.min_reward)
    if f.max_reward is not None:
        where.append("s.reward <= ?")
        params.append(f.max_reward)
    rows = query(
        f"SELECT s.*, {_SESSION_STEP} AS step FROM sessions s WHERE {' AND '.join(where)}"
        " ORDER BY s.created_at DESC, s.id DESC LIMIT ?",
        (*params, f.limit + 1),
    )
    for row in rows:
        row["metrics"] = json.loads(row["metrics"] or "{}")
        row["discarded"] = bool(row["discarded"])
    return _page(rows, f.limit)


def list_groups(query: Query, f: ListFilter) -> dict:
    check_filter(f)
    where: list[str] = ["1 = 1"]
    params: list = []
    _common(f, "g", where, params)
    if f.state == "trained":
        where.append("g.trained_step IS NOT NULL")
    elif f.state == "skipped":
        where.append("g.skipped IS NOT NULL")
    elif f.state == "failed":  # set aside: the trainer's tries ran out, or a shadow group's judge's
        where.append("g.failed IS NOT NULL AND g.trained_step IS NULL")
    elif f.state == "pending":  # may still train: a failed group never will
        where.append("g.trained_step IS NULL AND g.skipped IS NULL AND g.failed IS NULL")
    if f.origin is not None:
        where.append("g.origin = ?")
        params.append(f.origin)
    having = []
    if f.min_reward is not None:
        having.append("reward_mean >= ?")
    if f.max_reward is not None:
        having.append("reward_mean <= ?")
    # The sessions' aggregate per group: a correlated subquery per row of the page only, so
    # a page costs `limit` index lookups however many groups there are. With a reward filter
    # the filter has to see every candidate, which is the price of filtering on an aggregate.
    sql = (
        "SELECT * FROM (SELECT g.*,"
        " (SELECT COUNT(*) FROM sessions s WHERE s.group_id = g.id AND s.discarded = 0) AS n_sessions,"
        " (SELECT COUNT(s.reward) FROM sessions s WHERE s.group_id = g.id AND s.discarded = 0) AS n_rewarded,"
        " (SELECT AVG(s.reward) FROM sessions s WHERE s.group_id = g.id AND s.discarded = 0) AS reward_mean,"
        " (SELECT MIN(s.reward) FROM sessions s WHERE s.group_id = g.id AND s.discarded = 0) AS reward_min,"
        " (SELECT MAX(s.reward) FROM sessions s WHERE s.group_id = g.id AND s.discarded = 0) AS reward_max"
        f" FROM groups g WHERE {' AND '.join(where)} ORDER BY g.created_at DESC, g.id DESC)"
    )
    hparams = [v for v in (f.min_reward, f.max_reward) if v is not None]
    if having:
        sql += " WHERE " + " AND ".join(having)
    rows = query(sql + " LIMIT ?", (*params, *hparams, f.limit + 1))
    for row in rows:
        row["closed"] = bool(row["closed"])
    return _page(rows, f.limit)


def reward_curve(query: Query, model: str) -> list[dict]:
    """Reward of the rollouts each step sampled, per split: mean, std, min, max, count.

    A session counts for the step that answered its first call, so the curve reads "how
    good was the policy at step N" for train and val alike (the trainer's own
    `reward_mean` is that of the groups a step trained on, sampled one step earlier). Shadow
    groups' sessions are left out: their rewards are a judge's ranks within one turn, not
    rewards on the task's scale."""
    rows = query(
        "SELECT split, step, COUNT(*) AS n, AVG(reward) AS mean, AVG(reward * reward) AS mean_sq,"
        " MIN(reward) AS min, MAX(reward) AS max FROM"
        f" (SELECT s.split, s.reward, {_SESSION_STEP} AS step FROM sessions s"
        "  WHERE s.model = ? AND s.reward IS NOT NULL AND s.discarded = 0 AND s.shadow_of IS NULL)"
        " GROUP BY split, step ORDER BY step, split",
        (model,),
    )
    for row in rows:
        row["std"] = math.sqrt(max(row.pop("mean_sq") - row["mean"] ** 2, 0.0))
    return rows


def reward_changes(query: Query, model: str, since: float | None) -> list[dict]:
    """`model`'s sessions written at or after `since` (None: those `reward_curve` counts), each
    with its updated_at and what `reward_curve` takes from it: {id, split, step, reward,
    updated_at, counted}; step and reward only where it counts (rewarded, kept, not a shadow's).
    `RewardHistory` keeps the curve between dashboard polls with these."""
    counted = "s.reward IS NOT NULL AND s.discarded = 0 AND s.shadow_of IS NULL"
    where, params = ("s.updated_at >= ?", (model, since)) if since is not None else (counted, (model,))
    rows = query(
        f"SELECT s.id, s.split, s.reward, s.updated_at, CASE WHEN {counted} THEN 1 ELSE 0 END AS counted,"
        f" CASE WHEN {counted} THEN {_SESSION_STEP} END AS step FROM sessions s WHERE s.model = ? AND {where}",
        params,
    )
    for row in rows:
        row["counted"] = bool(row["counted"])
    return rows


def calls_per_minute(query: Query, now: float, minutes: int = 60) -> list[dict]:
    """Clients' calls per minute over the last `minutes` (oldest first; minutes with none
    included). Shadow groups' rows are not calls a client made: counted, one shadowed call
    showed as K + 2 (`--shadow-samples 7`: nine times the traffic)."""
    start = math.floor(now / 60) * 60 - (minutes - 1) * 60
    # The minute's index, floored in both dialects: CAST(x AS INTEGER) truncates in SQLite but
    # rounds in PostgreSQL (59.9 s into a minute counted in the next), so a cast above x is
    # taken one down (x >= 0 here, where truncating is flooring).
    rows = query(
        "SELECT bucket, COUNT(*) AS n FROM (SELECT CAST(x AS INTEGER) - CASE WHEN CAST(x AS INTEGER) > x"
        " THEN 1 ELSE 0 END AS bucket FROM (SELECT (created_at - ?) / 60 AS x FROM calls WHERE created_at >= ?"
        " AND id NOT LIKE ?) t) b GROUP BY bucket",
        (start, start, f"%{SHADOW_CALL_INFIX}%"),
    )
    counts = {row["bucket"]: row["n"] for row in rows}
    return [{"minute": start + 60 * i, "calls": counts.get(i, 0)} for i in range(minutes)]
