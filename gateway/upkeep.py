"""What a gateway keeps right in the store between requests, every `--poll-interval`, because no
request may come to do it:

- live groups (`--live-group-size`): as the step training goes on from moves, the members of a
  filling group that went stale are set aside with their reason (`Store.set_aside_stale_live`).
  A reward of the same key did that, and only that: a key that got no more traffic kept its group
  open for ever, its members with no reason and uncounted in `sessions_stale`;
- the claims of a trainer that died mid-step (its lock in the store free: SIGKILL, out of memory)
  are given back (`Store.give_back_dead_claims`), once, by the first gateway to see it. Only the
  next trainer's start did that: with `serve --trainer off` and none started again, rewards to
  those groups were refused (409 "is being trained") and their calls marked late, for ever.

Each is idempotent and safe beside other gateways of one PostgreSQL doing the same (each decides
under the locks a reward takes), so replicas need no coordination.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.settings import Settings
from gateway.store import LiveRule, Store
from gateway.store.waits import read_within
from gateway.tasks import stop_task

log = logging.getLogger("rlproxy.store")


class StoreUpkeep:
    def __init__(self, store: Store, settings: Settings) -> None:
        self.store, self.settings = store, settings
        self.model = settings.model_name
        size, staleness = settings.live_group_size, settings.live_max_staleness
        self.live = LiveRule(size, staleness) if size else None
        self._swept_at_step: int | None = -1  # the serving step the last sweep saw (-1: none yet)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Once now (what a gateway down meanwhile left), then every `--poll-interval`."""
        await self.tick()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="rlproxy-store-upkeep")

    async def close(self) -> None:
        await stop_task(self._task)
        self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.poll_interval)
            await self.tick()

    async def tick(self) -> None:
        try:
            await self._sweep_stale()
            released = await asyncio.to_thread(self.store.give_back_dead_claims, self.model)
            if released:
                log.warning(
                    "%d group(s) were claimed by a step whose trainer is gone (it no longer holds its lock): "
                    "given back, they take rewards again and train at the next step",
                    released,
                )
        except Exception as exc:  # a store away for a moment: the next tick tries again
            log.warning("the store's upkeep failed (tried again in %.1f s): %s", self.settings.poll_interval, exc)

    async def _sweep_stale(self) -> None:
        if self.live is None:
            return
        step = await read_within(self.store, self.store.serving_step, self.model)
        if step == self._swept_at_step:  # staleness moves only with the step training goes on from
            return
        left = await asyncio.to_thread(self.store.set_aside_stale_live, self.model, self.live)
        self._swept_at_step = step  # only once done: a failed sweep is tried again
        if left:
            log.info(
                "%d live session(s) went stale in their filling group (step %s serves) and were set aside: %s",
                len(left),
                step,
                ", ".join(left[:10]),
            )
