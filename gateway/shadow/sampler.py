"""The shadow sampler: an observer of committed calls that shadows some of them in the background.

It is called with every committed call (the chat service's observers), after the client's
answer is on disk and on its way: it only decides and schedules, so a live call is never
delayed. In the background each shadow waits for a quiet engine (no live call in it: shadows
yield to live load; a colocated trainer's handover calls one off, to be sampled again), asks the
engine for K completions from the step that answered the live call, records the group
(gateway.store.shadows.insert_shadow_group) and has RULER judge it; the scores become the
sessions' rewards and the trainer takes the group like any other. At most
`--shadow-max-in-flight` live calls are shadowed at once; a call arriving when that many are
is not shadowed (counted as dropped), so shadows never pile up behind live traffic.

A shadow group recorded but not judged when the gateway stops (its judge cut short, or
waiting for another try) is marked so and judged again by a gateway with shadow samples on the
store: one already running (it looks every few seconds) or the next to start. A gateway killed
marks nothing: its groups are marked once its heartbeat expires (`gateway.ruler.watch`).

No clock gives a shadow up: one that waited or sampled long would be one with long answers, and
dropping it would lean the groups short. A shadow is dropped only once its step is no longer
worth sampling: the alias has moved more than `--max-staleness` steps past the step that
answered the live call, so the trainer would skip its group as stale anyway. The drops are
counted per task key too (`summary()["by_task_key"]`, shown on `/v1/dashboard`), so a key
whose shadows are dropped more often than others' can be seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.colocate import is_stale
from gateway.engines.base import Completion, EngineRequest
from gateway.errors import RLProxyError
from gateway.metrics import Metrics
from gateway.ruler import watch
from gateway.ruler.judges import JudgeError
from gateway.settings import Settings
from gateway.shadow.calls import generated_tokens, shadow_body, shadow_calls, why_not_shadowed
from gateway.store import CallRecord
from gateway.store.frozen import JUDGE_GAVE_UP
from gateway.store.shadows import shadow_group_id
from gateway.store.waits import read_within

log = logging.getLogger("rlproxy.shadow")

QUIET_POLL_S = 0.01
STALE_POLL_S = 0.5
"""How often a sampling shadow looks whether its step went stale (not a time-out)."""
JUDGE_TRIES = 3
JUDGE_RETRY_S = (10.0, 60.0)
"""The waits before a shadow group's second and third judgement (a judge restarting, rate limits)."""
MAX_TASK_KEYS = 256
"""Task keys counted one by one in `summary()`; later ones are counted together as "(other)"."""


class ShadowSampler:
    def __init__(self, services: Any, settings: Settings, metrics: Metrics, seed: int | None = None):
        self.services = services
        self.k = settings.shadow_samples
        self.rate = settings.shadow_rate
        self.cap = settings.shadow_max_in_flight
        self.max_staleness = settings.max_staleness
        self.judge_model = str(settings.shadow_judge_model)
        self.judge_api_base = settings.shadow_judge_api_base
        self.metrics = metrics
        self.rng = random.Random(seed)
        self.in_flight = 0  # live calls being shadowed (waiting, sampling, recording or judged)
        self.sampling = 0  # shadow engine calls inside the gate right now
        self.tasks: set[asyncio.Task] = set()
        # What the dashboard shows (the same as /metrics' counters, for this process).
        self.counts = {"shadowed": 0, "completed": 0, "dropped": 0, "failed": 0, "tokens": 0, "judge_calls": 0}
        self.by_task_key: dict[str, dict[str, int]] = {}  # key -> live calls picked, dropped
        # This gateway: named in the groups it records, judged by it or handed on if it dies.
        self.owner: str | None = getattr(services, "gateway_id", None)

    def __call__(self, record: CallRecord) -> None:
        """The chat service's observer: schedule shadows of `record` if it is a live call to shadow."""
        if why_not_shadowed(record) is not None or self.rng.random() >= self.rate:
            return
        self._per_key(record, "calls")
        if self.in_flight >= self.cap:
            self._count("dropped", reason="cap")
            self._per_key(record, "dropped")
            return
        self.in_flight += 1
        self._count("shadowed")
        task = asyncio.get_running_loop().create_task(self._shadow(record))
        self.tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self.in_flight -= 1

    def _count(self, what: str, n: int = 1, reason: str = "") -> None:
        self.counts[what] += n
        if what in ("shadowed", "completed", "dropped", "failed"):
            self.metrics.shadow_calls.labels(outcome=what if not reason else f"{what}_{reason}").inc(n)

    def _per_key(self, record: CallRecord, what: str) -> None:
        key = record.task_key or "(none)"
        if key not in self.by_task_key and len(self.by_task_key) >= MAX_TASK_KEYS:
            key = "(other)"
        counts = self.by_task_key.setdefault(key, {"calls": 0, "dropped": 0})
        counts[what] += 1

    def summary(self) -> dict:
        """The counts, in flight, and per task key the live calls picked for shadows, those
        dropped and their share (what the dashboard shows)."""
        by_key = {
            key: {**counts, "drop_share": round(counts["dropped"] / counts["calls"], 4)}
            for key, counts in self.by_task_key.items()
        }
        return {**self.counts, "in_flight": self.in_flight, "by_task_key": by_key}

    def _stale(self, live: CallRecord) -> bool:
        """The alias moved more than `--max-staleness` past the live call's step: the trainer
        would skip this group (the same rule, `gateway.colocate.is_stale`)."""
        current = self.services.chat.registry.current
        return current is not None and is_stale(live.step, current, self.max_staleness)

    async def start(self) -> None:
        """Judge again, now and every `HEARTBEAT_S`, the shadow groups a gateway's stop left
        unjudged (its shutdown: `stop`; killed: `gateway.ruler.watch`): else nothing would ever
        reward them. Each is taken by one gateway only (`Store.claim_stopped_shadow_group`)."""
        task = asyncio.get_running_loop().create_task(self._take_up_stopped())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def stop(self) -> None:
        """Cancel what is still running (the gateway is shutting down). A group recorded but not
        judged yet is marked so (RULER's `STOPPED`, which also says to POST its ruler again) and
        judged again when a gateway starts on the store; samples not recorded yet are lost."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _take_up_stopped(self) -> None:
        while True:
            await self._judge_stopped()
            await asyncio.sleep(watch.HEARTBEAT_S)

    async def _judge_stopped(self) -> None:
        while True:
            try:
                group_id = await self.services.store.claim_stopped_shadow_group(watch.stopped, self.owner)
            except Exception as exc:  # a store away for a moment: those groups wait for the next look
                log.warning("shadow groups a shutdown left unjudged were not taken up: %s", exc)
                return
            if group_id is None:
                return
            log.info("judging shadow group %s again: a gateway's stop cut its judgement short", group_id)
            try:
                await self._judge(group_id)
                self._count("completed")
            except asyncio.CancelledError:
                await self._mark_stopped(group_id)
                raise
            except Exception as exc:
                self._failed(exc, f"shadow group {group_id}")

    async def _shadow(self, live: CallRecord) -> None:
        group_id = None
        try:
            sampled = await self._sample_when_quiet(live)
            if sampled is None:
                self._count("dropped", reason="stale")
                self._per_key(live, "dropped")
                return
            group_id = shadow_group_id(live.id)  # from here on the group may be on disk
            if await self.services.store.record_shadow_group(sampled, owner=self.owner) is None:
                self._count("dropped", reason="discarded")  # the client discarded its session meanwhile
                self._per_key(live, "dropped")
                return
            await self._judge(group_id)
            self._count("completed")
        except asyncio.CancelledError:
            if group_id is not None:
                await self._mark_stopped(group_id)
            raise
        except Exception as exc:
            self._failed(exc, f"shadow samples of call {live.id}")

    def _failed(self, exc: Exception, what: str) -> None:
        """A shadow's failure never reaches a client; it is counted and logged."""
        self._count("failed", reason="judge" if isinstance(exc, ShadowJudgeFailed) else "")
        message = exc.message if isinstance(exc, RLProxyError) else f"{type(exc).__name__}: {exc}"
        log.warning("%s failed: %s", what, message)

    async def _mark_stopped(self, group_id: str) -> None:
        with contextlib.suppress(Exception):  # a store that cannot write must not hide the cancel
            await asyncio.shield(self.services.store.stop_shadow_judgement(group_id, watch.stopped(group_id)))

    async def _quiet_engine(self, live: CallRecord) -> bool:
        """Wait until no live call is in the engine (shadows yield to live load); False once the
        live call's step went stale meanwhile."""
        gate = self.services.chat.gate
        while gate.in_flight - self.sampling > 0 or not gate.is_open:
            if self._stale(live):
                return False
            await asyncio.sleep(QUIET_POLL_S)
        return not self._stale(live)

    async def _sample_when_quiet(self, live: CallRecord) -> list[CallRecord] | None:
        """The group's rows, sampled once the engine is quiet; None once the step went stale. A
        sample the gate called off (a colocated trainer takes the GPU: `RequestGate.closing`) is
        sampled again from the start once the gate opens: vLLM's sleep keeps nothing of it. Sampled
        again, it is not called off again (the next handover waits for it as for a live call):
        back-to-back steps take the GPU again within a second of giving it back, and samples that
        take longer were called off at every step until their live call's step went stale."""
        may_call_off = True
        while await self._quiet_engine(live):
            try:
                return await self._sample(live, may_call_off)
            except CalledOff:
                may_call_off = False
                log.info(
                    "shadow samples of call %s called off: the trainer takes the GPU; sampled again after", live.id
                )
        return None

    async def _sample(self, live: CallRecord, may_call_off: bool = True) -> list[CallRecord] | None:
        """The group's rows, or None when the step went stale before the engine answered."""
        chat = self.services.chat
        started = time.perf_counter()
        # The step that answered the live call, pinned (NAME@N), even if the alias moved since.
        requested = live.served if live.served is not None else live.model
        async with chat.gate.passage(), chat.registry.use(requested) as target:
            self.sampling += 1
            try:
                request = EngineRequest(
                    body=shadow_body(live.request, target.model, self.k),
                    adapter=target.adapter,
                    request_id="shadow-" + uuid.uuid4().hex,
                    background=True,  # set aside (local) or behind live calls (vLLM priority)
                    session=live.session_id,  # the replica that holds the live call's prompt, within the load bound
                )
                answer, gate = chat.engine.complete(request), chat.gate if may_call_off else None
                completion = await _unless_stale(answer, lambda: self._stale(live), gate)
            finally:
                self.sampling -= 1
        if completion is None:
            return None
        if completion.tokens is None:
            raise RLProxyError("the engine returned no token ids for the shadow samples")
        tokens = generated_tokens(completion.tokens)
        self._count("tokens", tokens)
        self.metrics.shadow_tokens.inc(tokens)
        return shadow_calls(live, completion.response, completion.tokens, (time.perf_counter() - started) * 1000.0)

    async def _judge(self, group_id: str) -> None:
        """RULER's scores for the group, tried `JUDGE_TRIES` times: a judge down for a moment, or
        one that answered wrongly twice, must not cost the group. Nothing else ever rewards a
        shadow group, so after the last try it is set aside as failed (its reason on
        GET /v1/groups/{id}, `failed_judge` in /metrics) rather than left pending for ever."""
        from gateway.ruler.scoring import RulerService

        ruler: RulerService = self.services.extras.setdefault("ruler", RulerService(self.services))
        for attempt in range(1, JUDGE_TRIES + 1):
            self._count("judge_calls")
            try:
                await ruler.score_group(group_id, self.judge_model, None, self.judge_api_base)
            except JudgeError as exc:  # the judge's failure: worth another try; a 409 (trained, discarded) is not
                self.metrics.shadow_judge_calls.labels(outcome="failed").inc()
                if attempt == JUDGE_TRIES:
                    reason = f"{JUDGE_GAVE_UP} in {JUDGE_TRIES} tries; the last: {exc.message}"
                    if await self.services.store.give_up_shadow_group(group_id, reason):
                        raise ShadowJudgeFailed(reason) from exc
                    raise  # scored meanwhile (POST /v1/groups/{id}/ruler) or taken by a step: not ours to set aside
                log.warning("judging shadow group %s failed (try %d): %s", group_id, attempt, exc.message)
                await self._wait_to_retry(attempt)
                if not await self._still_failed(group_id):
                    return  # a client judged it meanwhile (POST /v1/groups/{id}/ruler): its scores stand
                continue
            except Exception:
                self.metrics.shadow_judge_calls.labels(outcome="failed").inc()
                raise
            self.metrics.shadow_judge_calls.labels(outcome="scored").inc()
            return

    async def _wait_to_retry(self, attempt: int) -> None:
        await asyncio.sleep(JUDGE_RETRY_S[attempt - 1])

    async def _still_failed(self, group_id: str) -> bool:
        """The group's judgement is still the failed one: not scored or being judged by a client
        meanwhile, whose judge and rubric another try of ours would overwrite."""
        group = await read_within(self.services.store, self.services.store.get_group, group_id)
        return group.get("ruler_status") == "failed"


async def _unless_stale(call: Awaitable[Completion], stale: Callable[[], bool], gate: Any) -> Completion | None:
    """`call`'s completion, or None once `stale()` first, or `CalledOff` once `gate` starts closing
    (None: a sample asked again, not called off again): the handover to a colocated trainer waits for
    the calls inside, and a shadow may sample for as long as its answers are, so it leaves at once
    (the engine call is cancelled: the local engine drops the job, vLLM the request)."""
    task = asyncio.ensure_future(call)
    # Not called off: a closing that never comes, so the wait below still wakes to look at staleness.
    closing = asyncio.ensure_future(gate.closing() if gate is not None else asyncio.Event().wait())
    try:
        while not task.done():
            await asyncio.wait({task, closing}, timeout=STALE_POLL_S, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                break
            if closing.done() or stale():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                if closing.done():
                    raise CalledOff()
                return None
        return task.result()
    finally:
        task.cancel()  # cancelled ourselves (shutdown): the engine call goes too
        closing.cancel()


class CalledOff(Exception):
    """The gate closed while a shadow sampled: it leaves the engine and is sampled again later."""


class ShadowJudgeFailed(RLProxyError):
    """A shadow group's judge failed on every try; the group is set aside as failed."""
