"""Which adapter answers a request: model names, steps, and the hot-swap.

Served names: `NAME` (the newest loaded step), `NAME@N` (a pinned step, while
loaded) and the base model's id (no adapter). Engines without adapters
(`openai`) pass every name through unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import AsyncIterator

from gateway.engines.base import Engine
from gateway.errors import NotFound
from gateway.settings import Settings
from gateway.store import Store

log = logging.getLogger("rlproxy.adapters")


@dataclass(frozen=True)
class Target:
    """Where one request goes."""

    model: str  # what the engine is asked for (body["model"])
    adapter: str | None  # adapter name such as "agent@3"; None = base model / upstream
    step: int | None  # the step that will answer; None for the base model or an upstream


class AdapterRegistry:
    """Maps requested model names to loaded adapters and keeps track of use."""

    def __init__(self, engine: Engine, store: Store, settings: Settings):
        self.engine = engine
        self.store = store
        self.settings = settings
        self.name = settings.model_name
        self.loaded: dict[int, str] = {}  # step -> adapter name, in load order
        self.current: int | None = None  # step the alias NAME points at
        self.in_flight: dict[int, int] = {}  # step -> requests using it
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """Load what the store already has (a restart serves the newest step at once)."""

    async def close(self) -> None:
        pass

    def served_names(self) -> list[str]:
        if not self.engine.supports_adapters:
            return []
        names = [f"{self.name}@{step}" for step in sorted(self.loaded)]
        return [self.name, *names]

    def resolve(self, requested: str) -> Target:
        if not self.engine.supports_adapters:
            return Target(model=requested, adapter=None, step=None)
        if requested == self.engine.base_model_id:
            return Target(model=requested, adapter=None, step=None)
        if requested == self.name:
            if self.current is None:
                # No adapter yet: the untrained LoRA equals the base model (B = 0).
                return Target(model=self.engine.base_model_id, adapter=None, step=None)
            return Target(model=self.loaded[self.current], adapter=self.loaded[self.current], step=self.current)
        if requested.startswith(self.name + "@"):
            suffix = requested[len(self.name) + 1 :]
            if suffix.isdigit() and int(suffix) in self.loaded:
                step = int(suffix)
                return Target(model=requested, adapter=self.loaded[step], step=step)
            raise NotFound(
                f"model '{requested}' is not loaded; loaded: {', '.join(self.served_names()) or 'none'}",
                param="model",
                code="model_not_found",
            )
        raise NotFound(
            f"model '{requested}' not found; this gateway serves "
            f"{', '.join([*self.served_names(), self.engine.base_model_id])}",
            param="model",
            code="model_not_found",
        )

    @contextlib.asynccontextmanager
    async def use(self, requested: str) -> AsyncIterator[Target]:
        """Resolve a name and hold the adapter loaded while the request runs."""
        async with self.hold(self.resolve(requested)) as target:
            yield target

    @contextlib.asynccontextmanager
    async def hold(self, target: Target) -> AsyncIterator[Target]:
        """Keep an already resolved target's adapter loaded while the request runs."""
        if target.step is not None:
            self.in_flight[target.step] = self.in_flight.get(target.step, 0) + 1
        try:
            yield target
        finally:
            if target.step is not None:
                self.in_flight[target.step] -= 1
