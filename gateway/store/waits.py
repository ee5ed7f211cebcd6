"""What the event loop waits for from the store, bounded by a few of the store's timeouts: a read
in threads of its own (`read_within`), and the probe that decides whether a degraded store
records again (`recheck`).

A SQLite read on a disk that hangs (an NFS stall, a frozen volume) holds its thread for as long
as the disk does. Run with `asyncio.to_thread`, each such read kept one of the loop's default
executor threads (min(32, cores + 4): 6 on two cores) for good and its request never answered:
a few /healthz or /metrics polls left no thread for the work that needs one (the local engine
renders every prompt there). PostgreSQL's reads are cut by `answer_within`; this bound is
SQLite's, and a backstop for both.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from gateway.store.health import stalled
from gateway.tasks import within

if TYPE_CHECKING:
    from gateway.store.base import Store

Result = TypeVar("Result")


class _ReadThreads:
    """Up to `size` daemon threads running reads. Not a ThreadPoolExecutor: its threads (the loop's
    default executor's too) are joined when the interpreter exits, so a read the disk never answers
    kept a stopped gateway from exiting."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0

    def submit(self, read: Callable[..., Result], *args: Any) -> Future[Result]:
        future: Future[Result] = Future()
        with self._lock:
            if self._idle:  # a waiting thread takes it: counted out now, so the next read gets another
                self._idle -= 1
            elif self._threads < self._size:
                self._threads += 1
                threading.Thread(target=self._work, name="rlproxy-store-read", daemon=True).start()
        self._jobs.put((future, read, args))
        return future

    def _work(self) -> None:
        while True:
            future, read, args = self._jobs.get()
            if future.set_running_or_notify_cancel():  # else its caller gave up before it started
                try:
                    future.set_result(read(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)
            with self._lock:
                self._idle += 1


# Reads that a hung disk holds fill these threads, never the default executor's; past them the next
# reads wait in the queue, and answer at the timeout like the held ones.
READ_THREADS = 8
_reads = _ReadThreads(READ_THREADS)
# The bounds, in the store's timeouts, past the store's own (a PostgreSQL read may wait one for a
# connection and one for its answer; a write two for its answer), so that the store's own failure,
# with its cause (a lock another process holds: `store_locked`), comes first where there is one.
READ_WAIT = 2.0
PROBE_WAIT = 3.0


async def read_within(store: Store, read: Callable[..., Result], *args: Any) -> Result:
    """`read(*args)` in the store's read pool; StoreUnavailable (noted in `store.health`) when
    it has not answered within `READ_WAIT` store timeouts. The thread a hung read holds stays held."""
    try:
        return await within(asyncio.wrap_future(_reads.submit(read, *args)), READ_WAIT * store.busy_timeout)
    except TimeoutError:
        raise _noted(store, "a read", READ_WAIT) from None


async def recheck(store: Store) -> None:
    """Raise while the store cannot record: its writer held past the timeout by the database,
    or, while it is degraded, a probe write that fails or is not answered within `PROBE_WAIT` store timeouts.
    The probe queues behind the writer's round under way: unbounded, /healthz and every call
    waited for as long as a stalled disk held that round, until it passed the timeout."""
    store.check_writer()
    if store.health.degraded:
        try:
            await within(store.probe(), PROBE_WAIT * store.busy_timeout)
        except TimeoutError:
            raise _noted(store, "a probe write", PROBE_WAIT) from None


def _noted(store: Store, what: str, timeouts: float) -> Exception:
    failure = stalled(timeouts * store.busy_timeout, what)
    store.health.failed(failure)
    return failure
