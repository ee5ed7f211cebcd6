"""Checkpoint directories: `STATE/models/NAME/checkpoints/NNNN/`, written atomically.

Each checkpoint holds the adapter in PEFT format (what the gateway loads), the optimizer
state, `settings.json` (the settings that produced it, secrets excluded) and
`trainer_state.json` (step, metrics, the group ids it trained on and the run's dr_grpo token
budget, fixed at its first step and restored on restart).

A checkpoint is written into a hidden temporary sibling (`.tmp-NNNN-PID`), every file and
the directory fsynced, then renamed to `NNNN`: a rename within one directory is atomic,
so a kill at any moment leaves either no `NNNN` or a complete one. Leftover temporary
directories are removed when the worker starts.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from gateway.errors import StoreFull, StoreUnavailable
from trainer.backends.base import ADAPTER_FILES, OPTIMIZER_FILE

log = logging.getLogger("rlproxy.trainer")

SETTINGS_FILE = "settings.json"
STATE_FILE = "trainer_state.json"
_TMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path

    def state(self) -> dict:
        """`trainer_state.json`: {"step", "metrics", "groups", "token_budget"} (the last one
        absent from checkpoints written before it existed, and None before the first step)."""
        return json.loads((self.path / STATE_FILE).read_text())

    def settings(self) -> dict:
        return json.loads((self.path / SETTINGS_FILE).read_text())


def saved_token_budget(path: Path) -> int | None:
    """The run's dr_grpo token budget saved in the checkpoint at `path` (None: not fixed yet,
    or a checkpoint from before it was saved)."""
    value = json.loads((Path(path) / STATE_FILE).read_text()).get("token_budget")
    return value if isinstance(value, int) and value > 0 else None


def saved_objective(path: Path) -> str:
    """The objective the checkpoint at `path` was trained with ("grpo" when it says none)."""
    try:
        state = json.loads((Path(path) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return "grpo"
    return str((state.get("metrics") or {}).get("objective") or "grpo")


def checkpoint_dir(root: Path, step: int) -> Path:
    return Path(root) / f"{step:04d}"


def read_without_optimizer(name: str) -> bool:
    """A checkpoint file that a read of the step needs (`restore_checkpoint`'s `wanted`): every
    one but the optimizer state, which only resuming that run reads (an export, an `--init-from`
    seed with a fresh optimizer: twice the adapter's size fetched for nothing)."""
    return name != OPTIMIZER_FILE


def is_settings_file(name: str) -> bool:
    """Only `settings.json` (`restore_checkpoint`'s `wanted`): what a check of a step's adapter shape reads."""
    return name == SETTINGS_FILE


def is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in (*ADAPTER_FILES, STATE_FILE))


def list_checkpoints(root: Path) -> list[Checkpoint]:
    """Complete checkpoints under `root`, oldest first (temporary directories ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        if entry.is_dir() and entry.name.isdigit() and is_complete(entry):
            found.append(Checkpoint(int(entry.name), entry))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(root: Path) -> Checkpoint | None:
    checkpoints = list_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def remove_partial(root: Path) -> list[Path]:
    """Delete temporary directories a killed save left behind; return what was removed."""
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for entry in root.iterdir():
        if entry.name.startswith(_TMP_PREFIX) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(directory: Path) -> None:
    for entry in directory.rglob("*"):
        if entry.is_file():
            _fsync_path(entry)
    for entry in sorted((p for p in directory.rglob("*") if p.is_dir()), reverse=True):
        _fsync_path(entry)
    _fsync_path(directory)


def write_checkpoint(
    root: Path,
    step: int,
    write_files: Callable[[Path], None],
    *,
    settings: dict,
    metrics: dict,
    groups: list[str],
    token_budget: int | None = None,
    advantages: dict[str, float] | None = None,
    left_out: dict[str, str] | None = None,
    sft: dict | None = None,
    parent: int | None = None,
) -> Checkpoint:
    """Write checkpoint `step` atomically: `write_files(tmp_dir)` (the backend's `save`),
    then the JSON files, fsync, rename. Raises FileExistsError if `NNNN` already exists
    (the caller decides step numbers; two checkpoints must never claim one). `parent`: the step
    whose weights it was trained from."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(root, step)
    if final.exists():
        raise FileExistsError(f"checkpoint {final} already exists")
    tmp = root / f"{_TMP_PREFIX}{step:04d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_files(tmp)
        (tmp / SETTINGS_FILE).write_text(json.dumps(settings, indent=2, sort_keys=True))
        # The sessions' advantages and those left out, for a restart to record the step as it was.
        state = {
            "step": step,
            "metrics": metrics,
            "groups": groups,
            "token_budget": token_budget,
            "advantages": advantages or {},
            "left_out": left_out or {},
            "parent": parent,  # a restart records it with this parent, not whatever serves by then
        }
        if sft is not None:  # a supervised run's snapshot and position (`trainer.sft.run`)
            state["sft"] = sft
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
        _fsync_tree(tmp)
        os.rename(tmp, final)
        _fsync_path(root)  # make the rename itself durable
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Checkpoint(step, final)


def unwritable(exc: OSError) -> StoreUnavailable:
    """A checkpoint write that failed for the disk's sake (full, read-only, gone), said as the
    store's failure: the worker gives the step's attempt back and waits, as it does for the
    database, rather than count it against the groups (which sets them aside for good)."""
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    fix = "Free space on that disk" if full else "Make the state dir writable by the trainer"
    return (StoreFull if full else StoreUnavailable)(
        f"cannot write a checkpoint under the state dir ({exc.strerror or exc}: {exc.filename}). {fix}; "
        "training goes on by itself once that is fixed, no restart needed.",
        cause="full" if full else "unavailable",
    )


def discard(checkpoint: Checkpoint) -> None:
    """Remove a checkpoint that is not recorded in the store (moved aside first, so a
    kill during the removal cannot leave a half directory under its step number)."""
    remove_set_aside([_move_aside(checkpoint)])


def _move_aside(checkpoint: Checkpoint) -> Path:
    doomed = checkpoint.path.with_name(f"{_TMP_PREFIX}discard-{checkpoint.path.name}-{os.getpid()}")
    os.rename(checkpoint.path, doomed)
    return doomed


def remove_set_aside(paths: Iterable[Path]) -> None:
    """Delete what `set_aside` (or `discard`) moved aside; a kill midway leaves `.tmp-` directories,
    which the next start removes (`remove_partial`)."""
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def set_aside(root: Path, keep: int, protected: set[int]) -> dict[int, Path]:
    """`--keep-checkpoints N`: move the complete checkpoints older than the newest `keep`, except
    `protected` (the serving step, the step a rollback would serve again, candidates: what a gateway
    or a resumed trainer still loads), out of their step's place, each by one rename: a decision
    looking for a step's adapter at that moment finds it whole or not at all. `remove_set_aside`
    deletes them, after the store's transaction (`Store.prune_checkpoints`) that decisions wait for.
    Each step writes an adapter and its optimizer state, so without a bound a trainer that runs for
    weeks fills the disk the store lives on too. `keep` 0 keeps every one. Returns step -> where it went."""
    if keep <= 0:
        return {}
    moved = {}
    for checkpoint in list_checkpoints(root)[:-keep]:
        if checkpoint.step in protected:
            continue
        try:
            moved[checkpoint.step] = _move_aside(checkpoint)
        except OSError as exc:  # a read-only disk, a directory held elsewhere: tried again after the next step
            log.warning("could not remove the old checkpoint %s: %s", checkpoint.path, exc)
    return moved
