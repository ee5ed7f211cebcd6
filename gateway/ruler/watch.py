"""This gateway's heartbeat in the store, and the judgements of gateways that stopped beating.

Every `HEARTBEAT_S` the gateway says it runs for `LEASE_S` more (`Store.beat_gateway`) and hands
on the judgements of any gateway whose lease ran out (`Store.reap_gateways`): a gateway killed
(SIGKILL, out of memory, its machine gone) or one that stopped cleanly but could not mark what
it left. Those groups are marked as a clean stop marks them (RULER's STOPPED): a client's
judgement says to POST it again, and a shadow group is taken up by a gateway with shadow samples
(`ShadowSampler`), a replica already running or the next one to start, once. The store's side,
and why it is exactly once: `gateway.store.gateways`.

The lease is long beside the heartbeat (six missed in a row), so a gateway whose store stalled
for a moment (a busy SQLite file, a PostgreSQL failover) is not taken for gone. Replicas'
clocks do not matter: the rows are written and compared in the store's (`gateway.store.clock`).
A gateway that could not write its heartbeat for a whole lease is taken for gone: a judgement it
still finishes afterwards is recorded too, after the one that took its group up.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.ruler.scoring import STOPPED
from gateway.store import Store
from gateway.tasks import stop_task

log = logging.getLogger("rlproxy.ruler")

HEARTBEAT_S = 10.0
LEASE_S = 60.0


def stopped(group_id: str) -> str:
    """RULER's words for a judgement a gateway's stop cut short."""
    return STOPPED.format(group_id=group_id)


class JudgementWatch:
    def __init__(self, store: Store, gateway_id: str):
        self.store = store
        self.gateway_id = gateway_id
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Beat (and reap) now, then every `HEARTBEAT_S` in the background."""
        await self.tick()
        self._task = asyncio.get_running_loop().create_task(self._beat())

    async def stop(self) -> None:
        """The gateway stops (after its judgements were cancelled and marked): its row goes, and
        whatever it could not mark is handed on now, not a lease later."""
        await stop_task(self._task)
        self._task = None
        try:
            await self.store.leave_gateway(self.gateway_id, stopped)
        except Exception as exc:  # the store away: its row expires, and the others reap it then
            log.warning("this gateway's heartbeat row was not removed (%s): it expires in %.0f s", exc, LEASE_S)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            await self.tick()

    async def tick(self) -> None:
        try:
            await self.store.beat_gateway(self.gateway_id, LEASE_S)
            marked = await self.store.reap_gateways(stopped)
        except Exception as exc:  # a store away for a moment: the next beat tries again
            log.warning("the gateway's heartbeat was not recorded: %s", exc)
            return
        if marked:
            log.info(
                "%d judgement(s) of a gateway that stopped beating handed on: %s", len(marked), ", ".join(marked[:10])
            )
