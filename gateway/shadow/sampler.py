"""The shadow sampler: an observer of committed calls that shadows some of them in the background.

It is called with every committed call (the chat service's observers), after the client's
answer is on disk and on its way: it only decides and schedules, so a live call is never
delayed. In the background each shadow waits for a quiet engine (no live call in it: shadows
yield to live load), asks the engine for K completions from the step that answered the live
call, records the group (gateway.store.rows.insert_shadow_group) and has RULER judge it; the
scores become the sessions' rewards and the trainer takes the group like any other. At most
`--shadow-max-in-flight` live calls are shadowed at once; a call arriving when that many are
is not shadowed (counted as dropped), so shadows never pile up behind live traffic.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from typing import Any

from gateway.engines.base import EngineRequest
from gateway.errors import RLProxyError
from gateway.metrics import Metrics
from gateway.settings import Settings
from gateway.shadow.calls import generated_tokens, shadow_body, shadow_calls, why_not_shadowed
from gateway.store import CallRecord

log = logging.getLogger("rlproxy.shadow")

QUIET_POLL_S = 0.01
MAX_WAIT_S = 30.0
"""A shadow that finds the engine busy this long is given up (counted as dropped: busy)."""
SAMPLE_TIMEOUT_S = 300.0
"""A shadow the engine kept setting aside for live calls this long is given up too (dropped: busy)."""


class ShadowSampler:
    def __init__(self, services: Any, settings: Settings, metrics: Metrics, seed: int | None = None):
        self.services = services
        self.k = settings.shadow_samples
        self.rate = settings.shadow_rate
        self.cap = settings.shadow_max_in_flight
        self.judge_model = str(settings.shadow_judge_model)
        self.judge_api_base = settings.shadow_judge_api_base
        self.metrics = metrics
        self.rng = random.Random(seed)
        self.in_flight = 0  # live calls being shadowed (waiting, sampling, recording or judged)
        self.sampling = 0  # shadow engine calls inside the gate right now
        self.tasks: set[asyncio.Task] = set()
        # What the dashboard shows (the same as /metrics' counters, for this process).
        self.counts = {"shadowed": 0, "completed": 0, "dropped": 0, "failed": 0, "tokens": 0, "judge_calls": 0}

    def __call__(self, record: CallRecord) -> None:
        """The chat service's observer: schedule shadows of `record` if it is a live call to shadow."""
        if why_not_shadowed(record) is not None or self.rng.random() >= self.rate:
            return
        if self.in_flight >= self.cap:
            self._count("dropped", reason="cap")
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

    async def stop(self) -> None:
        """Cancel what is still running (the gateway is shutting down): a shadow group not
        judged yet is simply never trained."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _shadow(self, live: CallRecord) -> None:
        try:
            if not await self._quiet_engine():
                self._count("dropped", reason="busy")
                return
            sampled = await self._sample(live)
            if sampled is None:
                return
            group_id = await self.services.store.record_shadow_group(sampled)
            await self._judge(group_id)
            self._count("completed")
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            self._count("dropped", reason="busy")
        except Exception as exc:  # a shadow's failure never reaches a client; it is counted and logged
            self._count("failed")
            message = exc.message if isinstance(exc, RLProxyError) else f"{type(exc).__name__}: {exc}"
            log.warning("shadow samples of call %s failed: %s", live.id, message)

    async def _quiet_engine(self) -> bool:
        """Wait until no live call is in the engine (shadows yield to live load); False if it never is."""
        gate = self.services.chat.gate
        deadline = time.monotonic() + MAX_WAIT_S
        while gate.in_flight - self.sampling > 0 or not gate.is_open:
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(QUIET_POLL_S)
        return True

    async def _sample(self, live: CallRecord) -> list[CallRecord] | None:
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
                )
                completion = await asyncio.wait_for(chat.engine.complete(request), SAMPLE_TIMEOUT_S)
            finally:
                self.sampling -= 1
        if completion.tokens is None:
            raise RLProxyError("the engine returned no token ids for the shadow samples")
        tokens = generated_tokens(completion.tokens)
        self._count("tokens", tokens)
        self.metrics.shadow_tokens.inc(tokens)
        return shadow_calls(live, completion.response, completion.tokens, (time.perf_counter() - started) * 1000.0)

    async def _judge(self, group_id: str) -> None:
        from gateway.ruler.scoring import RulerService

        ruler: RulerService = self.services.extras.setdefault("ruler", RulerService(self.services))
        self._count("judge_calls")
        try:
            await ruler.score_group(group_id, self.judge_model, None, self.judge_api_base)
        except Exception:
            self.metrics.shadow_judge_calls.labels(outcome="failed").inc()
            raise
        self.metrics.shadow_judge_calls.labels(outcome="scored").inc()
