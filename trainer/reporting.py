"""Experiment tracking: `--report-to wandb|trackio|none` sends every step's metrics and the
run's settings to a tracker.

A tracker is a guest: one that is not installed, cannot start, or fails while logging is
logged as a warning and switched off, and training goes on. Each step logs the trainer's
own metrics (loss, KL, clip share, grad norm, mismatch, tokens, time, reward of the
trained groups) plus the reward mean and spread of the rollouts that step sampled, for
train and val, read from the store (`gateway.store.lists.reward_curve`, the dashboard's
curve), under `train/...` and `val/...`.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from gateway.settings import public_argv

if TYPE_CHECKING:
    from gateway.settings import Settings
    from gateway.store import Store

log = logging.getLogger("rlproxy.trainer")

CHOICES = ("none", "wandb", "trackio")


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def finish(self) -> None: ...


class _WandbTracker:
    def __init__(self, project: str, name: str | None, config: dict) -> None:
        import wandb  # imported here: an optional dependency

        # Online without credentials, wandb.init asks "Enter your choice:" on a terminal: the
        # trainer (also as `serve`'s child, which shares the terminal) would wait for an answer
        # before its first step, or die of wandb's KeyboardInterrupt when stdin is closed.
        # Ask for credentials without a prompt and refuse at start, saying what to do.
        # (A run already open in this process had credentials; login answers False beside it.)
        online = wandb.setup().settings.mode not in ("offline", "dryrun", "disabled")
        if online and wandb.run is None and not wandb.login(prompt=False, verify=False):
            raise RuntimeError("no W&B credentials: set WANDB_API_KEY, run `wandb login`, or set WANDB_MODE=offline")
        self._wandb = wandb
        # wandb writes the command line (sys.argv) into the run's metadata, uploaded beside the
        # masked config: `rlproxy train --store postgresql://user:PASSWORD@host/db` sent the
        # password to W&B. It reads the command line while the run starts: show it masked then.
        argv = sys.argv[:]
        sys.argv[1:] = public_argv(argv[1:])
        try:
            self._run = wandb.init(project=project, name=name, config=config, reinit="finish_previous")
        finally:
            sys.argv[:] = argv

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def finish(self) -> None:
        self._run.finish()


class _TrackioTracker:
    def __init__(self, project: str, name: str | None, config: dict) -> None:
        import trackio  # imported here: an optional dependency

        self._trackio = trackio
        trackio.init(project=project, name=name, config=config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._trackio.log(metrics, step=step)

    def finish(self) -> None:
        self._trackio.finish()


_TRACKERS: dict[str, Callable[[str, str | None, dict], Tracker]] = {"wandb": _WandbTracker, "trackio": _TrackioTracker}


def step_metrics(step: int, metrics: dict, curve: list[dict]) -> dict[str, float]:
    """The numbers logged for `step`: the trainer's metrics (finite numbers only) under
    `train/` (`train/reward_mean` and `train/reward_std` are the trained groups' rewards),
    and, from the store's reward curve, the rollouts of each split that the policy this
    update started from (step - 1) sampled: `{split}/sampled_reward_mean`, `_std`, `_min`,
    `_max` and `{split}/sampled_rollouts`. So `val/sampled_reward_mean` at step N is the
    val score of the policy before update N."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        out[f"train/{key}"] = float(value)
    for row in curve:
        if row["step"] != step - 1:
            continue
        split = row["split"]
        for key in ("mean", "std", "min", "max"):
            out[f"{split}/sampled_reward_{key}"] = float(row[key])
        out[f"{split}/sampled_rollouts"] = float(row["n"])
    return out


class Reporter:
    """Forwards steps to a tracker; never raises. `Reporter.create(settings)` is the hook."""

    def __init__(self, tracker: Tracker | None, name: str = "none") -> None:
        self.tracker = tracker
        self.name = name

    @classmethod
    def create(cls, settings: Settings) -> Reporter:
        choice = getattr(settings, "report_to", "none") or "none"
        if choice == "none":
            return cls(None)
        factory = _TRACKERS.get(choice)
        if factory is None:
            log.warning("--report-to %r is not one of %s: not reporting", choice, ", ".join(CHOICES))
            return cls(None)
        config = settings.public_dict()  # secrets masked
        project = getattr(settings, "report_project", None) or "rlproxy"
        try:
            tracker = factory(project, settings.model_name, config)
        except ImportError:
            log.warning(
                "--report-to %s: the %s package is not installed (pip install %s); training goes on without it",
                choice,
                choice,
                choice,
            )
            return cls(None)
        except Exception as exc:  # noqa: BLE001 - a tracker never stops training
            log.warning(
                "--report-to %s: could not start (%s: %s); training goes on without it", choice, type(exc).__name__, exc
            )
            return cls(None)
        log.info("reporting steps to %s (project %s)", choice, project)
        return cls(tracker, choice)

    def report_step(self, step: int, metrics: dict, store: Store | None = None, model: str | None = None) -> None:
        if self.tracker is None:
            return
        try:
            curve = store.reward_curve(model) if store is not None and model is not None else []
            self.tracker.log(step_metrics(step, metrics, curve), step)
        except Exception as exc:  # noqa: BLE001 - a tracker never stops training
            log.warning(
                "--report-to %s failed at step %d (%s: %s); no more reports this run",
                self.name,
                step,
                type(exc).__name__,
                exc,
            )
            self._drop()

    def close(self) -> None:
        if self.tracker is None:
            return
        try:
            self.tracker.finish()
        except Exception as exc:  # noqa: BLE001
            log.warning("--report-to %s: finishing failed (%s: %s)", self.name, type(exc).__name__, exc)
        self.tracker = None

    def _drop(self) -> None:
        tracker, self.tracker = self.tracker, None
        if tracker is None:
            return
        try:
            tracker.finish()
        except Exception:  # noqa: BLE001
            pass
