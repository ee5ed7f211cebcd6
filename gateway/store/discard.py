"""Discarding a session (`POST /v1/sessions/{id}/discard`): a failed rollout, or a conversation
not to learn from, is left out of training; its calls are kept.

The discard reaches the session's shadow groups too (gateway/store/shadows.py): they hold a copy
of its answer and samples of its prompt under other session ids, and would train them otherwise.
"""

from __future__ import annotations

import sqlite3
import time

from gateway.errors import Conflict, NotFound
from gateway.store.locks import lock_group
from gateway.store.shadows import discard_shadow_group, shadow_groups_of


def discard_session(conn: sqlite3.Connection, session_id: str, reason: str | None) -> None:
    row = conn.execute("SELECT group_id FROM sessions WHERE id = ?", (session_id,)).fetchone()
    if row is None:
        raise NotFound(
            f"session '{session_id}' not found: a session exists once it made a chat completion "
            "(a rollout that failed before its first call has nothing to discard)",
            param="session_id",
        )
    # Under the groups' locks, taken by id (gateway/store/locks.py): a step recording one commits
    # first (409 here for the session's own group) or sees the discard.
    group_id = row[0]
    shadows = shadow_groups_of(conn, session_id)
    states = {gid: lock_group(conn, gid) for gid in sorted({*shadows, *([group_id] if group_id else [])})}
    own = states.get(group_id) if group_id is not None else None
    trained_step = own[0] if own is not None else None
    if trained_step is not None:
        raise Conflict(
            f"session '{session_id}' cannot be discarded: its group '{group_id}' was already trained "
            f"(step {trained_step})",
            param="session_id",
        )
    now = time.time()
    # A second discard keeps the first reason unless it gives one.
    conn.execute(
        "UPDATE sessions SET discarded = 1, discard_reason = COALESCE(?, discard_reason), updated_at = ? WHERE id = ?",
        (reason, now, session_id),
    )
    # Listed again: one recorded while this waited for the session's row (PostgreSQL) is seen now.
    for shadow in shadow_groups_of(conn, session_id):
        state = states[shadow] if shadow in states else lock_group(conn, shadow)
        if state is not None and state[0] is None:  # a shadow group already trained is history
            discard_shadow_group(conn, shadow, session_id, now)
