"""The gateway's background asyncio tasks (adapter polling, the canary, the GPU lease, vLLM's
monitor): one way to stop one."""

from __future__ import annotations

import asyncio
import contextlib


async def stop_task(task: asyncio.Task | None) -> None:
    """Cancel `task` (if any) and wait until it has stopped, its cancellation swallowed."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
