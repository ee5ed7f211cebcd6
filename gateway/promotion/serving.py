"""Which step NAME serves: the store's serving step, followed by the adapter registry; before
an `--init-from` run's step 0 is loaded, none (`loading`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gateway.errors import EngineUnavailable
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


def policy_mismatch(promote: str, rows: list[dict], since: float) -> str | None:
    """Why the newest step was not recorded as this gateway's `--promote` asks, or None. The trainer
    records a step's state by its own `--promote`: `rlproxy train` run alone without the gateway's
    flag serves each step to everyone at once (no canary), or leaves candidates nothing decides."""
    newest = max(rows, key=lambda r: r["step"], default=None)
    if newest is None:
        return None
    step, policy = newest["step"], (newest.get("decision") or {}).get("policy")
    if promote == "always" and newest.get("state") == "candidate":
        return (
            f"step {step} is a candidate (its trainer runs --promote canary or manual) but this gateway runs "
            "--promote always: nothing decides it and the trainer waits on it; give the gateway and the trainer "
            f"the same --promote, or decide it (POST /v1/training/steps/{step}/promote or /reject)"
        )
    # A step 0 (the run's start) is recorded promoted under any policy, and so is a supervised step
    # (`rlproxy train --objective sft`, which takes no --promote): neither says the flags differ.
    trained = newest.get("parent") is not None and (newest.get("metrics") or {}).get("objective") != "sft"
    if promote != "always" and policy == "always" and trained and newest.get("created_at", 0) >= since:
        return (
            f"step {step} was recorded promoted by a trainer running --promote always: it serves every session at "
            f"once, not through this gateway's --promote {promote}; give `rlproxy train` the same --promote"
        )
    return None


async def follow_serving_step(registry: AdapterRegistry, rows: list[dict]) -> None:
    """NAME follows the store's serving step (its newest promoted one), backwards too (a rollback).
    A step turned down takes no new session and is unloaded once idle (no call for 2 s): a canary
    session that calls again within that finishes on it; a later call of it goes to NAME's step."""
    registry.turned_down = {row["step"] for row in rows if row.get("state") in TURNED_DOWN}
    mismatch = policy_mismatch(registry.settings.promote, rows, registry.started)
    if mismatch is not None and mismatch != registry.policy_mismatch:
        log.warning("%s", mismatch)  # once per step; /healthz shows it (promotion_mismatch)
    registry.policy_mismatch = mismatch
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


def loading(registry: AdapterRegistry) -> str | None:
    """What NAME waits for before it answers, or None once it answers. A run started with
    `--init-from` has another run's adapter as its step 0: the base model is not its policy,
    and a call it answered would be trained as if step 0 had sampled it. So NAME answers only
    once step 0 is loaded (`/healthz` says so meanwhile); a cold run's step 0 is the untrained
    LoRA, which equals the base model, and NAME is served by the base model until it loads."""
    init_from = registry.settings.init_from
    if registry.current is not None or not init_from or not registry.engine.supports_adapters:
        return None
    failed, trainer = registry.load_errors.get(0), trainer_failure(registry)
    return (
        f"loading step 0 of '{registry.name}' from --init-from {init_from}"
        + (f" (the last try failed: {failed}; retrying every {registry.settings.poll_interval:g} s)" if failed else "")
        + (f"; the trainer that saves it failed: {trainer}" if trainer is not None else "")
    )


def trainer_failure(registry: AdapterRegistry) -> str | None:
    """Why `serve --trainer auto`'s trainer is left failed (its settings refused, a crash loop: its
    `last_error`), or None: running, started again, or no trainer child (run apart, `--trainer off`)."""
    child = registry.trainer_child()
    status = child.status() if child is not None else {}
    if status.get("state") != "failed":
        return None
    return status.get("last_error") or f"exit code {status.get('last_exit')}"


def refuse_before_step_0(registry: AdapterRegistry) -> None:
    reason = loading(registry)
    if reason is None:
        return
    if trainer_failure(registry) is not None:  # step 0 will never come: "try again shortly" sent clients retrying
        raise EngineUnavailable(
            f"model '{registry.name}' does not answer: {reason}. It will not until that is fixed and the gateway "
            "restarted (GET /healthz: trainer)",
            code="trainer_failed",
        )
    raise EngineUnavailable(
        f"model '{registry.name}' does not answer yet: {reason}. The trainer saves it when it starts; "
        "try again shortly (GET /healthz says ok once it serves)",
        code="loading_step_0",
    )
