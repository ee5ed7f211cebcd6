"""A supervised run (`rlproxy train --objective sft`): distil recorded sessions into the adapter.

The same worker, checkpoints and step rows as GRPO's, so each step is served as `NAME@N` and
hot-swapped like any other, and the dashboard shows its `objective`. The run:

- takes a **snapshot** of the selection when it starts (`SessionFilter`, the flags `rlproxy
  export` has): sessions recorded later are not added; the train-split sessions are trained,
  the val-split ones are held out and their loss (`val_loss`) is reported every step. The
  snapshot and the position in it are saved with every checkpoint, so a restart goes on where
  it stopped instead of taking a new one;
- marks the groups of the selected sessions `skipped` ("distilled ..."), so the GRPO trainer
  never takes them afterwards;
- trains `--epochs` passes over the train sessions, shuffled per epoch (`--seed`),
  `--sft-sessions-per-step` sessions a step, until the epochs or `--max-steps` are done.
  Sessions whose rendering is ambiguous are skipped with the reason and counted
  (`trainer.sft.samples`); a session whose history the template rewrote (a reasoning model's
  dropped `<think>` blocks) is split into samples there, and the splits are counted
  (`split_samples`), not skipped.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from gateway.errors import ConfigError
from gateway.store import SessionFilter, Store
from trainer import checkpoints as ckpts
from trainer.data import answered_since, fit_to_rows
from trainer.resume import prune_checkpoints
from trainer.sft.samples import SessionSamples, load_session_samples
from trainer.sft.step import sft_loss, sft_step
from trainer.types import Sample

if TYPE_CHECKING:
    from trainer.worker import TrainerWorker

log = logging.getLogger("rlproxy.trainer")

DISTILLED = "distilled: selected for supervised training (rlproxy train --objective sft), never trained by GRPO"


@dataclass
class Snapshot:
    """The sessions of a supervised run and where it stands (saved with every checkpoint)."""

    train: list[str]
    val: list[str]
    epochs: int
    sessions_per_step: int
    seed: int
    epoch: int = 0
    position: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    """Session id -> why it is not trained (ambiguous rendering)."""

    @property
    def done(self) -> bool:
        return self.epoch >= self.epochs or not self.train

    def batch(self) -> list[str]:
        """The sessions of the next step: the next slice of this epoch's order."""
        order = list(self.train)
        random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order[self.position : self.position + self.sessions_per_step]

    def advance(self, n: int) -> None:
        self.position += n
        if self.position >= len(self.train):
            self.epoch, self.position = self.epoch + 1, 0

    def state(self) -> dict:
        return asdict(self)


def select(store: Store, where: SessionFilter) -> tuple[list[str], list[str]]:
    """(train-split ids, val-split ids) of the sessions `where` selects, oldest first: the
    same sessions `rlproxy export` writes with the same flags."""
    train: list[str] = []
    val: list[str] = []
    for session_id in store.select_session_ids(where):
        session = store.get_session(session_id)
        if where.since_step is not None and not answered_since(session["calls"], where.since_step):
            continue
        (val if session["split"] == "val" else train).append(session_id)
    return train, val


def take_snapshot(store: Store, where: SessionFilter, *, epochs: int, sessions_per_step: int, seed: int) -> Snapshot:
    train, val = select(store, where)
    if not train:
        raise ConfigError(
            "the selection holds no train-split session to distil: check the flags (rlproxy export with the "
            "same flags lists what they select)"
        )
    groups = {store.get_session(sid)["group_id"] for sid in [*train, *val]} - {None}
    fresh = [gid for gid in sorted(groups) if store.get_group(gid)["trained_step"] is None]
    if fresh:
        store.mark_skipped(fresh, DISTILLED)
    log.info(
        "sft: %d train and %d val session(s) selected; %d group(s) marked distilled", len(train), len(val), len(fresh)
    )
    return Snapshot(train, val, epochs, sessions_per_step, seed)


def a_row_of(max_tokens_per_row: int, context: int | None) -> str:
    """A training row's length and what sets it, for a message: raising --max-tokens-per-row
    helps only where the base model's context is not the limit."""
    if context is not None and context <= max_tokens_per_row:
        return f"a row of {max_tokens_per_row} tokens (the base model's context)"
    return f"a row of {max_tokens_per_row} tokens (--max-tokens-per-row)"


def _fitted(
    found: list[SessionSamples], max_tokens: int, context: int | None
) -> tuple[dict[str, list[Sample]], dict[str, str]]:
    samples: dict[str, list[Sample]] = {}
    skipped: dict[str, str] = {}
    for item in found:
        if item.skipped is not None:
            skipped[item.session_id] = item.skipped
            continue
        kept, dropped, _ = fit_to_rows(list(item.samples), max_tokens)
        if kept:
            samples[item.session_id] = kept
        else:
            skipped[item.session_id] = f"longer than {a_row_of(max_tokens, context)} before its first reply"
    return samples, skipped


def run_sft(
    worker: TrainerWorker,
    where: SessionFilter,
    *,
    epochs: int,
    sessions_per_step: int,
    stop_event: threading.Event | None = None,
    max_steps: int | None = None,
) -> int:
    """Train the run's steps (resuming a run a checkpoint was saved in); the steps trained."""
    if epochs < 1 or sessions_per_step < 1:
        raise ConfigError("--epochs and --sft-sessions-per-step must be 1 or more")
    stop_event = stop_event or threading.Event()
    settings, store, backend = worker.settings, worker.store, worker._loaded_backend
    latest = ckpts.latest_checkpoint(worker.root)
    saved = latest.state().get("sft") if latest is not None else None
    if saved and not Snapshot(**saved).done:
        snapshot = Snapshot(**saved)
        log.info("sft: resuming the run at epoch %d, session %d", snapshot.epoch + 1, snapshot.position)
    else:
        snapshot = take_snapshot(store, where, epochs=epochs, sessions_per_step=sessions_per_step, seed=settings.seed)
    found = load_session_samples(store, snapshot.train, worker.render)
    context = backend.context_length
    train, skipped = _fitted(found, settings.max_tokens_per_row, context)
    splits = sum(item.splits for item in found if item.session_id in train)
    val, _ = _fitted(load_session_samples(store, snapshot.val, worker.render), settings.max_tokens_per_row, context)
    snapshot.skipped = skipped
    if skipped:
        reasons = Counter(skipped.values())
        log.warning(
            "sft: %d session(s) skipped, never trained wrongly: %s",
            len(skipped),
            "; ".join(f"{n} x {why}" for why, n in reasons.most_common()),
        )
    if splits:
        log.info(
            "sft: %d split(s) where a call's prompt does not extend the session so far (a template that rewrites "
            "the history, such as a reasoning model's dropped <think> blocks): a new sample starts there",
            splits,
        )
    val_samples = [s for samples in val.values() for s in samples]
    done = 0
    while not snapshot.done and not stop_event.is_set() and (max_steps is None or done < max_steps):
        batch = snapshot.batch()
        samples = [s for sid in batch for s in train.get(sid, [])]
        epoch = snapshot.epoch
        snapshot.advance(len(batch))
        if not samples:
            continue
        started = time.perf_counter()
        step = worker.next_step
        metrics: dict = {"objective": "sft", **sft_step(backend, samples, settings)}
        metrics.update(
            epoch=epoch + 1,
            sessions=len([sid for sid in batch if sid in train]),
            skipped_sessions=len(skipped),
            split_samples=splits,
            val_loss=sft_loss(backend, val_samples, settings),
            seconds=time.perf_counter() - started,
        )
        checkpoint = worker._save(step, metrics=metrics, groups=[], sft=snapshot.state())
        store.insert_step(worker.model, step, str(checkpoint.path), metrics, [])
        prune_checkpoints(store, worker.model, worker.root, settings.keep_checkpoints, step)
        worker.next_step = step + 1
        worker.reporter.report_step(step, metrics, store, worker.model)
        val_text = "-" if metrics["val_loss"] is None else f"{metrics['val_loss']:.4f}"
        log.info(
            "step %d (sft, epoch %d): loss %.4f, val loss %s, %d session(s), %d tokens in %.1f s",
            step,
            epoch + 1,
            metrics["loss"],
            val_text,
            metrics["sessions"],
            int(metrics["tokens"]),
            metrics["seconds"],
        )
        done += 1
    if snapshot.done:
        log.info("sft: %d epoch(s) over %d session(s) done", snapshot.epochs, len(train))
    return done
