"""Group commit: one writer thread per process commits every write queued so far in one
transaction, and each caller's `await` returns only once its write committed (or failed).

Backend-neutral: the backend hands in `apply_batch` (run these ops in one transaction, an op
that raises rolled back alone) and, for SQLite, `checkpoint` (copy the WAL back, in this
thread). A thread of its own rather than a task handing each round to an executor: with one
call at a time, those hand-offs were a good part of what the gateway added to a call.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

Op = Callable[[Any], Any]
"""A write: called with the backend's connection inside an open transaction."""
Outcome = tuple[bool, Any]
"""(True, the op's result) or (False, the exception it raised)."""

MAX_ROUND = 512
"""Writes committed in one transaction at most."""

_CHECKPOINT = object()  # queued for the writer thread: run a checkpoint

SLOW_COMMIT = 0.1
"""Seconds past which a commit counts as slow: a call's commit takes ~0.1 ms (a few ms where each
one is fsynced), so a slower one means a disk that lags, as it does before an NFS stall."""
LOOP_PAUSE = 60.0
"""Seconds after a slow commit during which no write is committed on the event loop."""

log = logging.getLogger("rlproxy.store")


class CommitPace:
    """Whether a write may be committed on the event loop (SQLite's `_write_now`). A commit there
    that hangs (the disk in an NFS stall) froze every request, /healthz too, for as long as it
    hung: nothing can interrupt a write the kernel holds. The first slow commit, on the loop or in
    the writer thread, sends every write to the writer thread for `LOOP_PAUSE` s after it, where a
    hang only holds up the writes (and degrades the store past its timeout, `check_writer`)."""

    def __init__(self) -> None:
        self._slow_at = -math.inf  # monotonic time of the last slow commit

    def loop_allowed(self) -> bool:
        return time.monotonic() - self._slow_at > LOOP_PAUSE

    def took(self, seconds: float) -> None:
        """A commit (or a writer round) took `seconds`."""
        if seconds <= SLOW_COMMIT:
            return
        if self.loop_allowed():
            log.warning(
                "a store commit took %.2f s: its disk lags; for the next %.0f s every write goes through "
                "the writer thread, so that a disk that stalls cannot freeze the gateway",
                seconds,
                LOOP_PAUSE,
            )
        self._slow_at = time.monotonic()


class GroupCommitWriter:
    def __init__(
        self,
        apply_batch: Callable[[list[Op]], list[Outcome]],
        checkpoint: Callable[[], None] | None = None,
        pace: CommitPace | None = None,
    ) -> None:
        self._apply_batch = apply_batch
        self._checkpoint = checkpoint
        self._pace = pace or CommitPace()  # told how long each round took (not a checkpoint: it fsyncs)
        self._loop = asyncio.get_running_loop()  # where waiting callers are woken
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.in_flight = 0  # writes handed to the thread and not yet settled
        self._waiting: dict[asyncio.Future, Op] = {}  # those writes: what a shutdown that gives up loses
        self._round_started: float | None = None  # monotonic start of the round (or checkpoint) under way
        self._thread = threading.Thread(target=self._write_loop, name="rlproxy-store-writer", daemon=True)
        self._thread.start()

    async def submit(self, op: Op) -> Any:
        future = self._loop.create_future()
        self.in_flight += 1
        self._waiting[future] = op
        self._queue.put((op, future))
        return await future

    def busy_for(self) -> float:
        """Seconds the round under way has run (0 between rounds): a database or a disk that does
        not answer holds one round for as long as it hangs."""
        started = self._round_started
        return 0.0 if started is None else time.monotonic() - started

    def request_checkpoint(self) -> None:
        self._queue.put(_CHECKPOINT)

    async def stop(self, timeout: float | None = None) -> bool:
        """After every write already queued: each is committed or failed first. False when the
        thread is still held by the database after `timeout` s (left behind: a daemon thread)."""
        self._queue.put(None)
        await asyncio.to_thread(self._thread.join, timeout)
        return not self._thread.is_alive()

    def give_up_after(self, seconds: float, failure: Callable[[], BaseException]) -> None:
        """The process is stopping: from now on, once a round has waited `seconds` for the database,
        the writes waiting for it are given up (`abandon`); writes that the database answers are not.
        Thread-safe (a signal handler may call it)."""

        def check() -> None:
            if self.busy_for() >= seconds:
                self.abandon(failure)
            if self._thread.is_alive():
                self._loop.call_later(min(1.0, seconds), check)

        self._loop.call_soon_threadsafe(check)

    def abandon(self, failure: Callable[[], BaseException]) -> None:
        """Fail every write still waiting for a round the database does not answer (a disk in a
        stall, a frozen server) with `failure()`, and say in the log what was not recorded: none
        was acknowledged. Shutdown waited for ever on such a round, the lifespan's own writes
        (the heartbeat row, RULER's verdicts) queued behind it."""
        lost = [op for future, op in self._waiting.items() if not future.done()]
        for future in self._waiting:
            if not future.done():
                future.set_exception(failure())
        self._waiting.clear()
        if lost:
            calls = [op.call.id for op in lost if hasattr(op, "call")]
            log.error(
                "the gateway stopped with %d write(s) its store never answered (%d call(s)%s): given up, NOT "
                "recorded (unless the store answers before the process exits), none acknowledged. %s",
                len(lost),
                len(calls),
                (": " + ", ".join(calls[:20]) + (" ..." if len(calls) > 20 else "")) if calls else "",
                failure(),
            )

    def _write_loop(self) -> None:
        """Each round takes every write queued so far (up to `MAX_ROUND`), commits them in one
        transaction, then hands the outcomes to the event loop in one callback."""
        stopping = False
        while not stopping:
            batch = [self._queue.get()]
            while len(batch) < MAX_ROUND:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if None in batch:
                stopping = True
            self._round_started = time.monotonic()
            if _CHECKPOINT in batch and self._checkpoint is not None:
                self._checkpoint()
            batch = [item for item in batch if item is not None and item is not _CHECKPOINT]
            if not batch:
                self._round_started = None
                continue
            started = time.monotonic()
            try:
                outcomes: list[Outcome] | BaseException = self._apply_batch([op for op, _ in batch])
            except BaseException as exc:  # noqa: BLE001 - the commit itself failed: nobody is acknowledged
                outcomes = exc
            self._round_started = None
            self._pace.took(time.monotonic() - started)
            try:
                self._loop.call_soon_threadsafe(self._settle, batch, outcomes)
            except RuntimeError:  # the loop is closed: nobody is left waiting
                pass

    def _settle(self, batch: list[tuple[Op, asyncio.Future]], outcomes: list[Outcome] | BaseException) -> None:
        """On the event loop: each waiting caller gets its write's outcome, or the round's failure."""
        self.in_flight -= len(batch)
        for index, (_, future) in enumerate(batch):
            self._waiting.pop(future, None)
            if future.done():  # its caller was cancelled meanwhile
                continue
            if isinstance(outcomes, BaseException):
                future.set_exception(outcomes)
                continue
            ok, value = outcomes[index]
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)


def with_savepoints(conn: Any, ops: list[Op], fails_the_round: Callable[[Exception], bool]) -> list[Outcome]:
    """Every op of a round in a savepoint of its own, so an op that raises is rolled back
    alone and handed to its caller; an exception that `fails_the_round` (the disk or the
    server failing, not the op) is raised: the transaction may be gone already. The SQL is
    both SQLite's and PostgreSQL's."""
    outcomes: list[Outcome] = []
    for op in ops:
        conn.execute("SAVEPOINT op")
        try:
            outcomes.append((True, op(conn)))
            conn.execute("RELEASE SAVEPOINT op")
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            if fails_the_round(exc):
                raise
            conn.execute("ROLLBACK TO SAVEPOINT op")
            conn.execute("RELEASE SAVEPOINT op")
            outcomes.append((False, exc))
    return outcomes
