"""Several vLLM replicas of one model behind the gateway: routing, failover, one step everywhere.

`--vllm-url` given more than once attaches to running replicas; `--vllm-replicas N` starts N
(each its own process, socket or port, log and GPUs: gateway/devices.py). Each replica is a
whole `VLLMEngine` with its own supervisor, so a replica that dies is restarted (or waited
for) and re-loads every adapter before it is ready again, exactly as a single vLLM does.

- Routing (`routing.Router`): a session's calls go to one replica, the key's rendezvous
  choice within a load bound; a call without a session (RULER's self-judge) to the least loaded.
- Failover: a replica that is down, or that answered not one byte of a call (refused, dropped
  before its status line: `EngineUnreached`), has the call sent to the key's next replica; a
  call that had started answering and then lost its replica is a 503 that says so.
- One step everywhere: `load_adapter` loads a step on every replica before it returns, and so
  before the adapter registry moves NAME; a replica whose load failed leaves rotation for that
  adapter (its `adapters.failed` says why) and is retried every health interval. A replica that
  comes back re-loads the adapters before it is ready, and takes no call for one that failed.
- Sleep and wake (colocated training): every replica sleeps and wakes with the trainer's lease.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from gateway.engines.base import Completion, Engine, EngineRequest, StreamChunk, StreamEnd
from gateway.engines.vllm.adapters import refuse_unservable_targets
from gateway.engines.vllm.engine import VLLMEngine
from gateway.engines.vllm.routing import Router
from gateway.errors import ConfigError, EngineUnavailable, EngineUnreached, RLProxyError
from gateway.tasks import stop_task

log = logging.getLogger("rlproxy.engines.vllm")


class Replica:
    """One vLLM of the set, with what the router needs to know of it."""

    def __init__(self, index: int, engine: VLLMEngine):
        self.index = index
        self.engine = engine
        self.name = f"replica-{index}"  # what rendezvous hashing scores (stable across restarts)
        self.in_flight = 0
        self.calls = 0

    def serves(self, adapter: str | None) -> bool:
        """Ready and awake, and holding `adapter` (None: the base model) or able to load it on its
        first call, as far as the gateway knows."""
        engine = self.engine
        return (
            engine.available
            and not engine.supervisor.asleep
            and (adapter is None or adapter not in engine.adapters.failed)
        )

    def status(self) -> dict:
        engine = self.engine
        state = "asleep" if engine.supervisor.asleep else "ready" if engine.available else "down"
        return {
            "replica": self.index,
            "url": engine.client.url,  # its password masked
            "state": state,
            "reason": None if state != "down" else engine.supervisor.down_reason,
            "in_flight": self.in_flight,
            "calls": self.calls,
            "adapters": sorted(engine.adapters.holds()),
            "failed_adapters": dict(engine.adapters.failed),
        }


class VLLMReplicas(Engine):
    """Replicas of one model served as one engine."""

    kind = "vllm"
    supports_adapters = True
    continuous_usage = True
    partial_loads = True

    def __init__(self, engines: list[VLLMEngine], *, routing: str = "affinity", retry_interval: float = 2.0):
        if len(engines) < 2:
            raise ConfigError("a replica set needs two vLLMs or more")
        self.replicas = [Replica(i, engine) for i, engine in enumerate(engines)]
        for engine in engines:
            engine.in_a_set = True
        self.router = Router(routing, [r.name for r in self.replicas])
        self.retry_interval = retry_interval
        self._retry: asyncio.Task | None = None

    # ---------------------------------------------------------------- what one vLLM says for all

    @property
    def base_model_id(self) -> str:
        return self.replicas[0].engine.base_model_id

    @property
    def context_length(self) -> int | None:
        return self.replicas[0].engine.context_length

    @property
    def can_sleep(self) -> bool:
        return all(r.engine.can_sleep for r in self.replicas)

    async def list_models(self) -> list[str]:
        return await self.replicas[0].engine.list_models()

    def health(self) -> str | None:
        """None while one replica can serve; else why none can."""
        if any(r.engine.available for r in self.replicas):
            return None
        return "; ".join(f"{r.name}: {r.engine.health()}" for r in self.replicas)

    def replica_states(self, model: str, current: int | None) -> list[dict]:
        states = [r.status() for r in self.replicas]
        for state in states:
            prefix = model + "@"
            steps = [int(name[len(prefix) :]) for name in state["adapters"] if name.startswith(prefix)]
            state["step"] = current if current in steps else max(steps, default=None)
        return states

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        results = await asyncio.gather(*(r.engine.start() for r in self.replicas), return_exceptions=True)
        failed = [(r, exc) for r, exc in zip(self.replicas, results, strict=True) if isinstance(exc, BaseException)]
        if failed:
            await asyncio.gather(*(r.engine.close() for r in self.replicas), return_exceptions=True)
            replica, error = failed[0]
            raise error if not isinstance(error, RLProxyError) else type(error)(f"{replica.name}: {error.message}")
        self._retry = asyncio.create_task(self._retry_failed_loads(), name="rlproxy-vllm-replica-loads")

    async def close(self) -> None:
        await stop_task(self._retry)
        self._retry = None
        await asyncio.gather(*(r.engine.close() for r in self.replicas), return_exceptions=True)

    # ---------------------------------------------------------------- calls

    def _order(self, request: EngineRequest) -> list[Replica]:
        eligible = [r.index for r in self.replicas if r.serves(request.adapter)]
        if not eligible:
            raise EngineUnavailable(self._none_serves(request.adapter))
        loads = [r.in_flight for r in self.replicas]
        return [self.replicas[i] for i in self.router.order(request.session, loads, eligible)]

    def _none_serves(self, adapter: str | None, tried: list[str] | None = None) -> str:
        reasons = tried or [
            f"{r.name} " + (f"is down ({r.engine.health()})" if not r.engine.available else f"failed to load {adapter}")
            for r in self.replicas
        ]
        return f"no vLLM replica can serve {adapter or 'the base model'}: " + "; ".join(reasons) + "; retry in a moment"

    async def complete(self, request: EngineRequest) -> Completion:
        tried: list[str] = []
        for replica in self._order(request):
            replica.in_flight += 1
            try:
                completion = await replica.engine.complete(request)
            except EngineUnreached as exc:  # not one byte came back: the next replica takes it
                tried.append(f"{replica.name}: {exc.message}")
                log.warning("%s never answered call %s; sending it on (%s)", replica.name, request.request_id, exc)
                continue
            finally:
                replica.in_flight -= 1
            replica.calls += 1
            return completion
        raise EngineUnavailable(self._none_serves(request.adapter, tried))

    async def count_tokens(self, body: dict) -> int:
        tried: list[str] = []
        for replica in self._order(EngineRequest(body=body, adapter=None, request_id="tokenize")):
            try:
                return await replica.engine.count_tokens(body)
            except EngineUnavailable as exc:  # down or unreached: any replica counts alike
                tried.append(f"{replica.name}: {exc.message}")
        raise EngineUnavailable(self._none_serves(None, tried))

    async def stream(self, request: EngineRequest) -> AsyncIterator[StreamChunk | StreamEnd]:
        tried: list[str] = []
        for replica in self._order(request):
            replica.in_flight += 1
            items = replica.engine.stream(request)
            try:
                try:
                    first = await anext(items)
                except EngineUnreached as exc:
                    tried.append(f"{replica.name}: {exc.message}")
                    log.warning("%s never answered %s; sending it on (%s)", replica.name, request.request_id, exc)
                    continue
                replica.calls += 1
                yield first
                async for item in items:
                    yield item
                return
            finally:
                replica.in_flight -= 1
                await items.aclose()
        raise EngineUnavailable(self._none_serves(request.adapter, tried))

    # ---------------------------------------------------------------- adapters: one step everywhere

    async def load_adapter(self, name: str, path: Path) -> None:
        """Load on every replica at once; returns when each has it or has failed it. Fails only when
        no replica that is up could load it (NAME then stays where it is)."""
        results = await asyncio.gather(
            *(r.engine.load_adapter(name, path) for r in self.replicas), return_exceptions=True
        )
        errors = []
        for replica, result in zip(self.replicas, results, strict=True):
            if isinstance(result, ConfigError):
                raise result  # the adapter itself is unservable: the same on every replica
            if isinstance(result, BaseException):
                replica.engine.adapters.failed.setdefault(name, str(result))
                errors.append(result)
                log.warning("%s left rotation for %s: %s (retried)", replica.name, name, result)
        if errors and not any(r.serves(name) for r in self.replicas):
            raise errors[0]

    async def load_adapter_on_demand(self, name: str, path: Path) -> None:
        """Known to every replica, loaded by none yet: a replica's first call for it gets vLLM's 404,
        loads it there (`VLLMAdapters.reload_missing`) and is sent again, so a step pinned by a few
        sessions takes a LoRA slot only on the replicas those sessions route to."""
        path = Path(path).resolve()
        refuse_unservable_targets(name, path)
        for replica in self.replicas:
            replica.engine.adapters.expect(name, path)

    async def unload_adapter(self, name: str) -> None:
        results = await asyncio.gather(*(r.engine.unload_adapter(name) for r in self.replicas), return_exceptions=True)
        for replica, result in zip(self.replicas, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("%s could not unload %s: %s", replica.name, name, result)

    async def _retry_failed_loads(self) -> None:
        while True:
            await asyncio.sleep(self.retry_interval)
            for replica in self.replicas:
                adapters = replica.engine.adapters
                if not replica.engine.available or replica.engine.supervisor.asleep:
                    continue
                for name in [n for n in adapters.failed if n in adapters.paths]:
                    try:
                        await adapters.post_load(name, adapters.paths[name])
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - still failing: stays out of rotation for it
                        log.debug("%s still cannot load %s: %s", replica.name, name, exc)
                        continue
                    if name not in adapters.paths:  # unloaded while it loaded: do not keep its LoRA slot
                        await _quietly(replica.engine.unload_adapter(name), f"{replica.name} unloading {name}")
                    else:
                        log.info("%s loaded %s and is back in rotation for it", replica.name, name)

    # ---------------------------------------------------------------- sleep (colocated GPU)

    async def sleep(self, level: int = 1) -> None:
        """Every replica frees its GPU: the lease covers them all. If one cannot, those that slept
        wake again before the error is raised, so that the replicas serve on while the trainer waits
        (a replica asleep would take no call, and nothing would wake it)."""
        results = await asyncio.gather(*(r.engine.sleep(level) for r in self.replicas), return_exceptions=True)
        errors = [result for result in results if isinstance(result, BaseException)]
        if errors:
            slept = [
                r for r, result in zip(self.replicas, results, strict=True) if not isinstance(result, BaseException)
            ]
            await asyncio.gather(*(_quietly(r.engine.wake_up(), f"{r.name} waking up") for r in slept))
            raise errors[0]

    async def wake_up(self) -> None:
        await _all(r.engine.wake_up() for r in self.replicas)

    async def is_sleeping(self) -> bool:
        return all([await r.engine.is_sleeping() for r in self.replicas])


async def _quietly(call, what: str) -> None:
    """Await `call`; a failure is logged, not raised (undoing a step of something that failed)."""
    try:
        await call
    except Exception as exc:  # noqa: BLE001 - logged: the caller is already handling a failure
        log.warning("%s failed: %s", what, exc)


async def _all(calls) -> None:
    """Await every call; the first failure is raised after all have finished."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
