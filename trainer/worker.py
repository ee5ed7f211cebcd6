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
when the process dies, even by SIGKILL) makes a second worker fail fast, and on a PostgreSQL
store a lock in the database does the same for a worker on another machine.

With `--engine vllm`: in `--gpu-mode colocated` each step borrows the GPU from vLLM
(`gateway.colocate.gpu_for_training`) and hands it back naming the new step. With every
engine that serves adapters (local, vllm), groups sampled more than `--max-staleness`
steps before the step being trained from are skipped: their behaviour policy is too far
from pi_old for the importance weights to correct.

A step never publishes a broken adapter: a non-finite loss or gradient (`NonFiniteStep`)
or any other failure of the step leaves weights, checkpoints and step rows as they were
and the groups untrained; a failing batch is bisected until the group at fault is alone
(each half screened for staleness before it trains, as every step's groups are), and that
group is set aside after `MAX_ATTEMPTS` (marked failed with the reason, visible in
`GET /v1/groups/{id}`; the counts are in the store, so a crash counts: `trainer.attempts`).
A step claims its groups before it reads them: from then on a reward is refused (409) and a
call to one of their sessions is kept but never trained. A session discarded while its group
was being trained takes the step back (checkpoint removed, weights restored) and the group is
trained again without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.errors import ConfigError, EngineUnavailable, StoreUnavailable
from gateway.settings import Settings
from gateway.store import SessionFilter, Store
from gateway.store.open import open_store
from trainer import checkpoints as ckpts
from trainer.attempts import Attempts
from trainer.distributed.team import Team, TeamBroken
from trainer.lock import WorkerLock, take_lock
from trainer.publish import gpu_lease, log_step, plan_step, train_and_record
from trainer.render import ChatTemplateRenderer
from trainer.reporting import Reporter
from trainer.resume import go_on_from_serving, hold_reason, prune_checkpoints, resume
from trainer.selection import next_groups

if TYPE_CHECKING:  # the backend (torch) is imported when needed
    from trainer.backends.base import TrainingBackend

log = logging.getLogger("rlproxy.trainer")


class TrainerWorker:
    """The loop and the state it carries between steps. Its parts: `lock` (one worker per
    model), `resume` (checkpoints reconciled with the store), `selection` (the groups of a
    step), `publish` (train, checkpoint, record), `attempts` (failed steps)."""

    def __init__(
        self, settings: Settings, store: Store | None = None, objective: str = "grpo", team: Team | None = None
    ) -> None:
        self.settings = settings
        self.team = team  # several ranks (`trainer.distributed`): this worker is rank 0, the others follow
        self.objective = objective  # "grpo", or "sft" (`trainer.sft.run`)
        self.model = settings.model_name
        self._own_store = store is None
        self.store = store or open_store(settings)  # no writer task: sync writes (SQLite: WAL)
        self.root = settings.checkpoints_dir().resolve()
        self.backend: TrainingBackend | None = None  # loaded by start()
        self.next_step = 0
        self.weights_step: int | None = None  # the step whose adapter the weights hold (--promote canary|manual)
        self._held_for: str | None = None
        self.skipped_since_step = 0
        self.attempts = Attempts(self.store, settings.groups_per_step)  # failed steps: bisected, set aside
        # dr_grpo's token budget: --max-tokens-norm, else fixed at the run's first step from its
        # calls; saved with every checkpoint and restored on restart, never a running maximum.
        self.token_budget: int | None = None
        self._step_budget: int | None = None  # the budget of the step being saved
        self._lock: WorkerLock | None = None
        self.reporter = Reporter.create(settings)  # --report-to: never stops training

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        """Take the lock, load the backend, resume from the newest checkpoint (or create
        step 0)."""
        self._lock = take_lock(self.root, self.model, self.store)
        from trainer.backends import load_backend, rows_within_context

        backend = self.backend = load_backend(rank_settings(self.settings, self.team), self.team)
        self.settings = rows_within_context(self.settings, backend)
        self.render = ChatTemplateRenderer(backend.tokenizer)
        self._resume()

    @property
    def _loaded_backend(self) -> TrainingBackend:
        """The backend `start` loaded (a worker that was not started has none)."""
        if self.backend is None:
            raise RuntimeError("the trainer worker has no backend: call start() first")
        return self.backend

    def close(self) -> None:
        if self.team is not None:
            with contextlib.suppress(TeamBroken):
                self.team.announce("stop")  # the other ranks end their run with this one's
            self.team.close()
            self.team = None
        self.reporter.close()
        if self._own_store:
            asyncio.run(self.store.close())  # no writer task: this only closes the connections
            self._own_store = False
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _resume(self) -> None:
        self.next_step, self.weights_step = resume(
            self.store, self.model, self.root, self.settings, save=self._save, load=self._load, seed=self._seed
        )
        released = self.store.release_model_claims(self.model)  # a dead step's, only now: see record_orphan
        if released:
            log.warning("%d group(s) were claimed by a step that never finished; they train again", released)

    def _held(self, stop_event: threading.Event) -> bool:
        """Whether to wait rather than train now (a candidate undecided, training paused, the serving step's
        checkpoint gone); once decided, the weights go on from the serving step (the incumbent's adapter and
        optimizer after a rejection or rollback)."""
        if self.settings.promote == "always":
            return False  # every step serves at once: nothing to wait for, nothing to go back to
        reason, level = hold_reason(self.store, self.settings, self.model), logging.INFO
        if reason is None:  # the serving step's files gone: someone has to put them back
            level = logging.WARNING
            self.weights_step, reason = go_on_from_serving(
                self.store, self.model, self.root, self.weights_step, self._load
            )
        if reason != self._held_for and reason is not None:
            log.log(level, "trainer: %s", reason)
        self._held_for = reason
        if reason is not None:
            self._pause(stop_event)
            return True
        return False

    def _save(
        self,
        step: int,
        *,
        metrics: dict,
        groups: list[str],
        advantages: dict[str, float] | None = None,
        left_out: dict[str, str] | None = None,
        sft: dict | None = None,
        parent: int | None = None,
    ) -> ckpts.Checkpoint:
        return ckpts.write_checkpoint(
            self.root,
            step,
            self._loaded_backend.save,
            settings=self.settings.public_dict(),
            metrics=metrics,
            groups=groups,
            token_budget=self._step_budget if self._step_budget is not None else self.token_budget,
            advantages=advantages,
            left_out=left_out,
            sft=sft,
            parent=parent,
        )

    def _load(self, path: Path) -> None:
        self._loaded_backend.load(path)
        self.token_budget = ckpts.saved_token_budget(path)
        saved = ckpts.saved_objective(path)
        if saved != self.objective:
            # AdamW's moments follow one loss: the NLL's are no estimate for GRPO's (nor back).
            self._loaded_backend.init_optimizer()
            log.info("step %s was trained with %s: %s starts with a fresh optimizer", path.name, saved, self.objective)

    def _seed(self, path: Path) -> None:
        """`--init-from`: the adapter of another run's step, with a fresh optimizer."""
        self._loaded_backend.load(path)
        self._loaded_backend.init_optimizer()
        self.token_budget = None

    # ------------------------------------------------------------------ loop

    def _pause(self, stop_event: threading.Event) -> None:
        """Wait a poll interval; the other ranks, waiting for the next step, hear that rank 0 is alive."""
        stop_event.wait(self.settings.poll_interval)
        if self.team is not None:
            self.team.announce("idle")

    def groups_to_train(self) -> list[dict] | None:
        """The groups of the next step, or None while there are too few (`trainer.selection.next_groups`)."""
        groups, skipped = next_groups(self.store, self.settings, self.model, self.attempts, self.next_step)
        self.skipped_since_step += skipped
        return groups

    def train_once(self, groups: list[dict]) -> dict | None:
        """One step on `groups`: returns its metrics, or None if nothing was trained (nothing
        trainable, the step failed, or a discard took it back). The groups are claimed first:
        from then on their rewards are refused and calls to their sessions are not trained."""
        claimed = self.store.claim_for_step([g["id"] for g in groups], self.next_step)
        if not claimed:
            return None
        groups = [self.store.get_group(gid) for gid in claimed]  # the rewards as the claim froze them
        trained = claimed  # until planned: a plan that fails (a reward that overflows) fails them all
        try:
            plan = plan_step(self.store, self.settings, self.render, groups, self.next_step, self.weights_step)
            self.skipped_since_step += plan.skipped
            trained = list(plan.trained_groups)
            if set(claimed) - set(trained):
                self.store.release_step(sorted(set(claimed) - set(trained)))  # skipped: no attempt of theirs
            if not plan.samples:
                return None
            budget = self.settings.max_tokens_norm or self.token_budget or plan.token_budget
            self._step_budget = budget
            with gpu_lease(self.store, self.model, self.settings) as lease:
                metrics = train_and_record(
                    self._loaded_backend,
                    self.store,
                    self.model,
                    self.settings,
                    plan,
                    save=self._save,
                    token_budget=budget,
                    skipped_groups=self.skipped_since_step,
                    failed_attempts=self.attempts.since_step,
                )
                if lease is not None and metrics is not None:
                    lease.step = plan.step  # the gateway loads NAME@step when it takes the GPU back
        except TeamBroken as exc:
            # A rank is gone: the claim is given back with the attempt counted (as when one process
            # dies mid-step), and the run ends; a restart trains these groups again.
            with contextlib.suppress(StoreUnavailable):
                self.store.release_step(trained, error=exc.message)
            raise
        except (EngineUnavailable, ConfigError, StoreUnavailable):
            # Not the batch's fault: give the attempt back; the run loop waits for the engine or
            # the store (a store that cannot take this either is reconciled by `_resume`).
            with contextlib.suppress(StoreUnavailable):
                self.store.release_step(trained)
            raise
        except Exception as exc:  # NonFiniteStep, out of memory, a bad batch: never the worker's end
            self.attempts.failed(trained, exc, self.next_step)
            return None
        finally:
            self._step_budget = None
        if metrics is None:  # a discard took the step back: the groups train again without it
            self.store.release_step(trained)
            return None
        self.token_budget = budget  # fixed from the first step on
        self.next_step = plan.step + 1
        self.weights_step = plan.step
        self.skipped_since_step = 0
        self.attempts.since_step = 0
        self.reporter.report_step(plan.step, metrics, self.store, self.model)
        log_step(plan.step, metrics)
        prune_checkpoints(self.store, self.model, self.root, self.settings.keep_checkpoints, self.weights_step)
        return metrics

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
                if self._lock is not None:  # PostgreSQL restarted: its lock taken again, or this worker stops
                    self._lock.check()
                if store_failed:
                    # Back only once a write commits again (the probe the gateway makes too, which ends
                    # the store's degraded state), not reloading the checkpoint at every look meanwhile.
                    asyncio.run(self.store.probe())
                    # A step may have saved its checkpoint and then failed to record it: record
                    # (or discard) that checkpoint as a restart would, and go on from it.
                    self._resume()
                    store_failed = False
                if self._held(stop_event):
                    continue
                groups = self.groups_to_train()
                if groups is None:
                    self._pause(stop_event)
                    continue
                trained = self.train_once(groups)
            except EngineUnavailable as exc:  # the gateway did not lend the GPU: try again later
                log.warning("step %d postponed: %s", self.next_step, exc.message)
                self._pause(stop_event)
                continue
            except StoreUnavailable as exc:  # full disk, lock, ...: wait for it, as the gateway does
                if not store_failed:  # said once an outage, not at every look while it lasts
                    log.warning("step %d waits for the store: %s", self.next_step, exc.message)
                store_failed = True
                self._pause(stop_event)
                continue
            if trained is not None:
                done += 1
        return done


def run_worker(
    settings: Settings,
    stop_event: threading.Event | None = None,
    max_steps: int | None = None,
    sft: SFTOptions | None = None,
) -> int:
    """Start a worker (resuming from the newest checkpoint) and train until stopped or
    `max_steps` steps are done: GRPO on ready groups, or with `sft` a supervised run over the
    sessions it selects (`trainer.sft.run`). Returns the number of steps trained."""
    from trainer.distributed.team import join, world_size_from_env

    if world_size_from_env() > 1:
        # A built-in model is built before the ranks meet: once torch.distributed is up, transformers'
        # save_pretrained writes nothing on a rank other than 0, and a build there would be left
        # without its weights. The ranks of a machine take turns (`gateway.models.cache`).
        from gateway.models.registry import resolve_base_model

        resolve_base_model(settings.base_model, settings.state_dir)
    team = join(settings)  # None alone; under torchrun this process's rank
    if team is not None and not team.is_leader:
        from trainer.follower import run_follower

        return run_follower(rank_settings(settings, team), team)
    worker = TrainerWorker(settings, objective="sft" if sft is not None else "grpo", team=team)
    try:
        worker.start()
        if sft is not None:
            from trainer.sft.run import run_sft

            return run_sft(
                worker,
                sft.where,
                epochs=sft.epochs,
                sessions_per_step=sft.sessions_per_step,
                stop_event=stop_event,
                max_steps=max_steps,
            )
        return worker.run(stop_event, max_steps)
    finally:
        worker.close()


def rank_settings(settings: Settings, team: Team | None) -> Settings:
    """The settings a rank's backend loads with: its own device (cuda:LOCAL_RANK under a team)."""
    return settings if team is None else settings.model_copy(update={"device": str(team.device)})


@dataclass(frozen=True)
class SFTOptions:
    """`rlproxy train --objective sft`: which sessions, how many passes, how many a step."""

    where: SessionFilter
    epochs: int = 1
    sessions_per_step: int = 8
