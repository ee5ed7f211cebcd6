"""`NAME@N`: the step a pinned name asks for, and why one cannot answer (a 404 or a 503).

Steps keep their rows when `--keep-checkpoints` removes their checkpoints, so the steps a 404
offers are those a pinned name can still load (files in a PostgreSQL store, or an adapter in
the step's checkpoint directory here), not every step recorded: a client that picked one of those got a
second 404.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.errors import EngineUnavailable, NotFound
from gateway.store.waits import read_within

if TYPE_CHECKING:
    from gateway.adapters import AdapterRegistry
    from gateway.store import Store


def ranges(steps: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8" (a message stays short after thousands of steps)."""
    if not steps:
        return "none (nothing trained yet)"
    parts, start = [], steps[0]
    for prev, cur in zip(steps, [*steps[1:], None], strict=False):
        if cur is None or cur != prev + 1:  # a run ends at prev
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)


def pinned_step(registry: AdapterRegistry, requested: str) -> int | None:
    """N of `NAME@N`; None for any other name."""
    if not registry.engine.supports_adapters or not requested.startswith(registry.name + "@"):
        return None
    suffix = requested[len(registry.name) + 1 :]
    # ASCII digits only: `str.isdigit` also takes "²" (which `int` refuses: a 500) and "٣" (which it reads as 3).
    return int(suffix) if suffix.isascii() and suffix.isdigit() else None


def loadable(store: Store, name: str, rows: dict[int, dict]) -> list[int]:
    """The steps of `rows` (step -> its row) with a checkpoint: in the store, or on this machine."""
    stored = store.stored_steps(name)
    return sorted(s for s, row in rows.items() if s in stored or Path(row["path"]).is_dir())


async def _offered(registry: AdapterRegistry, rows: dict[int, dict]) -> str:
    try:
        return ranges(await read_within(registry.store, loadable, registry.store, registry.name, rows))
    except Exception:  # noqa: BLE001 - the store is away: the steps recorded, as known
        return ranges(sorted(rows))


async def no_such_step(registry: AdapterRegistry, requested: str, rows: dict[int, dict]) -> NotFound:
    """The 404 for `NAME@N` where NAME has no step N, with the steps it has a checkpoint for."""
    return NotFound(
        f"model '{requested}' has no checkpoint: model '{registry.name}' has checkpoints for steps "
        f"{await _offered(registry, rows)}",
        param="model",
        code="model_not_found",
    )


async def load_failure(
    registry: AdapterRegistry, requested: str, step: int, rows: dict[int, dict]
) -> NotFound | EngineUnavailable:
    """Why `NAME@N` cannot answer after its load failed: a 404 where its checkpoint's files are gone from
    this machine (removed to free the disk: a 503 would have clients retry in vain), else a 503."""
    with contextlib.suppress(Exception):  # the store is away: nothing is known about the files
        fetch, models_dir = registry.store.fetch_step_files, registry.settings.models_dir
        path = Path(await asyncio.to_thread(fetch, registry.name, step, rows[step]["path"], models_dir))
        if not (path / "adapter_config.json").is_file():
            gone = f"step {step} is recorded, but its adapter files are gone from {path}"
            return NotFound(
                f"model '{requested}' has no checkpoint: {gone} (checkpoints: steps {await _offered(registry, rows)})",
                param="model",
                code="model_not_found",
            )
    why = registry.load_errors.get(step)
    return EngineUnavailable(f"loading step {step} of '{registry.name}' failed ({why}); try again")
