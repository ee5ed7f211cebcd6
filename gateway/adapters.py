"""Which adapter answers a request: model names, steps, and the hot-swap.

Served names: `NAME` (the newest loaded step), `NAME@N` (any step with a step row: loaded on demand
if it is not loaded, ART's convention) and the base model's id (no adapter). Engines without adapters
(`openai`) pass every name through unchanged. Before any step is loaded `NAME` is the base model
(step None), or, with `--init-from`, a 503 until step 0 is loaded (`loading`).

The hot-swap, driven by the store (the trainer's only channel to the gateway):

1. every `poll_interval` the registry reads NAME's recent `steps` rows;
2. a new step N is loaded as `NAME@N` from its checkpoint path (checked: inside `settings.models_dir`);
3. only once the load succeeded does the alias `NAME` move to N. Resolving a name and moving the alias both run on
   the event loop with no `await` between, so a request sees either the old step or the new one, never a half-state;
4. requests in flight keep the adapter they started with (`hold` counts them per step); beyond `keep_adapters`
   loaded steps, the least recently used ones (never the one the alias points at) are unloaded once nothing uses
   them, with the copy of their files fetched from a PostgreSQL store. A request for an unloaded `NAME@N` loads it
   again (`ensure`), so a pinned old step answers, only slower once.

A failed load is logged, leaves the previous step serving, and is retried next poll.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.engines.base import Engine
from gateway.errors import Conflict, NotFound
from gateway.pinned import load_failure, no_such_step, pinned_step
from gateway.promotion.serving import NOT_SERVED, follow_serving_step, pinned_steps, refuse_before_step_0
from gateway.settings import Settings
from gateway.store import Store
from gateway.store.files import fetched_dir
from gateway.store.waits import read_within
from gateway.tasks import stop_task

if TYPE_CHECKING:
    from gateway.promotion.canary import Canary

log = logging.getLogger("rlproxy.adapters")

# A step is unloaded only if no request resolved it for this long: a stream resolves
# its target before it starts holding it (headers go out first), and that gap must
# never see its adapter vanish.
_UNLOAD_GRACE_SECONDS = 2.0


@dataclass(frozen=True)
class Target:
    """Where one request goes."""

    model: str  # what the engine is asked for (body["model"])
    adapter: str | None  # adapter name such as "agent@3"; None = base model / upstream
    step: int | None  # the step that will answer; None for the base model or an upstream


class AdapterPathError(Exception):
    """A step row names a checkpoint outside the models directory."""


def checked_adapter_path(raw_path: str, models_dir: Path) -> Path:
    """The step row's checkpoint path, resolved, if it lies inside `models_dir`.

    Step rows are written by the trainer, another process (possibly another machine
    sharing the store): a path from there never reaches the engine unchecked.
    """
    path = Path(raw_path).resolve()
    root = Path(models_dir).resolve()
    if not path.is_relative_to(root):
        raise AdapterPathError(f"checkpoint path {raw_path!r} is outside the models directory {root}")
    return path


class AdapterRegistry:
    """Maps requested model names to loaded adapters, keeps track of use, hot-swaps."""

    def __init__(self, engine: Engine, store: Store, settings: Settings):
        self.engine = engine
        self.store = store
        self.settings = settings
        self.name = settings.model_name
        self.loaded: dict[int, str] = {}  # step -> adapter name
        self.on_demand: set[int] = set()  # loaded only where calls for NAME@N went (`Engine.partial_loads`)
        self.current: int | None = None  # step the alias NAME points at
        self.in_flight: dict[int, int] = {}  # step -> requests using it
        self.load_errors: dict[int, str] = {}  # step -> why its last load failed (cleared on success)
        self.swaps = 0  # times the alias moved (for /metrics and tests)
        self.turned_down: set[int] = set()  # steps rejected or rolled back: unloaded once idle
        self.started, self.policy_mismatch = time.time(), None  # a trainer under another --promote (promotion.serving)
        self._last_resolved: dict[int, float] = {}  # step -> monotonic time a request last resolved it
        self._lock = asyncio.Lock()  # one refresh at a time (poll loop, start, activate)
        self._task: asyncio.Task | None = None
        self.canary: Canary | None = None  # --promote canary (gateway.promotion.canary): its share of NAME
        self.trainer_child: Callable[[], Any] = lambda: None  # `serve --trainer auto`'s, set by create_app

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Load what the store already has (a restart serves the newest step at once),
        then watch the store for new steps."""
        if not self.engine.supports_adapters:
            return
        try:
            await self.refresh()
            await asyncio.to_thread(_forget_copies_of_a_previous_run, self)
        except Exception:  # a store or engine hiccup at start must not stop the gateway
            log.exception(
                "loading the trained adapters at start failed; retrying every %.1f s", self.settings.poll_interval
            )
        self._task = asyncio.create_task(self._poll(), name="rlproxy-adapter-poll")

    async def close(self) -> None:
        await stop_task(self._task)
        self._task = None

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.settings.poll_interval)
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop outlives any one failure
                log.exception("adapter refresh failed; retrying in %.1f s", self.settings.poll_interval)

    # ------------------------------------------------------------------ hot-swap

    async def refresh(self) -> None:
        """One look at the store: load new steps, move the alias, unload idle old ones."""
        rows = await read_within(self.store, self.store.recent_steps, self.name, self.settings.keep_adapters)
        async with self._lock:
            newest = sorted(rows, key=lambda row: row["step"])[-self.settings.keep_adapters :]
            for row in newest:
                step = row["step"]
                if self.loaded_everywhere(step) or row.get("state") in NOT_SERVED:
                    continue
                if self.current is not None and step < self.current and self.loaded:
                    continue  # older than what serves now: not worth loading after the fact
                if await self._load(step, row["path"]):
                    self._point_alias_at(step)
            await follow_serving_step(self, rows)
            await self._unload_idle()

    async def activate(self, step: int) -> bool:
        """Load step `step` now (if needed) and point NAME at it if it is the newest.
        For callers that know a step just landed (the colocated-GPU hand-back)."""
        rows = [row for row in await asyncio.to_thread(self.store.steps, self.name) if row["step"] == step]
        if not rows:
            log.warning("step %s of %s has no step row; nothing to load", step, self.name)
            return False
        async with self._lock:
            if not self.loaded_everywhere(step) and not await self._load(step, rows[0]["path"]):
                return False
            self._point_alias_at(step, rows[0].get("state"))
            await self._unload_idle()
        return True

    async def _load(self, step: int, raw_path: str, on_demand: bool = False) -> bool:
        adapter = f"{self.name}@{step}"
        load = self.engine.load_adapter_on_demand if on_demand else self.engine.load_adapter
        try:
            # Where the files travel in the store (PostgreSQL), fetched here first; else the path as recorded.
            fetch = self.store.fetch_step_files
            raw_path = await asyncio.to_thread(fetch, self.name, step, raw_path, self.settings.models_dir)
            path = checked_adapter_path(raw_path, self.settings.models_dir)
            started = time.perf_counter()
            try:
                await load(adapter, path)
            except Conflict:
                # Already in the engine under this name (loaded by another path): same files.
                log.info("adapter %s was already loaded in the engine", adapter)
        except Exception as exc:  # noqa: BLE001 - any failure: keep serving the previous step
            message = f"{type(exc).__name__}: {getattr(exc, 'message', None) or exc}"
            if self.load_errors.get(step) != message:  # once per distinct failure, not every poll
                log.warning(
                    "loading %s failed (%s); still serving step %s, retrying every %.1f s",
                    adapter,
                    message,
                    self.current,
                    self.settings.poll_interval,
                )
            self.load_errors[step] = message
            return False
        self.load_errors.pop(step, None)
        self.loaded[step] = adapter
        if on_demand and self.engine.partial_loads:
            self.on_demand.add(step)
        else:
            self.on_demand.discard(step)
        self._last_resolved[step] = time.monotonic()  # a fresh load is a use: LRU keeps it
        log.info("loaded %s in %.2f s", adapter, time.perf_counter() - started)
        return True

    def _point_alias_at(self, step: int, state: str | None = None) -> None:
        # No await between check and write: atomic on this loop. A candidate serves only once promoted.
        if state not in NOT_SERVED and (self.current is None or step > self.current):
            previous, self.current = self.current, step
            self.swaps += 1
            log.info("%s now serves step %d (was %s)", self.name, step, previous)

    async def _unload_idle(self) -> None:
        keep = _keep(self)
        now = time.monotonic()
        for step in sorted(self.loaded):
            if step in keep or self.in_flight.get(step, 0) > 0:
                continue  # busy ones are retried on the next refresh
            if now - self._last_resolved.get(step, float("-inf")) < _UNLOAD_GRACE_SECONDS:
                continue
            adapter = self.loaded.pop(step)  # new requests for NAME@step now get a 404
            self.on_demand.discard(step)
            try:
                await self.engine.unload_adapter(adapter)
            except NotFound:
                pass  # already gone: nothing to release
            except Exception:  # noqa: BLE001 - keep it addressable and try again next time
                log.exception("unloading %s failed; will retry", adapter)
                self.loaded[step] = adapter
                continue
            self._last_resolved.pop(step, None)
            await asyncio.to_thread(self.store.forget_step_files, self.name, step, self.settings.models_dir)
            log.info("unloaded %s", adapter)

    async def ensure(self, requested: str, everywhere: bool = False) -> None:
        """Make `NAME@N` servable: load step N on demand if it has a step row and is not
        loaded (bounded by `keep_adapters`: the least recently used idle step goes). 404
        with the steps there are when there is no step N. Other names: nothing to do.
        Engine replicas load it where a call for it goes, or on every one (`everywhere`)."""
        step = pinned_step(self, requested)
        if step is None or (self.loaded_everywhere(step) if everywhere else step in self.loaded):
            return
        rows = {row["step"]: row for row in await read_within(self.store, self.store.steps, self.name)}
        if step not in rows:
            raise await no_such_step(self, requested, rows)
        async with self._lock:
            loaded = self.loaded_everywhere(step) if everywhere else step in self.loaded
            if not loaded and not await self._load(step, rows[step]["path"], not everywhere):
                raise await load_failure(self, requested, step, rows)
            self._last_resolved[step] = time.monotonic()
            await self._unload_idle()
        log.info("loaded %s on demand", requested)

    def loaded_everywhere(self, step: int) -> bool:
        """Loaded, and not only where calls for it went: fit to serve as NAME (or a canary's share)."""
        return step in self.loaded and step not in self.on_demand

    def status(self) -> dict:
        """What the registry serves, for health checks and logs."""
        return {
            "model": self.name,
            "current_step": self.current,
            "loaded_steps": sorted(self.loaded),
            "in_flight": {step: n for step, n in self.in_flight.items() if n},
            "load_errors": dict(self.load_errors),
        }

    # ------------------------------------------------------------------ names

    def served_names(self) -> list[str]:
        if not self.engine.supports_adapters:
            return []
        names = [f"{self.name}@{step}" for step in sorted(self.loaded)]
        return [self.name, *names]

    def resolve(self, requested: str, key: str | None = None) -> Target:
        target = self._resolve(requested)  # `key`: its harness group, else session (--promote canary routes by it)
        if key is not None and self.canary is not None and requested == self.name:
            target = self.canary.route(key, target)
        if target.step is not None:
            self._last_resolved[target.step] = time.monotonic()
        return target

    def _resolve(self, requested: str) -> Target:
        if not self.engine.supports_adapters:
            return Target(model=requested, adapter=None, step=None)
        if requested == self.engine.base_model_id:
            return Target(model=requested, adapter=None, step=None)
        if requested == self.name:
            if self.current is None:
                refuse_before_step_0(self)  # --init-from: step 0 is another adapter, not the base model
                # No adapter yet: the untrained LoRA equals the base model (B = 0).
                return Target(model=self.engine.base_model_id, adapter=None, step=None)
            return Target(model=self.loaded[self.current], adapter=self.loaded[self.current], step=self.current)
        if requested.startswith(self.name + "@"):
            step = pinned_step(self, requested)
            if step is not None and step in self.loaded:
                return Target(model=requested, adapter=self.loaded[step], step=step)
            raise NotFound(
                f"model '{requested}' is not loaded; loaded: {', '.join(self.served_names()) or 'none'} "
                f"(any step with a checkpoint loads on demand: `{self.name}@N`)",
                param="model",
                code="model_not_found",
            )
        raise NotFound(
            f"model '{requested}' not found; this gateway serves "
            f"{', '.join([*self.served_names(), self.engine.base_model_id])}",
            param="model",
            code="model_not_found",
        )

    def use(self, requested: str, key: str | None = None) -> _Held:
        """`async with registry.use(name) as target:` resolve a name (loading a pinned step on
        demand) and hold the adapter loaded while the request runs."""
        return _Held(self, requested=requested, key=key)

    def hold(self, target: Target) -> _Held:
        """`async with registry.hold(target):` keep an already resolved target's adapter loaded
        while the request runs."""
        return _Held(self, target=target)

    def _take(self, target: Target) -> None:
        if target.step is not None:
            self.in_flight[target.step] = self.in_flight.get(target.step, 0) + 1

    def _release(self, target: Target) -> None:
        if target.step is not None:
            self.in_flight[target.step] -= 1


def _forget_copies_of_a_previous_run(registry: AdapterRegistry) -> None:
    """The steps' files a previous run of this gateway fetched from a PostgreSQL store and still held
    when it stopped (nothing unloads them then) go, but those loaded now: else every restart left
    `--keep-adapters` copies (optimizer state included) on the disk for good. The state dir is this
    gateway's own (deploy/README.md)."""
    root = fetched_dir(registry.settings.models_dir, registry.name, 0).parent
    for entry in root.iterdir() if root.is_dir() else ():
        if entry.name.isascii() and entry.name.isdigit() and int(entry.name) not in registry.loaded:
            registry.store.forget_step_files(registry.name, int(entry.name), registry.settings.models_dir)


def _keep(registry: AdapterRegistry) -> set[int]:
    """Steps that stay loaded: the serving one, a candidate, then the most recently used not turned down."""
    keep = pinned_steps(registry)
    others = set(registry.loaded) - registry.turned_down
    by_recency = sorted(others, key=lambda s: (registry._last_resolved.get(s, float("-inf")), s), reverse=True)
    for step in by_recency:
        if len(keep) >= registry.settings.keep_adapters:
            break
        keep.add(step)
    return keep


class _Held:
    """An adapter held for one request (`AdapterRegistry.use` and `hold`). A class rather than an
    `asynccontextmanager`: every call goes through it, and an async generator costs six times
    as much to enter and leave."""

    __slots__ = ("_key", "_registry", "_requested", "_target")

    def __init__(
        self,
        registry: AdapterRegistry,
        *,
        requested: str | None = None,
        target: Target | None = None,
        key: str | None = None,
    ):
        self._registry = registry
        self._requested = requested
        self._target = target
        self._key = key

    async def __aenter__(self) -> Target:
        registry = self._registry
        if self._target is None:
            await registry.ensure(self._requested)
            self._target = registry.resolve(self._requested, self._key)
        registry._take(self._target)
        return self._target

    async def __aexit__(self, *exc_info) -> None:
        self._registry._release(self._target)
