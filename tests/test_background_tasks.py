"""Stopping the gateway's background tasks: a cancellation is never lost on the way.

Python 3.11's `asyncio.wait_for` returns its awaitable's result when the cancellation arrives in
the same turn of the loop as that result, and its task goes on. The adapter poll awaited a store
read that way every poll interval; a gateway shutdown then waited for it for ever. The race is
made certain here: the read finishes in its thread while the loop is held, so its result and the
cancel are handled in one turn.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from gateway.store.sqlite import SQLiteStore
from gateway.store.waits import read_within
from gateway.tasks import RECANCEL_AFTER, stop_task, within


async def _cancel_as_the_read_finishes(wait) -> asyncio.Task:
    finished = threading.Event()

    def read() -> str:
        finished.set()
        return "row"

    task = asyncio.create_task(wait(read))
    await asyncio.sleep(0)  # the read is handed to its thread; the task awaits it
    assert finished.wait(10)
    time.sleep(0.2)  # the loop is held: the read's result is queued to it, not yet taken
    task.cancel()
    return task


async def test_a_store_read_cancelled_as_it_finishes_stays_cancelled(tmp_path):
    store = SQLiteStore(tmp_path / "db.sqlite")
    task = await _cancel_as_the_read_finishes(lambda read: read_within(store, read))
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_asyncio_wait_for_loses_that_cancellation_on_this_python_where_within_keeps_it():
    """The reference for the test above: the same race through asyncio.wait_for, on Python 3.11."""
    import sys

    async def through(bound, read):
        return await bound(asyncio.wrap_future(_thread_future(read)), 30)

    kept = await _cancel_as_the_read_finishes(lambda read: through(within, read))
    with pytest.raises(asyncio.CancelledError):
        await kept
    lost = await _cancel_as_the_read_finishes(lambda read: through(asyncio.wait_for, read))
    if sys.version_info < (3, 12):
        assert await lost == "row"  # the flaw `within` exists for
    else:
        with pytest.raises(asyncio.CancelledError):
            await lost


def _thread_future(read):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(read)


async def test_stop_task_cancels_again_a_task_that_swallowed_the_first_cancellation():
    cancels = []

    async def poll() -> None:
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                cancels.append(time.monotonic())
                if len(cancels) > 1:
                    raise
                # the first is lost, as one that met a finishing asyncio.wait_for

    task = asyncio.create_task(poll())
    await asyncio.sleep(0.05)
    stopping = asyncio.create_task(stop_task(task))
    done, _ = await asyncio.wait({stopping}, timeout=10 * RECANCEL_AFTER)  # asyncio.wait cancels nothing
    task.cancel()  # what is left of a failure: stopped before the assertion
    assert stopping in done, "stop_task waited for ever on a task that lost its cancellation"
    assert task.cancelled() and len(cancels) == 2


async def test_stop_task_still_raises_what_the_task_failed_with():
    async def fails() -> None:
        raise ValueError("the poll's own failure")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="own failure"):
        await stop_task(task)
    await stop_task(None)
