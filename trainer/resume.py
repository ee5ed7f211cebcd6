"""Where a worker goes on from: its checkpoints reconciled with the store's step rows.

At start, and after the store failed mid-step: unfinished checkpoint writes are removed; a
complete checkpoint without a step row (the worker stopped between writing and recording
it) is recorded now from its `trainer_state.json`, or discarded if its groups were claimed
meanwhile; a trainer on a new machine fetches the newest checkpoint from the store where
the store keeps one (PostgreSQL); an empty directory gets a fresh step 0. The next step is
the last checkpoint + 1.

The weights themselves are the worker's: it hands in how to save and load them.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple, Protocol

from gateway.errors import ConfigError, Conflict, StoreUnavailable
from gateway.settings import Settings
from gateway.store import Store
from gateway.store.steps import TURNED_DOWN, paused_reason
from trainer import checkpoints as ckpts

log = logging.getLogger("rlproxy.trainer")

# Settings a checkpoint cannot be resumed under when they change.
_ADAPTER_SHAPE = ("base_model", "lora_rank", "lora_alpha")


class SaveCheckpoint(Protocol):
    """Write checkpoint `step` of the current weights (atomically) and return it."""

    def __call__(
        self,
        step: int,
        *,
        metrics: dict,
        groups: list[str],
        advantages: dict[str, float] | None = None,
        left_out: dict[str, str] | None = None,
        sft: dict | None = None,
        parent: int | None = None,
    ) -> ckpts.Checkpoint: ...


class LoadCheckpoint(Protocol):
    """Load the weights (and optimizer state) of the checkpoint at `path`."""

    def __call__(self, path: Path) -> None: ...


class Resumed(NamedTuple):
    next_step: int
    """The step to train next: one past the newest checkpoint or step row."""
    weights_step: int
    """The step whose checkpoint was loaded: what the weights hold."""


def resume(
    store: Store,
    model: str,
    root: Path,
    settings: Settings,
    *,
    save: SaveCheckpoint,
    load: LoadCheckpoint,
    seed: LoadCheckpoint | None = None,
) -> Resumed:
    """Reconcile `root` with the store's steps of `model`, load the serving step's checkpoint (or
    save a fresh step 0: `--init-from NAME@N`'s adapter, through `seed`, where given) and
    return the step to train next and the step loaded."""
    for leftover in ckpts.remove_partial(root):
        log.info("removed an unfinished checkpoint write: %s", leftover.name)
    recorded = {row["step"] for row in store.steps(model)}
    last_recorded = max(recorded, default=-1)
    for checkpoint in ckpts.list_checkpoints(root):
        if checkpoint.step > last_recorded:
            # With no step serving yet (a step 0 saved, then killed), it is the run's start, recorded
            # as a fresh step 0 is: a candidate with no incumbent is never decided, and the trainer waits on it.
            first = store.serving_step(model) is None
            record_orphan(
                store, model, checkpoint, "promoted" if settings.promote == "always" or first else "candidate"
            )
    recorded = {row["step"] for row in store.steps(model)}
    last_recorded = max(recorded, default=-1)

    # A trainer on a new machine: the checkpoint from the store, where it keeps one (PostgreSQL).
    if last_recorded >= 0 and ckpts.latest_checkpoint(root) is None:
        if store.restore_checkpoint(model, last_recorded, ckpts.checkpoint_dir(root, last_recorded)):
            log.info("step %d: checkpoint fetched from the store", last_recorded)
    latest = ckpts.latest_checkpoint(root)
    if latest is None:
        if last_recorded > 0:
            raise ConfigError(
                f"the store records steps up to {last_recorded} for model '{model}' but "
                f"{root} holds no checkpoint; restore the checkpoints, or train under another "
                "--model-name or --state-dir"
            )
        metrics = {}
        if settings.init_from and seed is not None:
            with init_source(store, settings) as source:
                seed(source)
            metrics = {"init_from": settings.init_from}
        checkpoint = save(0, metrics=metrics, groups=[])
        if 0 not in recorded:
            store.insert_step(model, 0, str(checkpoint.path), metrics, [])
        log.info(
            "step 0: %s saved to %s",
            f"the adapter of {settings.init_from}" if metrics else "fresh adapter",
            checkpoint.path,
        )
        return Resumed(next_step=1, weights_step=0)
    if settings.init_from:
        log.info("--init-from %s seeds a new run only: resuming this one", settings.init_from)
    check_compatible(latest, settings, model, root)
    # What serves goes on (a candidate waits or was turned down), else the newest; each as the store keeps it.
    serving = store.serving_step(model)
    start = None if serving is None else checkpoint_of(store, model, root, serving)
    if start is None:
        if serving is not None:
            log.warning("the serving step %d has no checkpoint here: loading the newest, %d", serving, latest.step)
        start = checkpoint_of(store, model, root, latest.step) or latest
    load(start.path)
    if last_recorded > latest.step:
        log.warning("steps after %d are recorded but their checkpoints are gone", latest.step)
    next_step = max(latest.step, last_recorded) + 1
    log.info("resumed from checkpoint %s; next step %d", start.path, next_step)
    # The step loaded, not the serving one: a step trained on it names it as its parent, and under
    # --promote canary|manual `go_on_from_serving` holds training until the serving step's files are back.
    return Resumed(next_step=next_step, weights_step=start.step)


def checkpoint_of(store: Store, model: str, root: Path, step: int) -> ckpts.Checkpoint | None:
    """Step `step`'s checkpoint under `root`; None where neither `root` nor the store has it (removed by
    hand, or pruned). Where the store keeps the files (PostgreSQL) they are the step's: fetched where
    missing, and put in place of a directory here that differs, one a step that was never recorded
    left under the same number (its trainer killed, then gone on on another machine)."""
    path = ckpts.checkpoint_dir(root, step)
    if store.restore_checkpoint(model, step, path) is None and not ckpts.is_complete(path):
        return None
    return ckpts.Checkpoint(step, path)


def record_orphan(store: Store, model: str, checkpoint: ckpts.Checkpoint, step_state: str = "promoted") -> None:
    """A checkpoint written but not recorded (killed between the two): record it now, or discard
    it if its groups were trained meanwhile or one of its sessions was discarded (the groups train
    again without it, as when the discard lands while the step trains). The dead step's claims are
    given back only after this (`TrainerWorker._resume`): until then its groups' rewards stay as the
    checkpoint trained them. Its parent is the step it was trained from, as saved, not whatever serves
    by now; where that step was turned down meanwhile (the canary rolled it back while the trainer was
    down) the checkpoint is discarded, as a step is taken back when that happens while it trains."""
    state = checkpoint.state()
    parent = state.get("parent")  # None in a checkpoint from before it was saved: the serving step
    if (
        parent is not None
        and next((r["state"] for r in store.steps(model) if r["step"] == parent), None) in TURNED_DOWN
    ):
        log.warning(
            "discarding checkpoint %s, which was never recorded: step %d, which it was trained from, was turned "
            "down meanwhile",
            checkpoint.path,
            parent,
        )
        ckpts.discard(checkpoint)
        return
    try:
        store.insert_step(
            model,
            checkpoint.step,
            str(checkpoint.path),
            state["metrics"],
            state["groups"],
            session_ids=list(state.get("advantages") or {}),  # the sessions it trained on
            advantages=state.get("advantages"),
            left_out=state.get("left_out"),
            state=step_state,
            parent=parent,
            claimed=True,  # as the dead step left them: a gateway that took the trainer for gone gave them back
        )
    except Conflict as exc:  # its groups trained, a session discarded, its step number taken
        log.warning("discarding checkpoint %s, which was never recorded: %s", checkpoint.path, exc)
        ckpts.discard(checkpoint)
        return
    log.info("recorded step %d from its checkpoint (the worker stopped before recording it)", checkpoint.step)


def shape_changes(checkpoint: ckpts.Checkpoint, settings: Settings) -> list[tuple[str, object, object]]:
    """(setting, the checkpoint's value, this run's) for each adapter-shape setting that differs."""
    saved, current = checkpoint.settings(), settings.public_dict()
    return [(k, saved[k], current[k]) for k in _ADAPTER_SHAPE if k in saved and saved[k] != current[k]]


def refuse_other_shape(checkpoint: ckpts.Checkpoint, settings: Settings, says: Callable[[str], str]) -> None:
    """Raise `ConfigError(says(what))` where `checkpoint` was trained with another adapter shape than
    `settings`; `what` names each setting that differs, the checkpoint's value and this run's."""
    changed = shape_changes(checkpoint, settings)
    if changed:
        raise ConfigError(says(", ".join(f"{k} {saved!r} (here {current!r})" for k, saved, current in changed)))


def check_compatible(checkpoint: ckpts.Checkpoint, settings: Settings, model: str, root: Path) -> None:
    """Raise `ConfigError` if `checkpoint` was trained with another adapter shape."""
    refuse_other_shape(
        checkpoint,
        settings,
        lambda what: (
            f"checkpoints of model '{model}' in {root} were trained with {what}; "
            "keep those settings, or train under another --model-name or --state-dir"
        ),
    )


@contextmanager
def init_source(store: Store, settings: Settings) -> Iterator[Path]:
    """`with init_source(...) as path:` the checkpoint directory `--init-from NAME@N` names,
    refused when it was trained on another base model or adapter shape. Where the store keeps
    the files (PostgreSQL) they are fetched into a temporary directory, removed on leaving: the
    run's step 0 is a copy of its own, and a copy under STATE/models/NAME/store/ stayed for good."""
    with tempfile.TemporaryDirectory(prefix="rlproxy-init-from-") as scratch:
        yield _init_checkpoint(store, settings, Path(scratch), settings_only=False).path


def check_init_source(store: Store, settings: Settings) -> None:
    """`init_source`'s refusals before a trainer starts (`gateway.trainer_process.check_init_from`),
    fetching only the step's settings from the store: its adapter is fetched once, by the trainer
    that seeds step 0 with it, not a first time for a check and thrown away."""
    with tempfile.TemporaryDirectory(prefix="rlproxy-init-from-") as scratch:
        _init_checkpoint(store, settings, Path(scratch), settings_only=True)


def _init_checkpoint(store: Store, settings: Settings, scratch: Path, *, settings_only: bool) -> ckpts.Checkpoint:
    """The checkpoint `--init-from NAME@N` names, fetched under `scratch` where the store keeps its files
    (all but the optimizer state; only `settings.json` with `settings_only`), or ConfigError."""
    name, _, step_text = str(settings.init_from).partition("@")
    # ASCII digits only: `str.isdigit` also takes "²", which `int` refuses (a traceback, not this message).
    if not name or not (step_text.isascii() and step_text.isdigit()):
        raise ConfigError(f"--init-from takes NAME@STEP (as served, e.g. agent-sft@12), not '{settings.init_from}'")
    if name == settings.model_name:
        raise ConfigError(f"--init-from {settings.init_from} names this run itself: give another --model-name")
    step = int(step_text)
    rows = {row["step"]: row for row in store.steps(name)}
    if step not in rows:
        known = ", ".join(str(s) for s in sorted(rows)) or "none"
        raise ConfigError(
            f"--init-from {settings.init_from}: the store has no step {step} of '{name}' (steps: {known})"
        )
    wanted = ckpts.is_settings_file if settings_only else ckpts.read_without_optimizer
    fetched = store.restore_checkpoint(name, step, ckpts.checkpoint_dir(scratch, step), wanted)
    source = ckpts.Checkpoint(step, fetched or Path(rows[step]["path"]))
    # The store lists a step's files only once every one is stored: what a check left there is complete.
    partial = fetched is not None and settings_only
    if not (source.path / ckpts.SETTINGS_FILE).is_file() or not (partial or ckpts.is_complete(source.path)):
        raise ConfigError(f"--init-from {settings.init_from}: its checkpoint {source.path} is missing or incomplete")
    refuse_other_shape(
        source,
        settings,
        lambda what: (
            f"--init-from {settings.init_from} was trained with {what}: a run starts only from a step of the "
            "same base model and LoRA shape"
        ),
    )
    return source


def hold_reason(store: Store, settings: Settings, model: str) -> str | None:
    """Why the trainer waits before its next step, or None. Under `--promote canary|manual` a
    step waits for its decision (the next one would train on top of a step that may never
    serve), and `--max-rejections` steps turned down in a row pause training until
    POST /v1/training/resume."""
    if settings.promote == "always":
        return None
    undecided = store.undecided_step(model)
    if undecided is not None:
        return f"step {undecided} is a candidate: training waits for its decision (--promote {settings.promote})"
    rejected = store.rejections_in_a_row(model)
    if rejected >= settings.max_rejections:
        return paused_reason(rejected)
    return None


def go_on_from_serving(
    store: Store, model: str, root: Path, weights_step: int | None, load: LoadCheckpoint
) -> tuple[int | None, str | None]:
    """(The step the weights hold from now on, why training waits instead, or None.) The serving
    step's checkpoint (adapter and optimizer) is loaded when the weights hold another (a candidate
    rejected or rolled back, a restart that found it gone). Where no checkpoint of it can be found
    (removed by hand; on PostgreSQL not in the store either) the weights stay and training waits
    until it is back: a step trained on them is recorded either as the serving step's child, a
    false lineage (staleness, the step a rollback serves again), or as a turned-down step's, which
    `publish` takes back at once, its groups trained again and again."""
    serving = store.serving_step(model)
    if serving is None or serving == weights_step:
        return weights_step, None
    checkpoint = checkpoint_of(store, model, root, serving)
    if checkpoint is None:
        return weights_step, missing_serving_reason(model, serving, weights_step, ckpts.checkpoint_dir(root, serving))
    load(checkpoint.path)
    log.info("trainer: step %d serves; training goes on from its adapter and optimizer", serving)
    return serving, None


def missing_serving_reason(model: str, serving: int, weights_step: int | None, path: Path) -> str:
    """Why training waits while the serving step's checkpoint is nowhere to be found."""
    return (
        f"training waits: step {serving} serves but its checkpoint is gone ({path} is missing or incomplete, "
        f"and the store keeps no files of it); a step trained now would start from step {weights_step}'s "
        f"adapter, not step {serving}'s. Put the checkpoint back there and training goes on by itself; "
        f"where it cannot be, start a new run from a step that has one (--model-name NEW --init-from "
        f"{model}@{'N' if weights_step is None else weights_step}: docs/training.md)"
    )


def prune_checkpoints(store: Store, model: str, root: Path, keep: int, weights_step: int | None) -> None:
    """`--keep-checkpoints N` after a step: remove old checkpoints, never one a gateway or a resume
    loads (the serving step, the parent a rollback serves again, candidates, what the weights hold).
    What serves is read in the store's transaction that removes them, which decisions wait for
    (`Store.prune_checkpoints`); the directories moved aside are deleted after it."""
    if not keep:
        return
    moved: dict[int, Path] = {}

    def set_aside(kept: set[int]) -> list[int]:
        now = ckpts.set_aside(root, keep, kept)
        moved.update(now)
        return sorted(now)

    try:
        # The same steps' files in the store (PostgreSQL keeps every step's), those of steps this
        # machine never held too (a trainer moved here restores only the newest).
        _, dropped = store.prune_checkpoints(model, keep, set() if weights_step is None else {weights_step}, set_aside)
    except StoreUnavailable:  # nothing dropped from the store this time: the next step tries again
        dropped = []
    finally:
        ckpts.remove_set_aside(moved.values())
    if moved:
        log.info("removed old checkpoints (--keep-checkpoints %d): steps %s", keep, sorted(moved))
    if dropped:
        log.info("removed old checkpoints' files from the store (--keep-checkpoints %d): steps %s", keep, dropped)
