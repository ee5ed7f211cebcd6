"""Whether the vLLM is up, and bringing it back when it is not; putting it to sleep and waking it.

Failure: vLLM unreachable or gone mid-request is a 503 `EngineUnavailable`. A monitor watches
`/health` (and the process, when managed): a dead managed server is restarted, an attached one
is waited for, and the adapters that were loaded are loaded again before requests are let
through.

Colocated GPU: `sleep()` / `wake_up()` call vLLM's `/sleep?level=1` and `/wake_up`
(development endpoints: `VLLM_SERVER_DEV_MODE=1` and `--enable-sleep-mode`); `gateway.colocate`
drives them through the engine. A sleeping vLLM is not asked anything; only its process is
watched.
"""

from __future__ import annotations

import asyncio
import logging

from gateway.engines.vllm import logfile
from gateway.engines.vllm.adapters import VLLMAdapters
from gateway.engines.vllm.client import VLLMClient, sleep_error
from gateway.engines.vllm.server import VLLMProcess
from gateway.errors import EngineUnavailable, EngineUnreached, UpstreamError
from gateway.tasks import stop_task

log = logging.getLogger("rlproxy.engines.vllm")


class VLLMSupervisor:
    """The vLLM's state (ready, down and why, asleep on purpose), its health monitor and its restarts."""

    def __init__(
        self,
        client: VLLMClient,
        process: VLLMProcess | None,
        adapters: VLLMAdapters,
        *,
        health_interval: float,
        max_restarts: int,
    ):
        self.client = client
        self.process = process  # None: attached to a vLLM rlproxy did not start
        self.managed = process is not None
        self.adapters = adapters
        self.health_interval = health_interval
        self.max_restarts = max_restarts
        self.ready = asyncio.Event()
        self.down_reason = "vLLM is starting"
        self.asleep = False  # put to sleep on purpose (colocated training)
        self._gave_up = False  # managed vLLM failed to restart max_restarts times in a row
        self._recover_lock = asyncio.Lock()
        self._monitor: asyncio.Task | None = None
        # The recovery a lost connection began (`connection_lost`): held, so that stop() ends it
        # too; one left running restarted a managed vLLM after stop() had closed it (a process
        # nothing stops, holding the GPU), and an unreferenced task may be collected mid-way.
        self._recovery: asyncio.Task | None = None

    # ---------------------------------------------------------------- start and stop

    async def connect(self) -> None:
        """Start the managed vLLM (back when `/health` answers), or check that the attached one answers."""
        if self.managed:
            await self.process.start(self.client.healthy)
        elif not await self.client.healthy():
            raise EngineUnavailable(
                f"no vLLM answers at {self.client.url}/health; start it first (vllm serve BASE --enable-lora ...) "
                "or drop --vllm-url to let rlproxy start one"
            )

    def serve(self) -> None:
        """Let requests through, and watch the vLLM from now on."""
        self.ready.set()
        self._monitor = asyncio.create_task(self._watch(), name="rlproxy-vllm-monitor")

    async def stop(self) -> None:
        await stop_task(self._monitor)
        await stop_task(self._recovery)
        self._monitor = self._recovery = None
        self.ready.clear()
        self.down_reason = "the gateway is shutting down"
        if self.managed:
            await self.process.close()

    def check_ready(self) -> None:
        if not self.ready.is_set():
            raise EngineUnreached(f"{self.down_reason}; retry in a moment")

    # ---------------------------------------------------------------- health and restart

    async def _watch(self) -> None:
        """Notice a dead vLLM, bring it back (managed) or wait for it (attached), re-load adapters."""
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                if self.managed:  # its log grows by a line a request, the probes' included
                    await asyncio.to_thread(logfile.trim, self.process.log_path)
                if not self.ready.is_set() or not await self._alive():
                    await self.recover()
            except asyncio.CancelledError:
                raise
            except Exception:  # the monitor must outlive any one failure
                log.exception("vLLM monitor failed; retrying")

    async def _alive(self) -> bool:
        if self.managed and not self.process.running:
            return False
        if self.asleep:
            return True  # a sleeping vLLM is not asked anything; only its process is watched
        return await self.client.healthy()

    def mark_down(self, reason: str) -> None:
        if self.ready.is_set():
            log.warning("vLLM unavailable: %s", reason)
        self.ready.clear()
        self.down_reason = reason

    async def recover(self) -> None:
        """Bring vLLM back and re-load every adapter; requests get 503 meanwhile."""
        async with self._recover_lock:
            if await self._alive():
                if self.ready.is_set():
                    return
                # A blip (or an attached vLLM restarted between two health ticks): loads are idempotent.
            elif self.managed:
                if self._gave_up:
                    return
                code = self.process.returncode
                self.mark_down(
                    f"vLLM exited (code {code}); rlproxy is restarting it"
                    if code is not None
                    else "vLLM stopped answering /health; rlproxy is restarting it"
                )
                if self.asleep:
                    # Training has the GPU: a fresh vLLM would take it back. wake_up() restarts it.
                    return
                await self._restart()
            else:
                self.mark_down(f"vLLM at {self.client.url} does not answer; waiting for it to come back")
                return
            await self.adapters.reload_all(asleep=self.asleep)
            self.ready.set()
            log.info("vLLM is ready; %d adapter(s) loaded", len(self.adapters.paths))

    async def _restart(self) -> None:
        delay = 1.0
        for attempt in range(1, self.max_restarts + 1):
            await self.process.stop()
            try:
                await self.process.start(self.client.healthy)
                return
            except EngineUnavailable as exc:
                log.error("vLLM restart %d/%d failed: %s", attempt, self.max_restarts, exc.message)
                self.down_reason = (
                    f"vLLM failed to restart ({attempt}/{self.max_restarts}); see {self.process.log_path}"
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
        self._gave_up = True
        self.down_reason = (
            f"vLLM failed to start {self.max_restarts} times; see {self.process.log_path} and restart the gateway"
        )
        raise EngineUnavailable(self.down_reason)

    def connection_lost(self, exc: BaseException, *, answered: bool = True) -> EngineUnavailable:
        """A request lost vLLM: mark it down, start bringing it back now, and say so to the client.
        `answered`: whether any byte of the answer had come (if not: `EngineUnreached`)."""
        reason = str(exc) or type(exc).__name__
        url = self.client.url
        self.mark_down(f"lost the connection to vLLM at {url} ({reason})")
        # Do not wait for the next health tick; one recovery at a time (recover() takes turns anyway).
        if self._monitor is not None and (self._recovery is None or self._recovery.done()):
            self._recovery = asyncio.get_running_loop().create_task(
                self._recover_quietly(), name="rlproxy-vllm-recovery"
            )
        error = EngineUnavailable if answered else EngineUnreached
        when = "while answering, after its answer had begun" if answered else "before answering"
        return error(
            f"vLLM at {url} went away {when} ({reason}); "
            + ("rlproxy is restarting it" if self.managed else "waiting for it to come back")
            + " - retry in a moment"
        )

    async def _recover_quietly(self) -> None:
        try:
            await self.recover()
        except Exception:
            log.exception("vLLM recovery failed")

    # ---------------------------------------------------------------- sleep (colocated GPU)

    async def sleep(self, level: int = 1) -> None:
        """Free the GPU: level 1 offloads weights to CPU memory and drops the KV cache."""
        status, payload = await self.client.post(f"/sleep?level={level}", None)
        if status != 200:
            raise UpstreamError(sleep_error("/sleep", status, payload))
        self.asleep = True

    async def wake_up(self) -> None:
        """Take the GPU back. A managed vLLM that died while asleep is started afresh (awake)."""
        self.asleep = False
        pending = self.adapters.take_pending()
        if self.managed and not self.process.running:
            await self.recover()  # a fresh process: recover() loads every adapter
            return
        status, payload = await self.client.post("/wake_up", None)
        if status != 200:
            raise UpstreamError(sleep_error("/wake_up", status, payload))
        await self.adapters.load_named(pending)
