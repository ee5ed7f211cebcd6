"""A shadow group's rows (gateway/shadow/) and what a discard of the live session does to them.

A shadow group is named after the live call it shadows (`shadow_group_id`) and holds a copy of
the live answer (`rows.shadow_call_id` index 0) and the K shadow samples of its prompt, each in a
session of its own. They are the client's session's data under other session ids: when the
client discards its session (a failed rollout, a conversation not to learn from), its shadow
groups are discarded with it, so the copy of the discarded answer never trains. A shadow group
a step already trained is left as it is (history); one recorded after the discard is not
recorded at all. A shadow group its judge could not score (`give_up_shadow_group`) is set aside as
failed: nothing else would ever reward it, and it would stay pending for ever.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from typing import Any

from gateway.store.locks import for_update, lock_group
from gateway.store.rows import CallRecord, insert_call
from gateway.store.writer import Op

SHADOW_GROUP_PREFIX = "shadow-"


def shadow_group_id(live_call_id: str) -> str:
    """The shadow group of live call `live_call_id`."""
    return SHADOW_GROUP_PREFIX + live_call_id


def insert_shadow_group(
    conn: sqlite3.Connection, calls: list[CallRecord], origin: str, owner: str | None = None
) -> str | None:
    """Record calls that share a group id, each the one call of its own session (a live turn
    and its shadow samples), and mark the group's origin, task key and the gateway that will
    judge it (`owner`: `gateway.store.gateways`). None, recording nothing, when the live call's
    session was discarded while its shadows were sampled."""
    # The live session's row, locked (PostgreSQL): a discard racing this either commits first
    # (seen here) or waits for this commit and then finds the group (`discard.discard_session`).
    session = conn.execute("SELECT session_id FROM calls WHERE id = ?", (calls[0].shadow_of,)).fetchone()
    if session is not None:
        live = conn.execute("SELECT discarded FROM sessions WHERE id = ?" + for_update(conn), (session[0],)).fetchone()
        if live is None or live[0]:  # None: forgotten while this waited for its lock (`rlproxy forget`)
            return None
    group_id = calls[0].group_id
    for call in calls:
        insert_call(conn, call)
    conn.execute(
        "UPDATE groups SET origin = ?, task_key = ?, judged_by = ? WHERE id = ?",
        (origin, calls[0].task_key, owner, group_id),
    )
    return str(group_id)


def shadow_groups_of(conn: sqlite3.Connection, session_id: str) -> list[str]:
    """The shadow groups of the session's calls (by their names: the groups' primary key)."""
    found = conn.execute(
        "SELECT id FROM groups WHERE id IN (SELECT ? || id FROM calls WHERE session_id = ?) AND origin = 'shadow'",
        (SHADOW_GROUP_PREFIX, session_id),
    ).fetchall()
    return sorted(row[0] for row in found)


def discard_shadow_group(conn: sqlite3.Connection, group_id: str, session_id: str, now: float) -> None:
    """Discard the sessions of a shadow group whose live session `session_id` was discarded
    (the caller holds the group's lock and saw it untrained)."""
    conn.execute(
        "UPDATE sessions SET discarded = 1, discard_reason = ?, updated_at = ? WHERE group_id = ? AND discarded = 0",
        (f"the live session '{session_id}' this group shadows was discarded", now, group_id),
    )


def give_up_shadow_group(conn: sqlite3.Connection, group_id: str, reason: str, now: float) -> bool:
    """Set aside as failed a shadow group whose judgement failed for good (the sampler's last
    try): no one else rewards a shadow group, so it would stay pending for ever. Only while its
    judgement is still the failed one and no step claimed, trained or set it aside (a manual
    POST /v1/groups/{id}/ruler that scored it meanwhile wins); False when it was not."""
    lock_group(conn, group_id)
    cursor = conn.execute(
        "UPDATE groups SET failed = ?, judged_by = NULL, updated_at = ?"
        " WHERE id = ? AND origin = 'shadow' AND ruler_status = 'failed'"
        " AND trained_step IS NULL AND claimed_step IS NULL AND failed IS NULL AND skipped IS NULL",
        (reason, now, group_id),
    )
    return bool(cursor.rowcount)


_UNJUDGED = "origin = 'shadow' AND trained_step IS NULL AND claimed_step IS NULL AND failed IS NULL AND skipped IS NULL"


def stop_shadow_judgement(conn: sqlite3.Connection, group_id: str, stopped: str, now: float) -> None:
    """The gateway stops before the sampler judged the group (its judgement not started yet, under
    way, or waiting to be tried again): mark it stopped (`stopped`, RULER's own words for a judgement a
    shutdown cut short), which `claim_stopped_shadow_group` takes up on another gateway, or on
    this one after a restart: it no longer waits on this gateway. A group scored or set aside
    meanwhile, or not recorded at all, is left as it is."""
    conn.execute(
        "UPDATE groups SET ruler_status = 'failed', ruler_error = ?, judged_by = NULL, updated_at = ?"
        f" WHERE id = ? AND {_UNJUDGED} AND (ruler_status IS NULL OR ruler_status IN ('running', 'failed'))",
        (stopped, now, group_id),
    )


def claim_stopped_shadow_group(
    conn: sqlite3.Connection, stopped: Callable[[str], str], now: float, owner: str | None = None
) -> str | None:
    """A shadow group whose judgement a gateway's stop cut short (`ruler_error` is
    `stopped(group_id)`: its shutdown, or its heartbeat expired, `gateways.reap`), for gateway
    `owner` to judge; None when there is none. The UPDATE re-checks that mark under the row's
    lock, so of two gateways on one PostgreSQL store only one takes a group; one a client judged
    meanwhile is not taken. It leaves the group not judged
    (status null): the judgement marks it running itself, and a judgement refused before it
    starts (its sessions all discarded meanwhile) must not leave a "running" that nothing runs."""
    found = conn.execute(
        f"SELECT id, ruler_error FROM groups WHERE {_UNJUDGED} AND ruler_status = 'failed' ORDER BY created_at, id"
    ).fetchall()
    for group_id, error in found:
        if error != stopped(group_id):
            continue  # its judge failed (its sampler gave up, or tries again): not for a restart to take
        cursor = conn.execute(
            "UPDATE groups SET ruler_status = NULL, ruler_error = NULL, judged_by = ?, updated_at = ?"
            f" WHERE id = ? AND {_UNJUDGED} AND ruler_status = 'failed' AND ruler_error = ?",
            (owner, now, group_id, error),
        )
        if cursor.rowcount:
            return str(group_id)
    return None


class ShadowRows:
    """The shadow groups' part of `Store` (a mixin: the class stays within its size limit)."""

    async def _submit(self, op: Op, *, at_once: bool = False) -> Any:  # implemented by `Store`
        raise NotImplementedError

    async def record_shadow_group(
        self, calls: list[CallRecord], origin: str = "shadow", owner: str | None = None
    ) -> str | None:
        """One group of calls, each its own session (a live turn and its shadow samples), in one
        transaction, to be judged by gateway `owner`; None, recording nothing, when the live
        session was discarded meanwhile."""
        return await self._submit(lambda conn: insert_shadow_group(conn, calls, origin, owner))

    async def give_up_shadow_group(self, group_id: str, reason: str) -> bool:
        """Set aside as failed a shadow group its judge could not score (`give_up_shadow_group`)."""
        return await self._submit(lambda conn: give_up_shadow_group(conn, group_id, reason, time.time()))

    async def stop_shadow_judgement(self, group_id: str, stopped: str) -> None:
        """Mark a shadow group not judged yet as cut short by the shutdown (`stop_shadow_judgement`)."""
        await self._submit(lambda conn: stop_shadow_judgement(conn, group_id, stopped, time.time()))

    async def claim_stopped_shadow_group(self, stopped: Callable[[str], str], owner: str | None = None) -> str | None:
        """Take up, for gateway `owner`, a shadow group a stop left unjudged (`claim_stopped_shadow_group`)."""
        return await self._submit(lambda conn: claim_stopped_shadow_group(conn, stopped, time.time(), owner))
