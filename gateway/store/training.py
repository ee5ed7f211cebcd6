"""The writes of the trainer's side, as ops on a connection in an open transaction: step
rows, groups set aside, asks for a step, RULER's judgements and the GPU lease. Portable SQL:
both backends run them unchanged (`Store` hands them to its backend's transaction)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

from gateway.errors import Conflict, NotFound
from gateway.store.rows import require_group


def record_judgement(conn: Any, group_id: str, judge_model: str, scores: list[dict], close: bool) -> None:
    require_group(conn, group_id)
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
        "UPDATE groups SET ruler_status = 'scored', ruler_error = NULL,"
        " closed = CASE WHEN ? = 1 THEN 1 ELSE closed END, updated_at = ?"  # portable SQL
        " WHERE id = ?",
        (1 if close else 0, now, group_id),
    )


def set_ruler_status(conn: Any, group_id: str, status: str, error: str | None) -> None:
    require_group(conn, group_id)
    conn.execute(
        "UPDATE groups SET ruler_status = ?, ruler_error = ?, updated_at = ? WHERE id = ?",
        (status, error, time.time(), group_id),
    )


def request_trigger(conn: Any, model: str) -> int:
    cursor = conn.execute("INSERT INTO triggers (model, created_at) VALUES (?, ?)", (model, time.time()))
    return int(cursor.lastrowid)


def consume_triggers(conn: Any, model: str) -> bool:
    cursor = conn.execute(
        "UPDATE triggers SET consumed_at = ? WHERE model = ? AND consumed_at IS NULL", (time.time(), model)
    )
    return cursor.rowcount > 0


def insert_step(
    conn: Any,
    model: str,
    step: int,
    path: str,
    metrics: dict,
    group_ids: list[str],
    session_ids: list[str] | None,
) -> None:
    if session_ids:
        marks = ",".join("?" * len(session_ids))
        gone = conn.execute(f"SELECT id FROM sessions WHERE discarded = 1 AND id IN ({marks})", session_ids).fetchall()
        if gone:
            raise Conflict(
                f"session(s) {', '.join(r[0] for r in gone)} were discarded while step {step} trained on them"
            )
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


def mark_failed(conn: Any, group_ids: Iterable[str], reason: str) -> None:
    for group_id in group_ids:
        conn.execute(
            "UPDATE groups SET failed = ?, updated_at = ? WHERE id = ? AND trained_step IS NULL",
            (reason, time.time(), group_id),
        )


def mark_skipped(conn: Any, group_ids: Iterable[str], reason: str) -> None:
    for group_id in group_ids:
        conn.execute("UPDATE groups SET skipped = ?, updated_at = ? WHERE id = ?", (reason, time.time(), group_id))


def move_gpu_lease(
    conn: Any,
    model: str,
    to_state: str,
    expect: tuple[str, ...],
    holder: str | None,
    expect_holder: str | None,
    step: int | None,
) -> bool:
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
