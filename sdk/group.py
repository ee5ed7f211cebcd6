"""A group is the rollouts of one task that GRPO compares; `run` makes them in parallel.

Leaving a group's `with` block closes it (unless it was closed, judged, or the
block raised), so the trainer knows no more sessions are coming.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from numbers import Real
from typing import TYPE_CHECKING, Any

from sdk.errors import NotFoundError, RolloutsFailed
from sdk.session import AsyncSession, Session
from sdk.types import Score, header_id, new_id

if TYPE_CHECKING:  # the client imports this module, to make groups
    from sdk.client import AsyncRLProxy, RLProxy

log = logging.getLogger("rlproxy.sdk")


@dataclass
class RunResult:
    """What `group.run` did: finished rollouts in index order, and the ones that raised."""

    sessions: list = field(default_factory=list)  # sessions whose rollout returned
    rewards: list[float | None] = field(default_factory=list)  # what each returned (None: it posted its own or none)
    failed: list = field(default_factory=list)  # sessions whose rollout raised; they have no reward
    exceptions: list[BaseException] = field(default_factory=list)  # aligned with `failed`
    # Sessions discarded on the gateway, so their group does not wait for them: every failed
    # one that had made a call (one that failed before its first call never existed there),
    # and any a rollout discarded itself.
    discarded: list = field(default_factory=list)

    @property
    def n_failed(self) -> int:
        return len(self.exceptions)


ASYNC_ROLLOUT = (
    "the rollout is a coroutine function, which a blocking Group runs without awaiting it (nothing ran): "
    "use AsyncRLProxy and `await group.run(...)`"
)


def _as_reward(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, Real):
        return float(value)
    if inspect.iscoroutine(value):  # a lambda or partial around an async rollout
        value.close()  # never awaited: closed, so Python does not warn of it at some later collection
        raise TypeError(ASYNC_ROLLOUT)
    raise TypeError(f"a rollout must return a reward (a number) or None, not {type(value).__name__}")


def _check_run_args(n: int, concurrency: int | None, max_exceptions: int) -> int:
    if n < 1:
        raise ValueError("n must be at least 1")
    if concurrency is not None and concurrency < 1:
        raise ValueError("concurrency must be at least 1 (or None for all n at once)")
    if max_exceptions < 0:
        raise ValueError("max_exceptions must be 0 or more")
    return min(n, concurrency or n)


def _discard_reason(error: BaseException) -> str:
    return f"rollout raised {type(error).__name__}: {error}"[:500]


def _log_discard_failure(session: Any, exc: Exception) -> None:
    log.warning(
        "could not discard session %s of a failed rollout (its group waits for a reward until it "
        "gets one or is discarded): %s",
        session.id,
        exc,
    )


def _discard_failed(session: Session, error: BaseException) -> None:
    """Best effort: the rollout's own error is what `run` reports, so a failed discard is logged."""
    try:
        session.discard(_discard_reason(error))
    except NotFoundError:
        pass  # it failed before its first call: the gateway never saw this session
    except Exception as exc:  # noqa: BLE001 - never hide the rollout's error behind this one
        _log_discard_failure(session, exc)


async def _discard_failed_async(session: AsyncSession, error: BaseException) -> None:
    try:
        await session.discard(_discard_reason(error))
    except NotFoundError:
        pass
    except Exception as exc:  # noqa: BLE001
        _log_discard_failure(session, exc)


def _collect(outcomes: dict[int, tuple[Any, float | None, BaseException | None]]) -> RunResult:
    result = RunResult()
    for index in sorted(outcomes):
        session, reward, error = outcomes[index]
        if error is None:
            result.sessions.append(session)
            result.rewards.append(reward)
        else:
            result.failed.append(session)
            result.exceptions.append(error)
        if session.discarded:
            result.discarded.append(session)
    return result


def _too_many(outcomes: dict, max_exceptions: int, last: BaseException) -> RolloutsFailed:
    result = _collect(outcomes)
    error = RolloutsFailed(
        f"{result.n_failed} rollouts raised, more than max_exceptions={max_exceptions}; last: "
        f"{type(last).__name__}: {last}",
        result,
    )
    error.__cause__ = last
    return error


class _GroupBase:
    _session_class: type

    def __init__(self, proxy: Any, id: str, split: str):
        self.proxy = proxy
        self.id = header_id(id, "group_id")
        self.split = split
        self.closed = False  # closed (or judged) through this object
        self._n_sessions = 0
        self._lock = threading.Lock()

    def _new_session(
        self, cls: type, session_id: str | None, split: str | None = None, task_id: str | None = None
    ) -> Any:
        if cls is not self._session_class:  # a blocking client's session of an asyncio group, or back
            # Bound to this group's client, its reward() returned a coroutine nobody awaited: never posted.
            raise TypeError(
                f"group {self.id!r} belongs to the {type(self.proxy).__name__} that made it: make its sessions with "
                "group.session() or that client's session(group=...)"
            )
        if split is not None and split != self.split:  # the gateway would refuse its first call (409)
            raise ValueError(
                f"split '{split}' is not the split of group {self.id!r} ('{self.split}'): a group holds one split, "
                "so make a group of its own for the other"
            )
        with self._lock:
            self._n_sessions += 1  # so that leaving the group's `with` block closes it
        return cls(self.proxy, session_id or new_id("sess"), self.id, self.split, task_id)

    def _close_on_exit(self, exc_type: type | None) -> bool:
        # Nothing to close if no session was started here (the gateway never saw the group).
        return exc_type is None and not self.closed and self._n_sessions > 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, split={self.split!r})"


class Group(_GroupBase):
    """Blocking group; made by `RLProxy.group()`."""

    proxy: RLProxy
    _session_class = Session

    def session(self, session_id: str | None = None) -> Session:
        return self._new_session(Session, session_id)

    def close(self, expected_sessions: int | None = None) -> dict:
        """No more sessions (or: this many in all). The group is ready once every session has a reward."""
        body = self.proxy.close_group(self.id, expected_sessions)
        self.closed = True
        return body

    def ruler(self, judge_model: str, rubric: str | None = None, judge_api_base: str | None = None) -> list[Score]:
        """Score every session with an LLM judge (RULER); the scores become rewards and the group closes.
        The gateway calls only the judges it was started with (`--judge-model`, `--judge-api-base`)
        and `self`; another is a `BadRequestError`."""
        scores = self.proxy.ruler(self.id, judge_model, rubric, judge_api_base)
        self.closed = True
        return scores

    def get(self) -> dict:
        return self.proxy.get_group(self.id)

    def run(
        self, rollout: Callable[[Session], Any], n: int, concurrency: int | None = None, max_exceptions: int = 0
    ) -> RunResult:
        """Run `rollout(session)` n times in threads, `concurrency` at a time (default: all).

        A rollout that returns a number has it posted as its session's reward; one that
        returns None posts its own (or leaves it to `ruler`). Failed rollouts are counted
        and skipped; once more than `max_exceptions` fail, no new ones start and
        `RolloutsFailed` is raised. A failed rollout's session is discarded on the gateway
        (`result.discarded`; its calls stay recorded), so the group becomes ready on the
        others' rewards and the trainer never trains on it.
        """
        workers = _check_run_args(n, concurrency, max_exceptions)
        if inspect.iscoroutinefunction(rollout):  # each would "fail" with a coroutine for a reward
            raise TypeError(ASYNC_ROLLOUT)
        outcomes: dict[int, tuple[Any, float | None, BaseException | None]] = {}

        def one(session: Session) -> float | None:
            try:
                reward = _as_reward(rollout(session))
                if reward is not None:
                    session.reward(reward)
                return reward
            except Exception as error:
                _discard_failed(session, error)
                raise

        # At most `workers` rollouts are submitted at a time, so once too many have failed
        # no further one starts.
        waiting = list(range(n))
        failures = 0
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"rollout-{self.id}") as pool:
            running: dict[Future, Session] = {}
            while waiting or running:
                while waiting and len(running) < workers and failures <= max_exceptions:
                    session = self.session()
                    session.index = waiting.pop(0)
                    running[pool.submit(one, session)] = session
                if not running:
                    break
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    session = running.pop(future)
                    error = future.exception()
                    outcomes[session.index] = (session, None if error else future.result(), error)
                    if error is not None:
                        failures += 1
                        last_error = error
            if failures > max_exceptions:
                raise _too_many(outcomes, max_exceptions, last_error)
        return _collect(outcomes)

    def __enter__(self) -> Group:
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        if self._close_on_exit(exc_type):
            try:
                self.close()
            except NotFoundError:
                pass  # no session made a call, so the gateway has no such group to close


class AsyncGroup(_GroupBase):
    """asyncio group; made by `AsyncRLProxy.group()`."""

    proxy: AsyncRLProxy
    _session_class = AsyncSession

    def session(self, session_id: str | None = None) -> AsyncSession:
        return self._new_session(AsyncSession, session_id)

    async def close(self, expected_sessions: int | None = None) -> dict:
        body = await self.proxy.close_group(self.id, expected_sessions)
        self.closed = True
        return body

    async def ruler(
        self, judge_model: str, rubric: str | None = None, judge_api_base: str | None = None
    ) -> list[Score]:
        scores = await self.proxy.ruler(self.id, judge_model, rubric, judge_api_base)
        self.closed = True
        return scores

    async def get(self) -> dict:
        return await self.proxy.get_group(self.id)

    async def run(
        self,
        rollout: Callable[[AsyncSession], Awaitable[Any]],
        n: int,
        concurrency: int | None = None,
        max_exceptions: int = 0,
    ) -> RunResult:
        """`Group.run` for coroutines: n rollouts as tasks, `concurrency` at a time (default: all)."""
        workers = _check_run_args(n, concurrency, max_exceptions)
        outcomes: dict[int, tuple[Any, float | None, BaseException | None]] = {}

        async def one(session: AsyncSession) -> float | None:
            try:
                returned = rollout(session)
                if inspect.isawaitable(returned):
                    returned = await returned
                reward = _as_reward(returned)
                if reward is not None:
                    await session.reward(reward)
                return reward
            except Exception as error:  # not CancelledError: a cancelled run discards nothing
                await _discard_failed_async(session, error)
                raise

        waiting = list(range(n))
        running: dict[asyncio.Task, AsyncSession] = {}
        failures = 0
        try:
            while waiting or running:
                while waiting and len(running) < workers and failures <= max_exceptions:
                    session = self.session()
                    session.index = waiting.pop(0)
                    running[asyncio.ensure_future(one(session))] = session
                if not running:
                    break
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    session = running.pop(task)
                    error = task.exception()
                    outcomes[session.index] = (session, None if error else task.result(), error)
                    if error is not None:
                        failures += 1
                        last_error = error
        finally:
            for task in running:  # only when we are cancelled ourselves
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)
        if failures > max_exceptions:
            raise _too_many(outcomes, max_exceptions, last_error)
        return _collect(outcomes)

    async def __aenter__(self) -> AsyncGroup:
        return self

    async def __aexit__(self, exc_type: type | None, *exc: object) -> None:
        if self._close_on_exit(exc_type):
            try:
                await self.close()
            except NotFoundError:
                pass  # no session made a call, so the gateway has no such group to close
