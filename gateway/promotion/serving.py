"""Which step NAME serves: the store's serving step, followed by the adapter registry."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gateway.store.steps import TURNED_DOWN

if TYPE_CHECKING:
    from gateway.adapters import AdapterRegistry

log = logging.getLogger("rlproxy.adapters")

NOT_SERVED = ("candidate", "rejected", "rolled_back")  # step states NAME never moves to by itself


def pinned_steps(registry: AdapterRegistry) -> set[int]:
    """Steps that stay loaded however long unused: the serving one and the canary's candidate (were it
    unloaded to make room, its share would fall back to the incumbent and a session could see both)."""
    candidate = registry.canary.step if registry.canary is not None else None
    return {step for step in (registry.current, candidate) if step is not None}


async def follow_serving_step(registry: AdapterRegistry, rows: list[dict]) -> None:
    """NAME follows the store's serving step (its newest promoted one), backwards too (a rollback).
    A step turned down is unloaded once idle (its canary sessions finish on it; nothing new does)."""
    registry.turned_down = {row["step"] for row in rows if row.get("state") in TURNED_DOWN}
    promoted = [row for row in rows if row.get("state") == "promoted"]
    if not promoted:
        return
    row = max(promoted, key=lambda r: r["step"])
    if row["step"] in registry.load_errors and row["step"] > (registry.current or -1):
        return  # its load failed in this refresh's loop, which retries it next poll
    if row["step"] != registry.current and (
        registry.loaded_everywhere(row["step"]) or await registry._load(row["step"], row["path"])
    ):
        log.info("%s now serves step %d (was %s): the serving step", registry.name, row["step"], registry.current)
        registry.current = row["step"]
        registry.swaps += 1
