"""The gateway's background asyncio tasks (adapter polling, the canary, the GPU lease, vLLM's
monitor): one way to stop one, and one way to bound a wait that its task may be cancelled in.

Python 3.11's `asyncio.wait_for` loses a cancellation that arrives in the same turn of the loop
as its awaitable's result: it returns the result and its task goes on. The adapter poll awaited
a store read that way every `--poll-interval`; a shutdown's cancel that met a read finishing was
lost, the poll went on for ever and the gateway never stopped (a test server held 60 s, in one
start in three). `within` bounds a wait with `asyncio.timeout`, which keeps the cancellation;
`stop_task` cancels again until the task has stopped, for whatever else swallows one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

Result = TypeVar("Result")

# How long `stop_task` waits for a cancelled task before it cancels it again.
RECANCEL_AFTER = 1.0


async def within(awaitable: Awaitable[Result], seconds: float | None) -> Result:
    """`await awaitable`, or TimeoutError after `seconds` (None: no bound), the awaitable cancelled;
    `asyncio.wait_for` without 3.11's lost cancellation."""
    async with asyncio.timeout(seconds):
        return await awaitable


async def stop_task(task: asyncio.Task | None) -> None:
    """Cancel `task` (if any) and wait until it has stopped, its cancellation swallowed; cancelled
    again each `RECANCEL_AFTER` seconds while it goes on (a cancellation something inside lost)."""
    if task is None:
        return
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_AFTER)
    with contextlib.suppress(asyncio.CancelledError):
        await task
