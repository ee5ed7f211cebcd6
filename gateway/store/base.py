"""The store's interface: what the gateway, the trainer and export use, whichever the backend.

The store is the only channel between gateway and trainer. A write's `await` returns only
after its transaction committed, so a response acknowledged to a client is on disk (or in
the database). Async writes are the gateway's, batched by one writer thread per process
(group commit, `gateway.store.writer`); the trainer, in its own process, uses the
synchronous methods. Reads are synchronous.

A backend implements the four primitives below (a transaction now, a batch of writes in one
transaction, a read, a probe) and its lifecycle; every method of the interface is written
once, here, in portable SQL over those primitives (the ops live in `rows`, `training`,
`reads` and `lists`). `sqlite.SQLiteStore` is the embedded default, `postgres.PostgresStore`
the shared one; `open_store` picks one.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from gateway.store import discard, lists, live, reads, rows, training
from gateway.store.gateways import GatewayRows
from gateway.store.health import StoreHealth, classify, stalled_at_exit
from gateway.store.live import LiveRule
from gateway.store.reads import SessionFilter
from gateway.store.retention import RetentionRows
from gateway.store.rows import CallRecord
from gateway.store.shadows import ShadowRows
from gateway.store.steps import StepRows
from gateway.store.trainer_lock import TrainerLockRows
from gateway.store.writer import CommitPace, GroupCommitWriter, Op, Outcome


class Store(StepRows, ShadowRows, GatewayRows, TrainerLockRows, RetentionRows, ABC):
    backend: str
    """"sqlite" or "postgres"."""
    path: Any
    """The SQLite file, or the PostgreSQL URL (with its password: never log it; see `redact`)."""

    def __init__(self, busy_timeout: float) -> None:
        self.busy_timeout = busy_timeout
        self.health = StoreHealth()  # a disk or server failure, until a write commits again
        self.commits = 0  # transactions committed by the writer (for /metrics and tests)
        self._writer: GroupCommitWriter | None = None
        self.pace = CommitPace()  # whether a write may be committed on the event loop now

    # ------------------------------------------------------------ what a backend implements

    @abstractmethod
    def _run_sync(self, op: Op) -> Any:
        """`op(conn)` in one write transaction, committed before this returns (this thread)."""

    @abstractmethod
    def _apply_batch(self, ops: list[Op]) -> list[Outcome]:
        """Every op in one transaction, an op that raises rolled back alone (the writer's round)."""

    @abstractmethod
    def _query(self, sql: str, params: tuple | dict = ()) -> list[dict]:
        """A read: rows as dicts. `?` placeholders (and `:name` with a dict), in either backend."""

    @abstractmethod
    async def probe(self) -> None:
        """A write as large as a typical call, committed and removed in one transaction: succeeds
        only when calls can be recorded again (else raises the failure). Run while degraded, it
        alone ends that state (a small write, a reward, may fit where a call does not)."""

    @abstractmethod
    def _close_connections(self) -> None:
        """Release the backend's connections (the writer has stopped)."""

    @contextmanager
    def _snapshot(self) -> Iterator[Callable[[str, tuple], list[dict]]]:
        """A read function whose reads all see the database as of one moment (several
        statements that must agree: a session and its calls while calls land)."""
        yield self._query

    def _write_now(self, op: Op) -> Outcome | None:
        """`op` committed at once on the event loop, or None to queue it for the writer."""
        return None

    def _checkpoint(self) -> None:
        """Housekeeping the writer thread runs when asked (SQLite: the WAL checkpoint; PostgreSQL needs none)."""
        return None

    # ------------------------------------------------------------ lifecycle and the writer

    async def start(self) -> None:
        """Start the writer thread (call from the event loop that will write)."""
        self._writer = GroupCommitWriter(self._apply_batch, self._checkpoint, self.pace)

    def stopping(self) -> None:
        """The gateway shuts down: writes waiting for a round the database has not answered for
        `2 * busy_timeout` s are given up (`GroupCommitWriter.abandon`: answered 503 and logged,
        never silently). Thread-safe: `rlproxy serve` calls it when the signal to stop comes."""
        if self._writer is not None:
            self._writer.give_up_after(2 * self.busy_timeout, lambda: stalled_at_exit(2 * self.busy_timeout))

    async def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None and not await writer.stop(2 * self.busy_timeout):
            writer.abandon(lambda: stalled_at_exit(2 * self.busy_timeout))
            return  # its thread still runs a statement: closing the connections under it can crash
        self._close_connections()

    async def _submit(self, op: Op, *, at_once: bool = False) -> Any:
        writer = self._writer
        if writer is None:  # no writer running (trainer process, scripts): write in a thread
            return await asyncio.to_thread(self._run_sync, op)
        self.check_writer()
        if at_once and writer.in_flight == 0 and self.pace.loop_allowed() and not self.health.degraded:
            started = time.monotonic()
            outcome = self._write_now(op)
            self.pace.took(time.monotonic() - started)
            if outcome is not None:
                ok, value = outcome
                if ok:
                    return value
                raise value
        return await writer.submit(op)

    def check_writer(self) -> None:
        """Raise while a write hangs on the database past the store's timeout (`StoreHealth.check_writer`)."""
        self.health.check_writer(0.0 if self._writer is None else self._writer.busy_for(), self.busy_timeout)

    def _raise_failure(self, exc: BaseException) -> None:
        """Raise `exc` as the store failure it is (noting it in `health`); return if it is none."""
        failure = classify(exc, self.busy_timeout)
        if failure is not None:
            self.health.failed(failure)
            raise failure from (None if failure is exc else exc)

    # ------------------------------------------------------------ the gateway's writes

    async def record_call(self, call: CallRecord, *, alone: bool = False) -> None:
        """Committed before this returns. `alone`: no call in flight to share a commit with (`_write_now`)."""
        call.untrainable = await self._submit(rows.CallWrite(call), at_once=alone)

    def record_call_sync(self, call: CallRecord) -> None:
        call.untrainable = self._run_sync(rows.CallWrite(call))

    async def set_reward(
        self, session_id: str, reward: float, metrics: dict | None = None, live: LiveRule | None = None
    ) -> dict:
        """Store a reward; with `live`, an ungrouped session joins a live group (gateway/store/live.py)."""
        return await self._submit(lambda conn: rows.set_reward(conn, session_id, reward, metrics or {}, live))

    async def close_group(self, group_id: str, expected_sessions: int | None = None) -> dict:
        return await self._submit(lambda conn: rows.close_group(conn, group_id, expected_sessions))

    async def discard_session(self, session_id: str, reason: str | None = None) -> dict:
        """Leave a failed rollout out of its group: no reward needed, never trained, calls kept (idempotent)."""
        await self._submit(lambda conn: discard.discard_session(conn, session_id, reason))
        return self.get_session(session_id)

    async def record_judgement(
        self, group_id: str, judge_model: str, scores: list[dict], *, close: bool = True
    ) -> None:
        """RULER's scores become rewards (an earlier one kept as `independent_reward`); the group closes."""
        await self._submit(lambda conn: training.record_judgement(conn, group_id, judge_model, scores, close))

    def set_aside_stale_live(self, model: str, rule: LiveRule) -> list[str]:
        """Members of `model`'s filling live groups gone stale, set aside with their reason (`live.set_aside_stale`)."""
        return self._run_sync(lambda conn: live.set_aside_stale(conn, model, rule))

    async def request_trigger(self, model: str) -> int:
        """Ask the trainer for a step now, with whatever ready groups there are."""
        return await self._submit(lambda conn: training.request_trigger(conn, model))

    # ------------------------------------------------------------ the trainer's writes

    def consume_triggers(self, model: str) -> bool:
        """True if a step was asked for since the last call (and mark those asks done)."""
        return self._run_sync(lambda conn: training.consume_triggers(conn, model))

    # Claims freeze a step's groups (`gateway.store.training`: rewards 409, later calls untrainable).
    def claim_for_step(self, group_ids: Iterable[str], step: int) -> list[str]:
        return self._run_sync(lambda conn: training.claim_for_step(conn, list(group_ids), step))

    def release_step(self, group_ids: Iterable[str], error: str | None = None) -> None:
        self._run_sync(lambda conn: training.release_step(conn, list(group_ids), error))

    def release_model_claims(self, model: str) -> int:
        return self._run_sync(lambda conn: training.release_model_claims(conn, model))

    def mark_failed(self, group_ids: Iterable[str], reason: str) -> None:
        """Set groups aside: training them kept failing (the reason says how). Never retried."""
        self._run_sync(lambda conn: training.mark_failed(conn, group_ids, reason))

    def mark_skipped(self, group_ids: Iterable[str], reason: str, left_out: dict[str, str] | None = None) -> None:
        """Set groups aside (never trained); `left_out`: session id -> why it had no sample."""
        self._run_sync(lambda conn: training.mark_skipped(conn, group_ids, reason, left_out or {}))

    def skip_if_unchanged(self, groups: list[dict], reason: str) -> list[str]:  # the no-spread screen's
        return self._run_sync(lambda conn: training.skip_if_unchanged(conn, groups, reason))

    def claim_groups(
        self, model: str, holder: str, split: str = "train", limit: int | None = None, ttl_s: float = 3600.0
    ) -> list[dict]:
        """Ready groups for the trainer `holder` that no other holds (SQLite: one trainer, no claims needed)."""
        return self.ready_groups(model, split, limit)

    def release_claims(self, holder: str) -> None:
        """Give back what `holder` claimed (nothing to do without claims)."""
        return None

    def gpu_lease(self, model: str) -> dict:
        """The GPU lease of `model`: {"model", "state", "holder", "step", "updated_at"}; state "idle" if none."""
        return reads.gpu_lease(self._query, model)

    def move_gpu_lease(
        self,
        model: str,
        to_state: str,
        *,
        expect: tuple[str, ...],
        holder: str | None = None,
        expect_holder: str | None = None,
        step: int | None = None,
    ) -> bool:
        """Compare-and-set: move the lease to `to_state` if its state is one of `expect` (and its
        holder is `expect_holder`, when given). True if it moved. `holder` None keeps the holder."""
        return self._run_sync(
            lambda conn: training.move_gpu_lease(conn, model, to_state, expect, holder, expect_holder, step)
        )

    # ------------------------------------------------------------ reads

    def get_session(self, session_id: str) -> dict:
        # One snapshot: read apart, a call landing in between made `n_calls` disagree with `calls`
        # (GET /v1/sessions/{id}, `rlproxy export` of a session in flight).
        with self._snapshot() as query:
            session = reads.session_row(query, session_id)
            session["calls"] = self._session_calls(query, session_id)
        return session

    def session_calls(self, session_id: str) -> list[dict]:
        return self._session_calls(self._query, session_id)

    def _session_calls(self, query: Callable[[str, tuple], list[dict]], session_id: str) -> list[dict]:
        found = query("SELECT * FROM calls WHERE session_id = ? ORDER BY created_at, rowid", (session_id,))
        return [rows.decode_call(row) for row in found]

    def get_call(self, call_id: str) -> dict | None:
        found = self._query("SELECT * FROM calls WHERE id = ?", (call_id,))
        return rows.decode_call(found[0]) if found else None

    def get_group(self, group_id: str) -> dict:
        return reads.group(self._query, group_id)

    @abstractmethod
    def ready_groups(self, model: str, split: str = "train", limit: int | None = None) -> list[dict]:
        """Groups the trainer may take: closed (or full), every session rewarded, not trained,
        failed nor skipped, oldest first (the dialects differ: each backend's schema has it)."""

    def select_session_ids(self, where: SessionFilter) -> list[str]:
        """Ids of the sessions that pass `where` (all its filters but `since_step`), oldest first."""
        return reads.session_ids(self._query, where)

    def steps(self, model: str | None = None) -> list[dict]:
        return reads.steps(self._query, model)

    def latest_step(self, model: str) -> int | None:
        found = self._query("SELECT MAX(step) AS step FROM steps WHERE model = ?", (model,))
        return found[0]["step"] if found else None

    # Paged lists and the reward curve (the dashboard, GET /v1/sessions and /v1/groups).
    def list_sessions(self, f: lists.ListFilter) -> dict:
        return lists.list_sessions(self._query, f)

    def list_groups(self, f: lists.ListFilter) -> dict:
        return lists.list_groups(self._query, f)

    def reward_curve(self, model: str) -> list[dict]:
        return lists.reward_curve(self._query, model)

    def reward_changes(self, model: str, since: float | None) -> list[dict]:
        return lists.reward_changes(self._query, model, since)

    def calls_per_minute(self, now: float, minutes: int = 60) -> list[dict]:
        return lists.calls_per_minute(self._query, now, minutes)

    def counts(self) -> dict[str, int]:
        return reads.counts(self._query)
