"""The trainer worker: waits for ready groups, trains, checkpoints, records the step.

Runs in its own process (`rlproxy train`, or beside `rlproxy serve --trainer auto`) and
talks to the gateway only through the store and the checkpoint directory.

Crash safety, in the order a step does things:
1. train in memory (nothing on disk changes);
2. write checkpoint `NNNN/` atomically (temporary directory, fsync, rename);
3. insert the step row and mark its groups trained, in one transaction.
A kill before 2 loses only compute: the groups are still ready and are trained again.
A kill between 2 and 3 leaves a complete checkpoint without a step row. On restart such a
checkpoint is RE-RECORDED from its `trainer_state.json` (it names the groups it was
trained on), in the same single transaction, so the work is kept and the gateway sees
the step as if nothing happened; if those groups can no longer be claimed (already
trained), the checkpoint is discarded instead. Either way the next step number is the
last checkpoint + 1, and no group is lost or trained twice.

One worker per model: a lock file in the checkpoint directory (released by the kernel
when the process dies, even by SIGKILL) makes a second worker fail fast.

With `--engine vllm`: in `--gpu-mode colocated` each step borrows the GPU from vLLM
(`gateway.colocate.gpu_for_training`) and hands it back naming the new step. With every
engine that serves adapters (local, vllm), groups sampled more than `--max-staleness`
steps before the step being trained from are skipped: their behaviour policy is too far
from pi_old for the importance weights to correct.

A step never publishes a broken adapter: a non-finite loss or gradient (`NonFiniteStep`)
or any other failure of the step leaves weights, checkpoints and step rows as they were
and the groups untrained; the same batch failing `MAX_ATTEMPTS` times is set aside (its
groups marked failed with the reason, visible in `GET /v1/groups/{id}`) and the worker
goes on. A session discarded while its group was being trained takes the step back
(checkpoint removed, weights restored) and the group is trained again without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import math
import os
import socket
import sqlite3
import sys
import threading
import time
from typing import TYPE_CHECKING, TextIO

from gateway.errors import ConfigError, Conflict, EngineUnavailable, StoreUnavailable
from gateway.settings import Settings
from gateway.store import Store
from gateway.store.open import open_store
from trainer import checkpoints as ckpts
from trainer.data import (
    NO_SPREAD,
    ChatTemplateRenderer,
    build_batch,
    fit_to_rows,
    sampling_step,
    spread_groups,
    token_budget,
)
from trainer.reporting import Reporter

if TYPE_CHECKING:  # the backend (torch) and the GPU lease are imported when needed
    from gateway.colocate import TrainingLease
    from trainer.backends.base import TrainingBackend
    from trainer.types import Sample

log = logging.getLogger("rlproxy.trainer")

MAX_ATTEMPTS = 3
"""Failures of the same batch before its groups are set aside as failed."""
GPU_LEASE_TIMEOUT = 600.0
"""Seconds to wait for the gateway to drain and lend the GPU before postponing a step."""
# Settings a checkpoint cannot be resumed under when they change.
_ADAPTER_SHAPE = ("base_model", "lora_rank", "lora_alpha")


def _test_pause(phase: str, step: int) -> None:
    """Test hook: `RLPROXY_TEST_PAUSE_AT=train,record` makes the worker announce the phase
    on stderr and sleep (`RLPROXY_TEST_PAUSE_SECONDS`, default 60) so a test can kill it
    there. `train`: after the update, before the checkpoint; `record`: after the
    checkpoint, before the step row. Unset in normal runs."""
    phases = os.environ.get("RLPROXY_TEST_PAUSE_AT", "")
    if phase in phases.split(","):
        print(f"rlproxy-test-pause: {phase} step {step}", file=sys.stderr, flush=True)
        time.sleep(float(os.environ.get("RLPROXY_TEST_PAUSE_SECONDS", "60")))


def _std(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))


_HOLDER = f"{socket.gethostname()}:{os.getpid()}"  # this trainer, in claims on a shared store


class TrainerWorker:
    def __init__(self, settings: Settings, store: Store | None = None) -> None:
        self.settings = settings
        self.model = settings.model_name
        self._own_store = store is None
        self.store = store or open_store(settings)  # no writer task: sync writes (SQLite: WAL)
        self.root = settings.checkpoints_dir().resolve()
        self.backend: TrainingBackend | None = None  # loaded by start()
        self.next_step = 0
        self.skipped_since_step = 0
        self.failures: dict[tuple[str, ...], int] = {}  # batch (its group ids) -> failed attempts
        self.failed_steps = 0  # attempts that failed (non-finite or an error), for the log and the step metrics
        self.max_tokens_seen: int | None = None  # dr_grpo's budget when --max-tokens-norm is unset
        self._lock_file: TextIO | None = None
        self.reporter = Reporter.create(settings)  # --report-to: never stops training

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        """Take the lock, load the backend, resume from the newest checkpoint (or create
        step 0)."""
        self._take_lock()
        import torch

        from trainer.backends import get_backend

        torch.manual_seed(self.settings.seed)
        threads = os.environ.get("RLPROXY_TORCH_THREADS")
        if threads:
            # Beside a local engine on the same cores, two processes each spinning one
            # OpenMP thread per core make both many times slower: `serve` gives each half.
            torch.set_num_threads(int(threads))
        started = time.perf_counter()
        backend = self.backend = get_backend(self.settings.backend)(self.settings)
        self.render = ChatTemplateRenderer(backend.tokenizer)
        log.info(
            "trainer: %s on %s, %d LoRA parameters, loaded in %.1f s",
            self.settings.base_model,
            backend.device,
            backend.trainable_parameters(),
            time.perf_counter() - started,
        )
        self._resume()

    @property
    def _loaded_backend(self) -> TrainingBackend:
        """The backend `start` loaded (a worker that was not started has none)."""
        if self.backend is None:
            raise RuntimeError("the trainer worker has no backend: call start() first")
        return self.backend

    def _take_lock(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        lock = open(self.root / ".worker.lock", "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise ConfigError(
                f"another trainer worker ({holder}) is training model '{self.model}' in {self.root}; "
                "stop it, or use --trainer off beside a separate `rlproxy train`"
            ) from None
        lock.truncate(0)
        lock.write(f"pid {os.getpid()}")
        lock.flush()
        self._lock_file = lock

    def close(self) -> None:
        self.reporter.close()
        if self._own_store:
            asyncio.run(self.store.close())  # no writer task: this only closes the connections
            self._own_store = False
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def _resume(self) -> None:
        for leftover in ckpts.remove_partial(self.root):
            log.info("removed an unfinished checkpoint write: %s", leftover.name)
        recorded = {row["step"] for row in self.store.steps(self.model)}
        last_recorded = max(recorded, default=-1)
        for checkpoint in ckpts.list_checkpoints(self.root):
            if checkpoint.step > last_recorded:
                self._record_orphan(checkpoint)
        recorded = {row["step"] for row in self.store.steps(self.model)}
        last_recorded = max(recorded, default=-1)

        # A trainer on a new machine: the checkpoint from the store, where it keeps one (PostgreSQL).
        if last_recorded >= 0 and ckpts.latest_checkpoint(self.root) is None:
            if self.store.restore_checkpoint(self.model, last_recorded, ckpts.checkpoint_dir(self.root, last_recorded)):
                log.info("step %d: checkpoint fetched from the store", last_recorded)
        latest = ckpts.latest_checkpoint(self.root)
        if latest is None:
            if last_recorded > 0:
                raise ConfigError(
                    f"the store records steps up to {last_recorded} for model '{self.model}' but "
                    f"{self.root} holds no checkpoint; restore the checkpoints, or train under another "
                    "--model-name or --state-dir"
                )
            checkpoint = self._save(0, metrics={}, groups=[])
            if 0 not in recorded:
                self.store.insert_step(self.model, 0, str(checkpoint.path), {}, [])
            log.info("step 0: fresh adapter saved to %s", checkpoint.path)
            self.next_step = 1
            return
        self._check_compatible(latest)
        self._loaded_backend.load(latest.path)
        if last_recorded > latest.step:
            log.warning("steps after %d are recorded but their checkpoints are gone", latest.step)
        self.next_step = max(latest.step, last_recorded) + 1
        log.info("resumed from checkpoint %s; next step %d", latest.path, self.next_step)

    def _record_orphan(self, checkpoint: ckpts.Checkpoint) -> None:
        """A checkpoint written but not recorded (killed between the two): record it now,
        or discard it if its groups were claimed meanwhile."""
        state = checkpoint.state()
        try:
            self.store.insert_step(self.model, checkpoint.step, str(checkpoint.path), state["metrics"], state["groups"])
        except (Conflict, sqlite3.IntegrityError) as exc:
            log.warning("discarding checkpoint %s, which was never recorded: %s", checkpoint.path, exc)
            ckpts.discard(checkpoint)
            return
        log.info("recorded step %d from its checkpoint (the worker stopped before recording it)", checkpoint.step)

    def _check_compatible(self, checkpoint: ckpts.Checkpoint) -> None:
        saved = checkpoint.settings()
        current = self.settings.public_dict()
        changed = [k for k in _ADAPTER_SHAPE if k in saved and saved[k] != current[k]]
        if changed:
            what = ", ".join(f"{k} {saved[k]!r} -> {current[k]!r}" for k in changed)
            raise ConfigError(
                f"checkpoints of model '{self.model}' in {self.root} were trained with other settings ({what}); "
                "keep those settings, or train under another --model-name or --state-dir"
            )

    def _save(self, step: int, *, metrics: dict, groups: list[str]) -> ckpts.Checkpoint:
        return ckpts.write_checkpoint(
            self.root,
            step,
            self._loaded_backend.save,
            settings=self.settings.public_dict(),
            metrics=metrics,
            groups=groups,
        )

    # ------------------------------------------------------------------ loop

    def groups_to_train(self) -> list[dict] | None:
        """The groups of the next step, or None while there are too few. Ready groups
        without a reward spread are marked skipped at once: they never teach anything,
        so they do not count towards `groups_per_step`."""
        ready = self.store.claim_groups(self.model, _HOLDER)  # several trainers take disjoint groups
        if not ready:
            return None
        keep, drop = spread_groups([self.store.get_group(g["id"]) for g in ready])
        if drop:
            self.store.mark_skipped([g["id"] for g in drop], NO_SPREAD)
            self.skipped_since_step += len(drop)
            log.info("skipped %d group(s) with no reward spread", len(drop))
        keep = self._drop_stale(keep)
        wanted = self.settings.groups_per_step
        if len(keep) >= wanted:
            self.store.consume_triggers(self.model)  # this step answers any pending ask too
            return keep[:wanted]
        # A trigger is consumed only when it can be honoured (>= 1 group): one posted
        # before any group is ready fires as soon as one is.
        if keep and self.store.consume_triggers(self.model):
            log.info("training step %d now: asked for by a trigger", self.next_step)
            return keep
        return None

    def _drop_stale(self, groups: list[dict]) -> list[dict]:
        """Mark skipped the groups sampled more than `max_staleness` steps before the step
        this worker trains from: their behaviour logprobs are too far off-policy. Applies to
        every engine that serves our adapters (local keeps serving while it trains, vLLM
        in dedicated mode too); an `openai` upstream's policy is not ours, so it has no step."""
        if self.settings.engine == "openai":
            return groups
        from gateway.colocate import is_stale

        current = self.next_step - 1
        fresh, stale = [], {}
        for group in groups:
            calls = [c for s in group["sessions"] for c in self.store.session_calls(s["id"])]
            sampled_by = sampling_step(calls)
            if is_stale(sampled_by, current, self.settings.max_staleness):
                stale[group["id"]] = f"stale: sampled by step {sampled_by}, training from step {current}"
            else:
                fresh.append(group)
        for gid, reason in stale.items():
            self.store.mark_skipped([gid], reason)
        if stale:
            self.skipped_since_step += len(stale)
            log.info("skipped %d group(s) sampled more than %d steps ago", len(stale), self.settings.max_staleness)
        return fresh

    def train_once(self, groups: list[dict]) -> dict | None:
        """One step on `groups`: returns its metrics, or None if nothing was trained (nothing
        trainable, the step failed, or a discard took it back)."""
        started = time.perf_counter()
        step = self.next_step
        calls = {s["id"]: self.store.session_calls(s["id"]) for g in groups for s in g["sessions"]}
        batch = build_batch(groups, calls, scale_rewards=self.settings.scale_rewards, render=self.render)
        samples, skipped_long, cut = fit_to_rows(batch.samples, self.settings.max_tokens_per_row)
        if cut:
            log.warning(
                "step %d: %d sample(s) longer than --max-tokens-per-row %d: trained on their first %d "
                "tokens; raise it to train them whole",
                step,
                cut,
                self.settings.max_tokens_per_row,
                self.settings.max_tokens_per_row,
            )
        skipped = {**batch.skipped, **skipped_long}
        trained_groups = [gid for gid in batch.group_ids if gid not in skipped]
        for reason in set(skipped.values()):
            self.store.mark_skipped([gid for gid, r in skipped.items() if r == reason], reason)
        self.skipped_since_step += len(skipped)
        if not samples:
            return None
        budget = token_budget(
            [c for g in groups if g["id"] in trained_groups for s in g["sessions"] for c in calls.get(s["id"], [])]
        )
        if budget is not None:
            self.max_tokens_seen = max(budget, self.max_tokens_seen or 0)
        sessions = {g["id"]: [s["id"] for s in g["sessions"]] for g in groups if g["id"] in trained_groups}

        key = tuple(sorted(trained_groups))
        try:
            with self._gpu() as lease:
                metrics = self._train_and_record(step, samples, groups, trained_groups, sessions, started, cut)
                if lease is not None and metrics is not None:
                    lease.step = step  # the gateway loads NAME@step when it takes the GPU back
        except (EngineUnavailable, ConfigError, StoreUnavailable):
            raise  # not the batch's fault: the run loop waits for the engine or the store
        except Exception as exc:  # NonFiniteStep, out of memory, a bad batch: never the worker's end
            self._step_failed(key, exc)
            return None
        self.failures.pop(key, None)
        if metrics is None:
            return None
        self.next_step = step + 1
        self.skipped_since_step = 0
        self.failed_steps = 0
        self.reporter.report_step(step, metrics, self.store, self.model)
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
        return metrics

    def _step_failed(self, key: tuple[str, ...], exc: Exception) -> None:
        """Count a failed attempt at a batch; set the batch aside after `MAX_ATTEMPTS`."""
        attempts = self.failures.get(key, 0) + 1
        self.failures[key] = attempts
        self.failed_steps += 1
        reason = f"{type(exc).__name__}: {exc}"
        if attempts < MAX_ATTEMPTS:
            log.warning(
                "step %d failed (attempt %d of %d; nothing was saved): %s",
                self.next_step,
                attempts,
                MAX_ATTEMPTS,
                reason,
            )
            return
        log.error(
            "step %d failed %d times on the same groups; setting them aside as failed: %s",
            self.next_step,
            attempts,
            reason,
        )
        self.store.mark_failed(list(key), f"training failed {attempts} times: {reason}"[:2000])
        self.failures.pop(key, None)

    def _gpu(self) -> contextlib.AbstractContextManager[TrainingLease | None]:
        """`--engine vllm --gpu-mode colocated`: borrow the GPU from vLLM for the step
        (`gateway.colocate`); otherwise nothing to do."""
        from gateway.colocate import gpu_for_training, needs_gpu_lease

        if needs_gpu_lease(self.settings):
            return gpu_for_training(self.store, self.model, timeout=GPU_LEASE_TIMEOUT)
        return contextlib.nullcontext()

    def _train_and_record(
        self,
        step: int,
        samples: list[Sample],
        groups: list[dict],
        trained_groups: list[str],
        sessions: dict[str, list[str]],
        started: float,
        cut: int,
    ) -> dict | None:
        """Train, checkpoint, record. Whatever stops it half-way (an error, a discard) puts
        the weights back as they were, so the next attempt starts from the same adapter."""
        backend = self._loaded_backend
        snapshot = backend.snapshot()
        try:
            metrics = self._train_checkpoint_record(step, samples, groups, trained_groups, sessions, started, cut)
        except Exception:
            backend.restore(snapshot)
            raise
        if metrics is None:  # taken back: nothing was published
            backend.restore(snapshot)
        return metrics

    def _train_checkpoint_record(
        self,
        step: int,
        samples: list[Sample],
        groups: list[dict],
        trained_groups: list[str],
        sessions: dict[str, list[str]],
        started: float,
        cut: int,
    ) -> dict | None:
        from trainer.step import train_step

        metrics = train_step(self._loaded_backend, samples, self.settings, token_budget=self.max_tokens_seen)
        rewards = [float(s["reward"]) for g in groups if g["id"] in trained_groups for s in g["sessions"]]
        metrics.update(
            reward_mean=sum(rewards) / len(rewards),
            reward_std=_std(rewards),
            groups=len(trained_groups),
            skipped_groups=self.skipped_since_step,
            cut_samples=cut,
            failed_attempts=self.failed_steps,
        )
        _test_pause("train", step)
        if self._discarded_meanwhile(sessions):
            return None
        metrics["seconds"] = time.perf_counter() - started
        checkpoint = self._save(step, metrics=metrics, groups=trained_groups)
        _test_pause("record", step)
        try:
            self.store.insert_step(
                self.model,
                step,
                str(checkpoint.path),
                metrics,
                trained_groups,
                session_ids=[sid for ids in sessions.values() for sid in ids],
            )
        except Conflict as exc:  # a discard landed between the check and the record
            log.warning("step %d taken back: %s", step, exc.message)
            ckpts.discard(checkpoint)
            return None
        return metrics

    def _discarded_meanwhile(self, sessions: dict[str, list[str]]) -> bool:
        """Whether a session this step trained on was discarded while it trained: the step
        is then taken back and its groups trained again without that session."""
        for group_id, session_ids in sessions.items():
            now = {s["id"] for s in self.store.get_group(group_id)["sessions"]}
            gone = [sid for sid in session_ids if sid not in now]
            if gone:
                log.warning(
                    "session(s) %s of group %s were discarded during step %d; training it again without them",
                    ", ".join(gone),
                    group_id,
                    self.next_step,
                )
                return True
        return False

    def run(self, stop_event: threading.Event | None = None, max_steps: int | None = None) -> int:
        """Train until `stop_event` is set (checked between steps) or `max_steps` steps are
        done; return the number of steps trained."""
        stop_event = stop_event or threading.Event()
        done = 0
        log.info(
            "trainer waiting for %d ready group(s) of model '%s' per step", self.settings.groups_per_step, self.model
        )
        store_failed = False
        while not stop_event.is_set() and (max_steps is None or done < max_steps):
            try:
                if store_failed:
                    # A step may have saved its checkpoint and then failed to record it: record
                    # (or discard) that checkpoint as a restart would, and go on from it.
                    self._resume()
                    store_failed = False
                groups = self.groups_to_train()
                if groups is None:
                    stop_event.wait(self.settings.poll_interval)
                    continue
                trained = self.train_once(groups)
            except EngineUnavailable as exc:  # the gateway did not lend the GPU: try again later
                log.warning("step %d postponed: %s", self.next_step, exc.message)
                stop_event.wait(self.settings.poll_interval)
                continue
            except StoreUnavailable as exc:  # full disk, lock, ...: wait for it, as the gateway does
                log.warning("step %d waits for the store: %s", self.next_step, exc.message)
                store_failed = True
                stop_event.wait(self.settings.poll_interval)
                continue
            if trained is not None:
                done += 1
        return done


def run_worker(settings: Settings, stop_event: threading.Event | None = None, max_steps: int | None = None) -> int:
    """Start a worker (resuming from the newest checkpoint) and train until stopped or
    `max_steps` steps are done. Returns the number of steps trained."""
    worker = TrainerWorker(settings)
    try:
        worker.start()
        return worker.run(stop_event, max_steps)
    finally:
        worker.close()
