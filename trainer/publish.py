"""One step, from the groups chosen to a recorded step: train, checkpoint, record.

`plan_step` turns the groups into samples cut to rows (the groups that cannot be trained
whole are marked skipped), a live turn that trains in two groups weighed once
(`shared_turn_weights`). `train_and_record` trains in memory, writes checkpoint `NNNN/`
and inserts the step row with its groups marked trained; whatever stops it half-way (an
error, a discard of one of its sessions) puts the weights back as they were and removes a
checkpoint already written, so nothing is published and the next attempt starts from the
same adapter. With `--engine vllm --gpu-mode colocated` the step runs inside `gpu_lease`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.errors import Conflict
from gateway.settings import Settings
from gateway.store import Store
from gateway.store.rows import shadow_call_id
from gateway.store.steps import TURNED_DOWN
from trainer import checkpoints as ckpts
from trainer.data import Batch, Render, build_batch, token_budget

if TYPE_CHECKING:  # the backend (torch) and the GPU lease are imported when needed
    from gateway.colocate import TrainingLease
    from trainer.backends.base import TrainingBackend
    from trainer.resume import SaveCheckpoint
    from trainer.types import Sample

log = logging.getLogger("rlproxy.trainer")

GPU_LEASE_TIMEOUT = 600.0
"""Seconds to wait for the gateway to drain and lend the GPU before postponing a step."""


@dataclass(frozen=True)
class StepPlan:
    """What a step trains on, before it trains."""

    step: int
    """The step being trained."""
    started: float
    """`time.perf_counter()` when the step began (its `seconds` metric counts from here)."""
    groups: list[dict]
    """The groups chosen (`Store.get_group` dicts), skipped ones included."""
    trained_groups: list[str]
    """Ids of the groups trained: those chosen less those skipped."""
    sessions: dict[str, list[str]]
    """Group id -> the ids of its sessions trained."""
    samples: list[Sample]
    """The samples, each fitting one row (empty: nothing to train)."""
    cut: int
    """Samples longer than a row, trained on their first `max_tokens_per_row` tokens."""
    skipped: int
    """Groups marked skipped while planning (too long, no trainable tokens)."""
    token_budget: int
    """The largest `max_tokens` the trained groups' calls asked for (`--default-max-tokens`
    for a call that set none): dr_grpo's budget when this is the run's first step."""
    greedy_calls: int = 0
    """Calls of the trained groups left untrained as greedy (`trainer.retries.GREEDY`)."""
    rewards: list[float] = field(default_factory=list)
    """Rewards of the sessions trained (`reward_mean` counts these only)."""
    advantages: dict[str, float] = field(default_factory=dict)
    """Session id -> the advantage it trained with, recorded with the step."""
    left_out: dict[str, str] = field(default_factory=dict)
    """Session id (of a trained group) -> why it left its group untrained, recorded with the step."""
    shared_turns: int = 0
    """Live turns trained here at a weight below 1 because they train in a second group too."""
    parent: int | None = None
    """The step whose adapter the weights hold as it trains (recorded as its parent)."""


def plan_step(
    store: Store, settings: Settings, render: Render, groups: list[dict], step: int, parent: int | None = None
) -> StepPlan:
    """The samples of `groups` for step `step`, with advantages over exactly the sessions
    that train (`trainer.data.build_batch`); the groups left with nothing to compare are
    marked skipped in the store."""
    started = time.perf_counter()
    calls = {s["id"]: store.session_calls(s["id"]) for g in groups for s in g["sessions"]}

    def batch_with(weights: dict[str, float] | None = None) -> Batch:
        return build_batch(
            groups,
            calls,
            scale_rewards=settings.scale_rewards,
            render=render,
            max_tokens_per_row=settings.max_tokens_per_row,
            call_weights=weights,
        )

    batch = batch_with()
    weights = shared_turn_weights(store, groups, batch, calls)
    if weights:  # the same samples, groups and advantages again: weights decide none of them
        batch = batch_with(weights)
        log.info(
            "step %d: %d live turn(s) also trained in a second group, weighed %s",
            step,
            len(weights),
            ", ".join(f"{w:g}" for w in sorted(set(weights.values()))),
        )
    if batch.cut:
        log.warning(
            "step %d: %d sample(s) longer than a row of %d tokens: trained on their first %d tokens; raise "
            "--max-tokens-per-row, up to the base model's context (the log at start says when that is the "
            "shorter), to train them whole",
            step,
            batch.cut,
            settings.max_tokens_per_row,
            settings.max_tokens_per_row,
        )
    for reason, n in Counter(batch.left_out.values()).items():
        log.info("step %d: %d session(s) left their group before advantages, %s", step, n, reason)
    group_of = {s["id"]: g["id"] for g in groups for s in g["sessions"]}
    for reason in set(batch.skipped.values()):
        ids = [gid for gid, r in batch.skipped.items() if r == reason]
        left_out = {sid: why for sid, why in batch.left_out.items() if group_of[sid] in ids}
        store.mark_skipped(ids, reason, left_out)
    trained = set(batch.group_ids)
    return StepPlan(
        step=step,
        parent=parent,
        started=started,
        groups=groups,
        trained_groups=batch.group_ids,
        sessions=batch.sessions,
        samples=batch.samples,
        cut=batch.cut,
        skipped=len(batch.skipped),
        greedy_calls=batch.greedy_calls,
        rewards=batch.rewards,
        advantages=batch.advantages,
        left_out={sid: reason for sid, reason in batch.left_out.items() if group_of[sid] in trained},
        shared_turns=len(weights),
        token_budget=token_budget(
            [c for g in groups if g["id"] in trained for s in g["sessions"] for c in calls.get(s["id"], [])],
            default=settings.default_max_tokens,
        ),
    )


SHARED_WEIGHT = 0.5
"""The weight of each of a live turn's two occurrences when its two groups train in one step."""


def shared_turn_weights(
    store: Store, groups: list[dict], batch: Batch, calls: dict[str, list[dict]]
) -> dict[str, float]:
    """Call id -> loss weight (only those below 1) of the live turns this step trains that train
    in a second group too. With live groups and shadow samples both on, a shadowed live call is
    in its live group (the real reward) and, as the copy of the live answer (`shadow_call_id`
    index 0), in its shadow group (the judge's ranking): two unbiased estimates, and a turn
    trained at full weight in both would count double. So the turn weighs 1 in all: 1/2 in each
    where both groups train in this step; otherwise all of it in the one that trains first and
    0 in the later one, which keeps the turn in its group (its reward still sets the others'
    advantages) but trains nothing on it. Which trained first is in the store: a session's
    advantage is recorded when its group trains."""
    trained = {sid for ids in batch.sessions.values() for sid in ids}
    by_id = {g["id"]: g for g in groups}
    pairs: set[tuple[str, str, str, str]] = set()  # (live call, its session, the copy's call, its session)
    for gid, session_ids in batch.sessions.items():
        origin = by_id[gid].get("origin")
        shadow_of = {s["id"]: s.get("shadow_of") for s in by_id[gid]["sessions"]}
        for sid in session_ids:
            live_id = shadow_of.get(sid)
            if origin == "shadow" and live_id and any(c["id"] == shadow_call_id(live_id, 0) for c in calls[sid]):
                live = store.get_call(live_id)
                if live is not None:
                    pairs.add((live_id, live["session_id"], shadow_call_id(live_id, 0), sid))
            elif origin == "live":  # a live session's calls, each of which may have been shadowed
                for call in calls.get(sid, []):
                    copy = store.get_call(shadow_call_id(call["id"], 0))
                    if copy is not None:
                        pairs.add((call["id"], sid, copy["id"], copy["session_id"]))
    weights: dict[str, float] = {}
    for live_id, live_session, copy_id, copy_session in pairs:
        if live_session in trained and copy_session in trained:
            weights[live_id] = weights[copy_id] = SHARED_WEIGHT
        elif live_session in trained:
            weights[live_id] = 0.0 if _trained_before(store, copy_session) else 1.0
        else:
            weights[copy_id] = 0.0 if _trained_before(store, live_session) else 1.0
    return {call_id: w for call_id, w in weights.items() if w != 1.0}


def _trained_before(store: Store, session_id: str) -> bool:
    return store.get_session(session_id).get("advantage") is not None


def gpu_lease(store: Store, model: str, settings: Settings) -> contextlib.AbstractContextManager[TrainingLease | None]:
    """`--engine vllm --gpu-mode colocated`: borrow the GPU from vLLM for the step
    (`gateway.colocate`); otherwise nothing to do."""
    from gateway.colocate import gpu_for_training, needs_gpu_lease

    if needs_gpu_lease(settings):
        return gpu_for_training(store, model, timeout=GPU_LEASE_TIMEOUT)
    return contextlib.nullcontext()


def train_and_record(
    backend: TrainingBackend,
    store: Store,
    model: str,
    settings: Settings,
    plan: StepPlan,
    *,
    save: SaveCheckpoint,
    token_budget: int | None,
    skipped_groups: int,
    failed_attempts: int,
) -> dict | None:
    """Train, checkpoint, record: the step's metrics, or None if a discard took it back.
    Whatever stops it half-way (an error, a discard) puts the weights back as they were, so
    the next attempt starts from the same adapter."""
    snapshot = backend.snapshot()
    try:
        metrics = _train_checkpoint_record(
            backend,
            store,
            model,
            settings,
            plan,
            save=save,
            token_budget=token_budget,
            skipped_groups=skipped_groups,
            failed_attempts=failed_attempts,
        )
    except Exception:
        backend.restore(snapshot)
        raise
    if metrics is None:  # taken back: nothing was published
        backend.restore(snapshot)
    return metrics


def _train_checkpoint_record(
    backend: TrainingBackend,
    store: Store,
    model: str,
    settings: Settings,
    plan: StepPlan,
    *,
    save: SaveCheckpoint,
    token_budget: int | None,
    skipped_groups: int,
    failed_attempts: int,
) -> dict | None:
    from trainer.step import train_step

    step, trained_groups = plan.step, plan.trained_groups
    # With --reward-kl the step shapes rewards once it has scored the base: what each session
    # trained with is the advantage it returns, not the one the plan was made with.
    metrics = train_step(backend, plan.samples, settings, token_budget=token_budget, advantages_out=plan.advantages)
    rewards = plan.rewards  # the sessions trained only: never a val session, nor one that left its group
    metrics.update(
        reward_mean=sum(rewards) / len(rewards),
        reward_std=_std(rewards),
        groups=len(trained_groups),
        skipped_groups=skipped_groups,
        cut_samples=plan.cut,
        greedy_calls=plan.greedy_calls,
        left_out_sessions=len(plan.left_out),
        shared_turns=plan.shared_turns,
        failed_attempts=failed_attempts,
    )
    _test_pause("train", step)
    if _discarded_meanwhile(store, plan.sessions, step):
        return None
    if settings.promote != "always" and _parent_turned_down(store, model, plan.parent, step):
        return None
    metrics["seconds"] = time.perf_counter() - plan.started
    try:
        checkpoint = save(
            step,
            metrics=metrics,
            groups=trained_groups,
            advantages=plan.advantages,
            left_out=plan.left_out,
            parent=plan.parent,
        )
    except OSError as exc:  # the disk's fault, not the batch's: the worker waits for it (trainer.worker)
        raise ckpts.unwritable(exc) from exc
    _test_pause("record", step)
    try:
        store.insert_step(
            model,
            step,
            str(checkpoint.path),
            metrics,
            trained_groups,
            session_ids=[sid for ids in plan.sessions.values() for sid in ids],
            advantages=plan.advantages,
            left_out=plan.left_out,
            # what each session trained with, as read after the claim froze it: a reward's answer is checked on it
            rewards={
                s["id"]: float(s["reward"]) for g in plan.groups for s in g["sessions"] if s["id"] in plan.advantages
            },
            # Its parent is the step its weights were trained from (the serving step when it started: the
            # trainer waits while a candidate is undecided), not whatever serves by now.
            state="promoted" if settings.promote == "always" else "candidate",
            parent=plan.parent,
            claimed=True,  # given back meanwhile (its lock was dropped: gateway.store.trainer_lock), none is recorded
        )
    except Conflict as exc:  # a discard landed between the check and the record, or the claims were given back
        log.warning("step %d taken back: %s", step, exc.message)
        ckpts.discard(checkpoint)
        return None
    return metrics


def _parent_turned_down(store: Store, model: str, parent: int | None, step: int) -> bool:
    """Whether the step this one was trained from was rolled back while it trained (the canary's
    watch): the step is then taken back, and its groups train again from the serving step, so
    that no step is built on one that was turned down."""
    if parent is None:
        return False
    state = next((r["state"] for r in store.steps(model) if r["step"] == parent), None)
    if state not in TURNED_DOWN:
        return False
    log.warning("step %d taken back: step %d, which it was trained from, was %s meanwhile", step, parent, state)
    return True


def _discarded_meanwhile(store: Store, sessions: dict[str, list[str]], step: int) -> bool:
    """Whether a session this step trained on was discarded while it trained: the step
    is then taken back and its groups trained again without that session."""
    for group_id, session_ids in sessions.items():
        now = {s["id"] for s in store.get_group(group_id)["sessions"]}
        gone = [sid for sid in session_ids if sid not in now]
        if gone:
            log.warning(
                "session(s) %s of group %s were discarded during step %d; training it again without them",
                ", ".join(gone),
                group_id,
                step,
            )
            return True
    return False


def log_step(step: int, metrics: dict) -> None:
    """The step's line in the trainer's log."""
    kl = "-" if metrics["kl"] is None else f"{metrics['kl']:.4f}"
    log.info(
        "step %d: loss %.4f, reward %.3f ± %.3f, kl %s, clip %.3f, mismatch %.4f, %d tokens in %.1f s "
        "(%.0f tok/s), %d group(s), %d skipped",
        step,
        metrics["loss"],
        metrics["reward_mean"],
        metrics["reward_std"],
        kl,
        metrics["clip_fraction"],
        metrics.get("mismatch_logprob_abs", 0.0),
        metrics["tokens"],
        metrics["seconds"],
        metrics["tokens"] / max(metrics["train_seconds"], 1e-9),
        metrics["groups"],
        metrics["skipped_groups"],
    )


def _std(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))


def _test_pause(phase: str, step: int) -> None:
    """Test hook: `RLPROXY_TEST_PAUSE_AT=train,record` makes the worker announce the phase
    on stderr and sleep (`RLPROXY_TEST_PAUSE_SECONDS`, default 60) so a test can kill it
    there. `train`: after the update, before the checkpoint; `record`: after the
    checkpoint, before the step row; `follower`: a rank other than 0 as its step begins (rank 0
    waits for it inside the step). Unset in normal runs."""
    phases = os.environ.get("RLPROXY_TEST_PAUSE_AT", "")
    if phase in phases.split(","):
        print(f"rlproxy-test-pause: {phase} step {step} (pid {os.getpid()})", file=sys.stderr, flush=True)
        time.sleep(float(os.environ.get("RLPROXY_TEST_PAUSE_SECONDS", "60")))
