"""Sharing the GPU between vLLM and the trainer, and the staleness rule when they do not share.

`--gpu-mode colocated` (one GPU): serving pauses while the trainer trains.

    trainer                         store: gpu_leases row          gateway (Colocator)
    acquire_gpu_for_training() ---> idle -> requested
                                                                   hold new requests (they wait),
                                                                   drain in-flight ones,
                                                                   POST /sleep?level=1
                                    requested -> granted    <----
    (returns) train, save the
    checkpoint, insert the step row
    release_gpu(step=N)        ---> granted -> released
                                                                   POST /wake_up, load NAME@N,
                                                                   point NAME at it, release
                                    released -> idle        <----  the held requests

The store is the only channel (the trainer is another process). A trainer that dies while
holding the GPU (same machine: its pid is checked) is noticed, and serving resumes.

`--gpu-mode dedicated` (vLLM and the trainer on separate GPUs): serving never pauses; the
trainer skips groups sampled more than `--max-staleness` steps before the step it would
produce (`is_stale`). A call records the adapter step that answered it (`calls.step`,
NULL for the base model = step 0), so a group's step is the oldest among its calls
(`sampled_step(calls)`).

The trainer's API is three functions, all blocking and safe to call from any process that
opens the same store:

    from gateway.colocate import gpu_for_training
    with gpu_for_training(store, settings.model_name, timeout=600) as lease:
        ...train, save, store.insert_step(...)...
        lease.step = step          # the gateway loads NAME@step when the block exits

or `acquire_gpu_for_training(store, model, timeout)` / `release_gpu(store, model, step)`.
`needs_gpu_lease(settings)` says whether to do this at all.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.errors import EngineUnavailable
from gateway.tasks import stop_task

if TYPE_CHECKING:
    from gateway.adapters import AdapterRegistry
    from gateway.chat.gate import RequestGate
    from gateway.settings import Settings
    from gateway.store import Store

log = logging.getLogger("rlproxy.colocate")

IDLE, REQUESTED, GRANTED, RELEASED = "idle", "requested", "granted", "released"


# ---------------------------------------------------------------------------- policy


def needs_gpu_lease(settings: Settings) -> bool:
    """True when the trainer must borrow the GPU from vLLM before each step."""
    return settings.engine == "vllm" and settings.gpu_mode == "colocated"


def is_stale(group_step: int | None, current_step: int, max_staleness: int) -> bool:
    """Dedicated mode: True when a group sampled by `group_step` (None = the base model = step 0,
    which only a run's untrained LoRA equals: `trainer.selection` sets aside the base model's
    groups of a run seeded with `--init-from` first) is more than `max_staleness` steps behind
    `current_step`, the step the trainer would now produce from the newest adapter (it trains
    from step `current_step`). Such groups are skipped: their logprobs come from a policy too
    far from the one being updated for the clipped ratio to mean much."""
    return current_step - (group_step or 0) > max_staleness


RECORD_ONLY_ENGINES = frozenset({"openai"})
HANDOVER_LOG = 70  # the last ten hand-overs (seven moments each) in `Colocator.log`
"""Engines whose calls were sampled by a policy that is not ours (an upstream's): no step."""


def policy_calls(calls: Iterable[dict]) -> list[dict]:
    """The calls one of our adapters (or the base model) answered, by the engine each call
    recorded (`calls.engine`), never the reading process's own `--engine`: a trainer on
    another machine may run with any setting. Only these can be stale."""
    return [call for call in calls if call.get("engine") not in RECORD_ONLY_ENGINES]


def sampled_step(calls: Iterable[dict]) -> int:
    """The step a group (or session) was sampled by: the oldest adapter step among its
    recorded calls (`calls.step`; None = the base model = step 0). Feed it to `is_stale`."""
    return min(((call.get("step") or 0) for call in calls), default=0)


def holder_id() -> str:
    """Who holds a lease: this process, as host:pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


def holder_alive(holder: str | None) -> bool:
    """False only when the holder is a process on this host that no longer exists."""
    if not holder:
        return False
    host, _, pid = holder.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return True  # another machine: cannot tell, trust it
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------------- trainer side (blocking)


@dataclass
class TrainingLease:
    """The GPU, lent to a trainer. Set `step` to the step the trainer recorded before releasing."""

    model: str
    holder: str
    step: int | None = None


def acquire_gpu_for_training(
    store: Store, model: str, timeout: float | None = None, poll_interval: float = 0.2
) -> TrainingLease:
    """Ask the gateway for the GPU and block until it has drained and put vLLM to sleep.

    Raises `EngineUnavailable` after `timeout` seconds (None: wait forever), withdrawing the
    request. Waits first if the gateway is still taking the GPU back from a previous step.
    """
    holder = holder_id()
    deadline = None if timeout is None else time.monotonic() + timeout
    asked = False
    while True:
        lease = store.gpu_lease(model)
        state, current = lease["state"], lease["holder"]
        if state == GRANTED and current == holder:
            log.info("the gateway lent the GPU for training")
            return TrainingLease(model=model, holder=holder)
        if state == IDLE:
            asked = store.move_gpu_lease(model, REQUESTED, expect=(IDLE,), holder=holder) or asked
        elif state in (REQUESTED, GRANTED) and current != holder and not holder_alive(current):
            # A trainer that died with the request open: take its place.
            asked = (
                store.move_gpu_lease(model, REQUESTED, expect=(state,), expect_holder=current, holder=holder) or asked
            )
        if deadline is not None and time.monotonic() > deadline:
            if asked:
                store.move_gpu_lease(model, IDLE, expect=(REQUESTED,), expect_holder=holder)
            raise EngineUnavailable(
                f"the gateway did not lend the GPU within {timeout:g} s (lease is '{state}'); "
                "is `rlproxy serve --engine vllm --gpu-mode colocated` running on this store?"
            )
        time.sleep(poll_interval)


def release_gpu(store: Store, model: str, step: int | None = None, holder: str | None = None) -> bool:
    """Give the GPU back; `step` is the step row just inserted (None: nothing new to load).
    False if this process did not hold the lease (nothing changes then)."""
    moved = store.move_gpu_lease(model, RELEASED, expect=(GRANTED,), expect_holder=holder or holder_id(), step=step)
    if not moved:
        log.warning("release_gpu: this process does not hold the GPU lease of %s", model)
    return moved


@contextlib.contextmanager
def gpu_for_training(store: Store, model: str, timeout: float | None = None) -> Iterator[TrainingLease]:
    """`with gpu_for_training(store, model) as lease: ...; lease.step = N` — released on exit,
    exceptions included (with whatever `lease.step` is then)."""
    lease = acquire_gpu_for_training(store, model, timeout)
    try:
        yield lease
    finally:
        free_trainer_cache()
        release_gpu(store, model, lease.step, lease.holder)


def free_trainer_cache() -> None:
    """Give the caching allocator's blocks back before vLLM wakes: it re-maps its weights and KV
    cache into memory the trainer's freed-but-cached activations would otherwise still hold."""
    import gc
    import sys

    gc.collect()
    torch = sys.modules.get("torch")  # never import torch (and start CUDA) just for this
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def wait_for_vllm(url: str, timeout: float = 1800.0, interval: float = 2.0) -> bool:
    """Colocated trainer: block until vLLM answers `/health` (it profiles the whole GPU while it
    loads; a trainer that allocates meanwhile makes its start fail). `url`: http(s)://HOST:PORT,
    or unix:PATH for the managed vLLM's socket. False on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if _health_ok(url):
                return True
        except OSError:
            pass
        time.sleep(interval)
    return False


def _health_ok(url: str) -> bool:
    from gateway.engines.vllm.server import socket_of

    path = socket_of(url)
    if path is None:
        import urllib.request

        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as resp:
            return resp.status == 200
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(path)
        sock.sendall(b"GET /health HTTP/1.0\r\nHost: localhost\r\n\r\n")
        return sock.recv(16).split(b" ")[1:2] == [b"200"]


# ---------------------------------------------------------------------------- gateway side (async)


class Colocator:
    """Drives the gateway's half of the protocol: watches the lease and pauses serving.

    `engine` needs `sleep(level)` and `wake_up()` (the vllm engine has them); `on_trained(step)`
    loads the new adapter and points the model's name at it (`activate_step` by default).
    """

    def __init__(
        self,
        engine,
        gate: RequestGate,
        store: Store,
        model: str,
        on_trained: Callable[[int], Awaitable[None]],
        *,
        poll_interval: float = 0.5,
        sleep_level: int = 1,
    ):
        self.engine = engine
        self.gate = gate
        self.store = store
        self.model = model
        self.on_trained = on_trained
        self.poll_interval = poll_interval
        self.sleep_level = sleep_level
        self.lent = False  # vLLM is asleep for the trainer
        # (what, when): hold, drained, sleep, granted, wake, loaded, release. The last hand-overs only: a
        # colocated gateway lends the GPU at every step, for weeks.
        self.log: collections.deque[tuple[str, float]] = collections.deque(maxlen=HANDOVER_LOG)
        self._task: asyncio.Task | None = None
        self._said_cannot_sleep = False

    async def start(self) -> None:
        lease = await self._lease()
        if lease["state"] == GRANTED and holder_alive(lease["holder"]):
            # The gateway restarted while a trainer trains: vLLM must not take the GPU back yet.
            await self.hand_over(grant=False)
        self._task = asyncio.create_task(self._run(), name="rlproxy-colocator")

    async def close(self) -> None:
        await stop_task(self._task)
        self._task = None

    async def _lease(self) -> dict:
        return await asyncio.to_thread(self.store.gpu_lease, self.model)

    async def _move(self, to_state: str, expect: tuple[str, ...], **kwargs) -> bool:
        return await asyncio.to_thread(self.store.move_gpu_lease, self.model, to_state, expect=expect, **kwargs)

    def _note(self, what: str) -> None:
        self.log.append((what, time.monotonic()))

    async def _run(self) -> None:
        while True:
            try:
                await self.step_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop outlives any one failure; serving must not stay paused
                log.exception("colocation step failed")
                if not self.gate.is_open and not self.lent:
                    self.gate.open()
            await asyncio.sleep(self.poll_interval)

    async def step_once(self) -> str | None:
        """Look at the lease once and act; returns what was done (for tests), or None."""
        lease = await self._lease()
        state = lease["state"]
        if state == REQUESTED and not self.lent:
            if not holder_alive(lease["holder"]):
                await self._move(IDLE, (REQUESTED,), expect_holder=lease["holder"])
                return "dropped"
            await self.hand_over()
            return "lent"
        if state == RELEASED:
            await self.take_back(lease["step"])
            return "took back"
        if self.lent and (state == IDLE or (state == GRANTED and not holder_alive(lease["holder"]))):
            log.warning("the trainer holding the GPU is gone (lease '%s'); serving resumes", state)
            await self.take_back(None)
            return "recovered"
        if not self.engine.can_sleep and state == GRANTED and not holder_alive(lease["holder"]):
            await self._move(IDLE, (GRANTED,), expect_holder=lease["holder"])  # nothing was paused for it
            return "dropped"
        return None

    async def hand_over(self, *, grant: bool = True) -> None:
        """Hold new requests, drain in-flight ones, put vLLM to sleep, tell the trainer."""
        if not self.engine.can_sleep:
            # No GPU to free (a CPU vLLM) or no way to free it: the lease is granted at once and
            # serving goes on, so the trainer trains instead of waiting for a sleep that never comes.
            if not self._said_cannot_sleep:
                log.info(
                    "--gpu-mode colocated is ignored: this vLLM cannot sleep (its CPU build, or attached "
                    "without VLLM_SERVER_DEV_MODE=1 and --enable-sleep-mode); the trainer trains beside serving"
                )
                self._said_cannot_sleep = True
            if grant:
                await self._move(GRANTED, (REQUESTED,))
            return
        self._note("hold")
        log.info("lending the GPU to the trainer: holding new requests, draining %d", self.gate.in_flight)
        await self.gate.close_and_drain()
        self._note("drained")
        try:
            await self.engine.sleep(self.sleep_level)
        except Exception:
            log.exception("vLLM did not go to sleep; serving resumes and the trainer keeps waiting")
            self.gate.open()
            raise
        self.lent = True
        self._note("sleep")
        if grant and not await self._move(GRANTED, (REQUESTED,)):
            log.warning("the GPU request was withdrawn while vLLM went to sleep; taking the GPU back")
            await self.take_back(None)
            return
        self._note("granted")

    async def take_back(self, step: int | None) -> None:
        """Wake vLLM, load the new adapter, release the held requests, mark the lease idle."""
        try:
            if self.engine.can_sleep:
                await self.engine.wake_up()
                self._note("wake")
            if step is not None:
                await self.on_trained(step)
                self._note("loaded")
        except Exception:
            log.exception("taking the GPU back failed; requests are released (they may get 503 until vLLM is back)")
        finally:
            self.lent = False
            self.gate.open()
            self._note("release")
            await self._move(IDLE, (RELEASED, GRANTED, IDLE))
        log.info("serving resumed%s", f" with step {step}" if step is not None else "")


async def activate_step(registry: AdapterRegistry, model: str, step: int) -> None:
    """Load NAME@step and point NAME at it (the newest step wins), through the registry so
    its path check and its unloading of old steps apply."""
    if not await registry.activate(step):
        log.warning("step %s of %s could not be loaded; the previous step keeps serving", step, model)
