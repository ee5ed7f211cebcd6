"""Noticing a client that leaves before its non-streamed answer is ready.

Its answer would reach nobody, so the chat service records the call as 499 (`ClientGone`) and
it is never trained; a long generation is also cancelled rather than run to the end for nobody.

Most calls are answered within milliseconds, and a watcher task for each of them took ~12% of
the event loop's GIL time at c=64 in a profile (bench/README.md). So a call gets a watcher task only if it
is still running after `WATCH_AFTER_SECONDS` (a timer until then); a call that ends sooner is
checked once, when its answer is ready and before it is recorded, by `left()`, a look at the
ASGI `receive` that never waits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

from gateway.errors import ClientGone

T = TypeVar("T")

WATCH_AFTER_SECONDS = 1.0
"""How long a call runs before a task watches its client: cancelling a generation this much
later than the client left costs little, and most calls never need the task. A second, not
less: a timer that fires while the gateway waits on vLLM wakes an idle process, and at c=1 on
the vLLM path (16-token replies of 80-250 ms on a CPU vLLM) that wake-up and the task cost
0.2-0.3 ms of CPU a call, of 1.5-2 ms in all (bench/README.md, "The router's own cost")."""


def disconnected_now(receive: Receive) -> bool:
    """Whether the client has left, asked of `receive` without waiting: its coroutine runs up to
    the point where it would wait for the client (nothing more to read: still connected) and is
    closed there. A server answers `http.disconnect` at once once the connection is gone
    (uvicorn, hypercorn, daphne). A stray wake-up (an empty `http.request`) is asked again."""
    for _ in range(4):
        step = receive().__await__()
        try:
            step.send(None)
        except StopIteration as done:
            if done.value.get("type") == "http.disconnect":
                return True
            continue
        step.close()  # it would have waited: the client is still there
        return False
    return False


class ClientWatch:
    """One non-streamed call's client. Made in the task that runs the call, with the request's
    body read already; `run(call)` awaits the call in this task and raises `ClientGone` if the
    watcher cancelled it; the call asks `left()` once its answer is ready."""

    def __init__(self, receive: Receive, after: float | None = None):
        self._receive = receive
        self._task = asyncio.current_task()
        self._gone = False
        self._cancelled_call = False
        self._watcher: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            WATCH_AFTER_SECONDS if after is None else after, self._start_watching
        )

    def _start_watching(self) -> None:
        self._timer = None
        self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        with contextlib.suppress(Exception):
            while (await self._receive())["type"] != "http.disconnect":
                pass
            self._gone = self._cancelled_call = True
            self._task.cancel()

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._watcher is not None:
            self._watcher.cancel()  # no await: it only waits in `receive`, and cancels nothing after this
            self._watcher = None

    def left(self) -> bool:
        """Whether the client is gone, asked once the answer is ready: from here on nothing is
        cancelled, so the call records its outcome undisturbed."""
        self._disarm()
        if not self._gone:
            self._gone = disconnected_now(self._receive)
        return self._gone

    async def run(self, call: Awaitable[T]) -> T:
        try:
            return await call
        except asyncio.CancelledError:
            # ours (the client left) unless someone else cancelled this task too
            if self._cancelled_call and self._task.uncancel() == 0:
                raise ClientGone() from None
            raise
        finally:
            self._disarm()
