"""Which groups make the next step: claimed, those that cannot teach set aside, then enough.

Ready groups are claimed for this trainer (several trainers on one store take disjoint
groups). A group without a reward spread never teaches anything, and one sampled more than
`--max-staleness` steps before the step being trained from is too far off-policy for the
importance weights to correct: both are marked skipped at once and do not count towards
`groups_per_step`. A step starts with `groups_per_step` groups, or earlier with what there
is when a trigger asks for one.
"""

from __future__ import annotations

import logging
import os
import socket

from gateway.settings import Settings
from gateway.store import Store
from gateway.store.lineage import further_than
from trainer.attempts import Attempts
from trainer.data import NO_SPREAD, sampling_step, spread_groups, too_few, trained_sessions

log = logging.getLogger("rlproxy.trainer")

HOLDER = f"{socket.gethostname()}:{os.getpid()}"
"""This trainer, in claims on a shared store."""


def without_spread(store: Store, ready: list[dict]) -> tuple[list[dict], int]:
    """The full groups of `ready` that have a reward spread, and how many were marked skipped.
    A group is skipped only if its rewards are still those read here (decided under the lock a
    reward takes): one a reward changed meanwhile is neither kept nor skipped now, so the next
    screen sees that reward; a reward after the skip is refused (409), never taken and ignored."""
    keep, drop = spread_groups([store.get_group(g["id"]) for g in ready])
    if not drop:
        return keep, 0
    skipped: list[str] = []
    for group in drop:  # a group of one has no spread either, but the reason to give is its size
        sessions = len(trained_sessions(group))
        if sessions < 2:
            skipped += store.skip_if_unchanged([group], too_few(sessions, len(group["sessions"])))
    skipped += store.skip_if_unchanged([g for g in drop if len(trained_sessions(g)) >= 2], NO_SPREAD)
    if skipped:
        log.info("skipped %d group(s) with no reward spread", len(skipped))
    if len(skipped) < len(drop):
        log.info("%d group(s) changed while screened: screened again next time", len(drop) - len(skipped))
    return keep, len(skipped)


def without_stale(store: Store, settings: Settings, groups: list[dict], next_step: int) -> tuple[list[dict], int]:
    """`groups` less those sampled more than `max_staleness` steps before the step this
    worker trains from (`next_step - 1`), and how many were marked skipped. Decided per group
    by the engine each of its calls recorded, not this trainer's `--engine`: calls of an
    engine that serves our adapters (local keeps serving while it trains, vLLM in dedicated
    mode too) have a step; an `openai` upstream's policy is not ours, so its calls have none
    and a group of them is never stale. Only answered calls count: a refused one has no step.
    A call the base model answered (step None) was sampled by step 0 only where step 0 is the
    untrained LoRA; after `--init-from`, step 0 is another adapter and no step sampled it."""
    from gateway.colocate import policy_calls

    current = next_step - 1
    if settings.promote != "always":  # training goes on from the serving step, not the newest
        current = store.serving_step(settings.model_name) or 0
    # Steps count along the parent chain (a rejected one never does), read only as far down as
    # the groups' steps ask: reading every step row cost each poll more the longer the run.
    parents = store.step_parents(settings.model_name)
    seeded = store.seeded_from(settings.model_name)  # one row: this runs at every poll while groups gather
    fresh, stale = [], {}
    for group in groups:
        calls = policy_calls(
            c for s in group["sessions"] for c in store.session_calls(s["id"]) if c.get("status") == "ok"
        )
        sampled_by = sampling_step(calls)
        if seeded is not None and any(c.get("step") is None for c in calls):
            stale[group["id"]] = (
                f"answered by the base model, not by a step of this run: its step 0 is the adapter of "
                f"--init-from {seeded}"
            )
        elif calls and further_than(parents, current, sampled_by, settings.max_staleness):
            stale[group["id"]] = f"stale: sampled by step {sampled_by}, training from step {current}"
        else:
            fresh.append(group)
    for gid, reason in stale.items():
        store.mark_skipped([gid], reason)
    if stale:
        log.info(
            "skipped %d group(s) sampled more than %d steps ago or by the base model",
            len(stale),
            settings.max_staleness,
        )
    return fresh, len(stale)


def enough_for_a_step(
    store: Store, settings: Settings, model: str, groups: list[dict], next_step: int
) -> list[dict] | None:
    """The groups of step `next_step` out of `groups`, or None while there are too few and
    no trigger asks for a step."""
    wanted = settings.groups_per_step
    if len(groups) >= wanted:
        store.consume_triggers(model)  # this step answers any pending ask too
        return groups[:wanted]
    # A trigger is consumed only when it can be honoured (>= 1 group): one posted
    # before any group is ready fires as soon as one is.
    if groups and store.consume_triggers(model):
        log.info("training step %d now: asked for by a trigger", next_step)
        return groups
    return None


def next_groups(
    store: Store, settings: Settings, model: str, attempts: Attempts, next_step: int
) -> tuple[list[dict] | None, int]:
    """The groups of step `next_step` (None while there are too few), and how many were marked
    skipped on the way: ready groups without a reward spread, or sampled too long ago, are set
    aside at once, so they do not count towards `groups_per_step`. A failed batch's halves
    (`attempts`) come before anything new."""
    skipped = 0
    while (half := attempts.next_half()) is not None:
        # Each half that trains advances the step: the next one is screened as the first selection was.
        half, stale = without_stale(store, settings, half, next_step)
        skipped += stale
        if half:
            return half, skipped
    ready = store.claim_groups(model, HOLDER)  # several trainers take disjoint groups
    if not ready:
        return None, skipped
    keep, no_spread = without_spread(store, ready)
    keep, stale = without_stale(store, settings, keep, next_step)
    skipped += no_spread + stale
    keep, suspect = attempts.screen(keep)
    if suspect is not None:
        return [suspect], skipped
    return enough_for_a_step(store, settings, model, keep, next_step), skipped
