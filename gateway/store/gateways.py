"""Each running gateway's heartbeat, and the judgements a gateway that stopped beating left behind.

A RULER judgement runs inside one gateway (`POST /v1/groups/{id}/ruler`, a shadow group's
sampler). A clean stop marks the ones it cuts short (RULER's STOPPED: the client is told to POST
again, a shadow group is taken up by a gateway with shadow samples); a gateway killed (SIGKILL,
out of memory, its machine gone) marks nothing, and its groups stayed "running" (or, shadow
groups, pending) for ever. So every gateway writes a row in `gateways` every few seconds (`beat`:
until when it counts as running), and names itself in each group whose judgement waits on it
(`groups.judged_by`: a judgement running there, or a shadow group its sampler has still to
judge). A row that expired is a gateway gone: `reap`, which every gateway runs, deletes it and
marks that gateway's unfinished judgements as its clean stop would have, in one transaction.
The row's DELETE is the claim: of two gateways reaping at once (replicas on one PostgreSQL
store) the second finds the row gone and marks nothing, so a group is handed on once.
Rows are written and compared in the store's clock (`gateway.store.clock`), never in each
host's: replicas whose clocks disagree by more than a lease still agree on who is gone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.store import training
from gateway.store.clock import store_now
from gateway.store.writer import Op

# A judgement that waits on its gateway: one running there (any group), or a shadow group not
# judged yet (recorded, or its judge failed and the sampler tries again), which nothing but its
# sampler would ever reward.
_UNFINISHED = (
    "(ruler_status = 'running' OR (origin = 'shadow' AND trained_step IS NULL AND claimed_step IS NULL"
    " AND failed IS NULL AND skipped IS NULL AND (ruler_status IS NULL OR ruler_status = 'failed')))"
)


UPGRADE = "before-upgrade"
"""The gateway named in the unfinished judgements of a store from before `judged_by` (`adopt_unnamed`)."""
UPGRADE_WAIT_S = 1800.0


def adopt_unnamed(conn: Any) -> None:
    """Run once, as the migration adds `groups.judged_by`: the store's unfinished judgements name
    no gateway, so no heartbeat would ever hand them on, and those a gateway killed before the
    upgrade left would stay "running" for ever. They are named after one gateway, `UPGRADE`, whose
    row expires in `UPGRADE_WAIT_S`: longer than a judgement an older replica may still be running
    during a rolling upgrade (a judge call has ten minutes, a wrong answer one more try)."""
    cursor = conn.execute(f"UPDATE groups SET judged_by = ? WHERE judged_by IS NULL AND {_UNFINISHED}", (UPGRADE,))
    if cursor.rowcount:
        beat(conn, UPGRADE, UPGRADE_WAIT_S)


def beat(conn: Any, gateway_id: str, lease_s: float) -> None:
    """Gateway `gateway_id` is running, and counts as running for `lease_s` more (the store's clock)."""
    now = store_now(conn)
    conn.execute(
        "INSERT INTO gateways (id, started_at, expires_at) VALUES (?, ?, ?)"
        " ON CONFLICT (id) DO UPDATE SET expires_at = excluded.expires_at",
        (gateway_id, now, now + lease_s),
    )


def reap(conn: Any, stopped: Callable[[str], str], gateway_id: str | None = None) -> list[str]:
    """Delete the rows of the gateways whose heartbeat expired (or `gateway_id`'s own row: its
    clean stop) and mark their unfinished judgements stopped (`stopped(group_id)`, RULER's
    words), each no longer waiting on anyone. The groups marked, in order."""
    now = store_now(conn)  # the clock the rows were written in (`beat`)
    if gateway_id is not None:
        conn.execute("DELETE FROM gateways WHERE id = ?", (gateway_id,))
        gone = [gateway_id]
    else:
        expired = conn.execute("SELECT id FROM gateways WHERE expires_at < ? ORDER BY id", (now,)).fetchall()
        gone = [
            row[0]
            for row in expired  # another gateway that reaped it first (or it beat again meanwhile): not ours
            if conn.execute("DELETE FROM gateways WHERE id = ? AND expires_at < ?", (row[0], now)).rowcount
        ]
    marked: list[str] = []
    for gateway in gone:
        found = conn.execute(f"SELECT id FROM groups WHERE judged_by = ? AND {_UNFINISHED} ORDER BY id", (gateway,))
        for (group_id,) in found.fetchall():
            # Re-checked in the UPDATE: a judgement another gateway started meanwhile names that one.
            cursor = conn.execute(
                "UPDATE groups SET ruler_status = 'failed', ruler_error = ?, judged_by = NULL, updated_at = ?"
                f" WHERE id = ? AND judged_by = ? AND {_UNFINISHED}",
                (stopped(group_id), now, group_id, gateway),
            )
            if cursor.rowcount:
                marked.append(str(group_id))
    return marked


class GatewayRows:
    """The heartbeat's part of `Store`, and a judgement's status naming its gateway (a mixin: the
    class stays within its size limit)."""

    async def _submit(self, op: Op, *, at_once: bool = False) -> Any:  # implemented by `Store`
        raise NotImplementedError

    async def beat_gateway(self, gateway_id: str, lease_s: float) -> None:
        """Gateway `gateway_id` runs for `lease_s` more seconds (`beat`)."""
        await self._submit(lambda conn: beat(conn, gateway_id, lease_s))

    async def reap_gateways(self, stopped: Callable[[str], str]) -> list[str]:
        """Hand on the judgements of the gateways that stopped beating (`reap`); the groups marked."""
        return await self._submit(lambda conn: reap(conn, stopped))

    async def leave_gateway(self, gateway_id: str, stopped: Callable[[str], str]) -> list[str]:
        """Gateway `gateway_id` stops: its row goes, and what it left unjudged is handed on (`reap`)."""
        return await self._submit(lambda conn: reap(conn, stopped, gateway_id))

    async def set_ruler_status(
        self, group_id: str, status: str, error: str | None = None, owner: str | None = None
    ) -> None:
        """`owner`: the gateway a running judgement runs in (`training.set_ruler_status`)."""
        await self._submit(lambda conn: training.set_ruler_status(conn, group_id, status, error, owner))
