"""The writes of the trainer's side, as ops on a connection in an open transaction: step
rows, groups set aside, asks for a step, RULER's judgements and the GPU lease. Portable SQL:
both backends run them unchanged (`Store` hands them to its backend's transaction). Each
locks the groups it decides on first, in id order (`gateway.store.locks`)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

from gateway.errors import Conflict, NotFound
from gateway.store.frozen import frozen_group_reason
from gateway.store.locks import lock_group
from gateway.store.rows import require_group


def record_judgement(conn: Any, group_id: str, judge_model: str, scores: list[dict], close: bool) -> None:
    state = lock_group(conn, group_id)
    if state is None:
        require_group(conn, group_id)  # raises NotFound
        return
    frozen = frozen_group_reason(group_id, *state)
    if frozen is not None:  # the judge took long, and the trainer took the group meanwhile
        raise Conflict(f"RULER's scores were not stored: {frozen}", param="group_id")
    now = time.time()
    for item in scores:
        session_id, score = item["trajectory_id"], float(item["score"])
        row = conn.execute("SELECT reward, metrics FROM sessions WHERE id = ?", (session_id,)).fetchone()
        if row is None:
            raise NotFound(f"session '{session_id}' not found")
        metrics = json.loads(row[1] or "{}")
        # The reward a client posted, kept beside the judge's; a reward that is the score an
        # earlier judgement stored is not one (judging a group again left that judge's score
        # as the 'independent' reward). One posted after an earlier judgement is the client's
        # latest word: it replaces the one that judgement kept.
        posted = row[0] is not None and row[0] != metrics.get("ruler_score")
        if posted:
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
        "UPDATE groups SET ruler_status = 'scored', ruler_error = NULL, judged_by = NULL,"
        " closed = CASE WHEN ? = 1 THEN 1 ELSE closed END, updated_at = ?"  # portable SQL
        " WHERE id = ?",
        (1 if close else 0, now, group_id),
    )


def set_ruler_status(conn: Any, group_id: str, status: str, error: str | None, owner: str | None = None) -> None:
    """A judgement's state. A running one names the gateway it runs in (`owner`), so that it is
    handed on if that gateway dies (`gateway.store.gateways`); one that ended waits on none,
    except a shadow group's, which its sampler judges again (until it gives the group up)."""
    require_group(conn, group_id)
    conn.execute(
        "UPDATE groups SET ruler_status = ?, ruler_error = ?, updated_at = ?,"
        " judged_by = CASE WHEN ? = 'running' THEN ? WHEN origin = 'shadow' THEN judged_by ELSE NULL END"
        " WHERE id = ?",
        (status, error, time.time(), status, owner, group_id),
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
    advantages: dict[str, float] | None = None,
    left_out: dict[str, str] | None = None,
    rewards: dict[str, float] | None = None,
    claimed: bool = False,
) -> None:
    """`rewards`: session id -> the reward it trained with, recorded as `trained_reward` (absent:
    the stored one, which the claim froze). `claimed`: each group must still be claimed by `step`
    (a trainer's step): a claim given back meanwhile (`gateway.store.trainer_lock`: its trainer was
    taken for gone) let rewards change after the step read them, so the step records none of it."""
    for group_id in sorted(group_ids):  # locked first: a discard commits before (Conflict below) or waits
        cursor = conn.execute(
            "UPDATE groups SET trained_step = ?, claimed_step = NULL, updated_at = ?"
            " WHERE id = ? AND trained_step IS NULL AND (? = 0 OR claimed_step = ?)",
            (step, time.time(), group_id, 1 if claimed else 0, step),
        )
        if cursor.rowcount == 1:
            continue
        if claimed and conn.execute("SELECT trained_step FROM groups WHERE id = ?", (group_id,)).fetchone() == (None,):
            raise Conflict(
                f"group '{group_id}' is no longer claimed by step {step}: its claim was given back (the trainer "
                "was taken for gone: its lock in the store was free), so its rewards may have changed; it trains again"
            )
        raise Conflict(f"group '{group_id}' is unknown or already trained")
    if session_ids:
        marks = ",".join("?" * len(session_ids))
        gone = conn.execute(f"SELECT id FROM sessions WHERE discarded = 1 AND id IN ({marks})", session_ids).fetchall()
        if gone:
            raise Conflict(
                f"session(s) {', '.join(r[0] for r in gone)} were discarded while step {step} trained on them"
            )
    # A step number recorded already (a racing trainer's; an orphan checkpoint recorded meanwhile) is the
    # project's Conflict on both backends: its primary key's violation was each driver's own error, which
    # callers that catch Conflict (`record_orphan`, the step's record) let through on PostgreSQL.
    inserted = conn.execute(
        "INSERT INTO steps (model, step, path, metrics, groups, created_at) VALUES (?, ?, ?, ?, ?, ?)"
        " ON CONFLICT (model, step) DO NOTHING",
        (model, step, path, json.dumps(metrics), json.dumps(group_ids), time.time()),
    )
    if inserted.rowcount != 1:
        raise Conflict(f"step {step} of model '{model}' is recorded already")
    for session_id, advantage in sorted((advantages or {}).items()):
        conn.execute(
            "UPDATE sessions SET advantage = ?, trained_reward = COALESCE(?, reward), untrained_reason = NULL"
            " WHERE id = ?",
            (advantage, (rewards or {}).get(session_id), session_id),
        )
    set_untrained_reasons(conn, left_out or {})


def set_untrained_reasons(conn: Any, reasons: dict[str, str]) -> None:
    """Session id -> why it left its group untrained (no trainable sample)."""
    for session_id, reason in sorted(reasons.items()):
        conn.execute(
            "UPDATE sessions SET advantage = NULL, trained_reward = NULL, untrained_reason = ? WHERE id = ?",
            (reason, session_id),
        )


def claim_for_step(conn: Any, group_ids: Iterable[str], step: int) -> list[str]:
    """Claim groups for step `step`: their rewards and calls are frozen from now on, and one more
    attempt is counted before training starts (so a crash counts too). Returns the ids claimed:
    a group trained or set aside meanwhile is not, nor one no longer ready (a session without a
    reward joined it). Each is decided under its lock, the one a reward takes."""
    claimed = []
    for group_id in sorted(set(group_ids)):
        state = lock_group(conn, group_id)
        if state is None or state[0] is not None or state[2] is not None:
            continue
        waiting = conn.execute(
            "SELECT COUNT(*) FROM sessions WHERE group_id = ? AND discarded = 0 AND reward IS NULL", (group_id,)
        ).fetchone()[0]
        if waiting:
            continue
        conn.execute(
            "UPDATE groups SET claimed_step = ?, attempts = attempts + 1, updated_at = ? WHERE id = ?",
            (step, time.time(), group_id),
        )
        claimed.append(group_id)
    return claimed


def release_step(conn: Any, group_ids: Iterable[str], error: str | None) -> None:
    """Give groups back after a step that did not record them. `error`: the step failed (the
    attempt stays counted, the reason is kept); None: it was not their fault (a discard took
    the step back, the engine or the store was away), so the attempt is not counted."""
    for group_id in sorted(group_ids):
        if error is None:
            conn.execute(
                "UPDATE groups SET claimed_step = NULL, attempts = CASE WHEN attempts > 0 THEN attempts - 1"
                " ELSE 0 END, updated_at = ? WHERE id = ? AND trained_step IS NULL",
                (time.time(), group_id),
            )
        else:
            conn.execute(
                "UPDATE groups SET claimed_step = NULL, last_error = ?, updated_at = ?"
                " WHERE id = ? AND trained_step IS NULL",
                (error, time.time(), group_id),
            )


def release_model_claims(conn: Any, model: str) -> int:
    """Give back the claims a trainer of `model` left when it died (its attempts stay counted)."""
    cursor = conn.execute(
        "UPDATE groups SET claimed_step = NULL, updated_at = ?"
        " WHERE model = ? AND claimed_step IS NOT NULL AND trained_step IS NULL",
        (time.time(), model),
    )
    return int(cursor.rowcount or 0)


def mark_failed(conn: Any, group_ids: Iterable[str], reason: str) -> None:
    for group_id in sorted(group_ids):
        conn.execute(
            "UPDATE groups SET failed = ?, updated_at = ? WHERE id = ? AND trained_step IS NULL",
            (reason, time.time(), group_id),
        )


def mark_skipped(conn: Any, group_ids: Iterable[str], reason: str, left_out: dict[str, str]) -> None:
    for group_id in sorted(group_ids):
        conn.execute("UPDATE groups SET skipped = ?, updated_at = ? WHERE id = ?", (reason, time.time(), group_id))
    set_untrained_reasons(conn, left_out)


def skip_if_unchanged(conn: Any, groups: list[dict], reason: str) -> list[str]:
    """Set aside those of `groups` (`Store.get_group` dicts, as a screen read them) whose
    sessions and rewards are still as read, each decided under its lock; returns their ids. A
    group whose rewards changed since the read is left as it is: the next screen sees them."""
    skipped = []
    for group in sorted(groups, key=lambda g: g["id"]):
        state = lock_group(conn, group["id"])
        if state is None or any(value is not None for value in state):
            continue  # claimed, trained or set aside meanwhile: not the screen's to decide
        now = conn.execute(
            "SELECT id, reward FROM sessions WHERE group_id = ? AND discarded = 0", (group["id"],)
        ).fetchall()
        if sorted((r[0], r[1]) for r in now) != sorted((s["id"], s["reward"]) for s in group["sessions"]):
            continue
        conn.execute("UPDATE groups SET skipped = ?, updated_at = ? WHERE id = ?", (reason, time.time(), group["id"]))
        skipped.append(group["id"])
    return skipped


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
