"""The demo driver: the whole loop on the embedded default, watched as a reward curve.

    gateway (this process, uvicorn on a free loopback port)   trainer (`rlproxy train`, child)
        ▲  chat completions with X-Session-Id / X-Group-Id           │ trains on ready groups,
        │  rewards, group close  (all over HTTP, `openai` client)    │ saves NAME@N, step row
    the toy agent (this process)  ◄── hot-swap: NAME moves to N ─────┘

The agent plays one task of `gateway.demo` (`--task`; the shape every task has is written
there): the driver has no task-specific code. `options` builds the demo's options and
settings, `processes` runs the gateway and the trainer, `agent` plays the rounds (and shows
the progress), `summary` writes what was measured; this module runs them in order and
words the closing line (`report`).

What is measured, and why:
- baseline_reward: an evaluation on the `val` split (recorded and scored, never trained
  on) with the untrained adapter, step 0, before any training;
- reward_by_step: the mean reward of the train rollouts each step sampled, attributed by
  the `X-Model-Step` header of each response: exactly the on-policy reward GRPO sees,
  at no extra cost;
- final_reward: the same `val` evaluation as the baseline, on the last step served.

With `--live rewards|shadows` the agent's part is `live` instead of `agent`'s rounds: a
Poisson stream of sessions with no group, rewarded late or never (`live` says how), scored
on the same `val` set before and after.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import TextIO

from gateway.demo import load_task
from gateway.demo.agent import drive
from gateway.demo.judge import ScriptedJudge
from gateway.demo.live import drive_live
from gateway.demo.options import LIVE_ARRIVAL_RATES, DemoOptions, live_settings
from gateway.demo.processes import Trainer, serve_gateway
from gateway.demo.summary import plot, summarize
from gateway.demo.warm_start import warm_start
from gateway.errors import ConfigError
from gateway.settings import Settings
from trainer.lock import hold_pid_file

log = logging.getLogger("rlproxy.demo")


def _prepare_state(settings: Settings, out: Path) -> None:
    """Start from an untrained model: the demo's own state dir is cleared (the built-in
    model's cache is kept); a state dir given by the user must hold no steps of the model."""
    state = Path(settings.state_dir)
    if state.resolve() == (out / "state").resolve():
        for leftover in (settings.db_path, Path(f"{settings.db_path}-wal"), Path(f"{settings.db_path}-shm")):
            leftover.unlink(missing_ok=True)
        shutil.rmtree(settings.models_dir, ignore_errors=True)
        return
    if settings.checkpoints_dir().is_dir() and any(settings.checkpoints_dir().iterdir()):
        raise ConfigError(
            f"{settings.checkpoints_dir()} already holds checkpoints: the demo trains from scratch; "
            "give an empty --state-dir or another --model-name"
        )


def _hold_out_dir(out: Path) -> TextIO:
    """An exclusive `flock` on OUT/.demo.lock, held until the demo ends (the kernel drops it when
    the process dies, even by SIGKILL). A second demo on the same --out used to clear the first's
    store and checkpoints under it: both then ran on, their trainers saving steps into one
    checkpoint directory, and both wrote one summary.json, with rc 0."""
    return hold_pid_file(
        out / ".demo.lock",
        lambda holder: ConfigError(
            f"--out {out} is in use by another rlproxy demo ({holder}): wait for it to end, or give another --out"
        ),
    )


def _configure_logging(settings: Settings, path: Path) -> logging.Handler:
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(min(logging.INFO, logging.getLevelName(settings.log_level.upper())))
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the agent's own requests: one line each
    for name in ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy"):  # --live shadows: a line per judge call
        logging.getLogger(name).setLevel(logging.WARNING)
    return handler


def run_demo(settings: Settings, options: DemoOptions, *, progress: bool = True) -> dict:
    """Run gateway + trainer + agent; write OUT/summary.json and OUT/reward_curve.png."""
    out = Path(options.out)
    try:  # a file, or under one: one line, not mkdir's traceback
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = (
            "it or a folder on its path is a file" if isinstance(exc, (FileExistsError, NotADirectoryError)) else exc
        )
        raise ConfigError(
            f"--out {out} cannot be used ({reason}): pass a directory (it is created if missing)"
        ) from None
    with contextlib.closing(_hold_out_dir(out)):
        return _run(settings, options, out, progress)


def _run(settings: Settings, options: DemoOptions, out: Path, progress: bool) -> dict:
    _prepare_state(settings, out)
    # A built-in model is built on first use (the instruct one takes a minute or two, with
    # progress logged): like a download, that is not the demo's time, nor its budget's.
    from transformers.utils import logging as hf_logging

    from gateway.models.registry import resolve_base_model

    hf_logging.disable_progress_bar()  # its bars (writing the built model, loading) are not the demo's
    resolve_base_model(settings.base_model, settings.state_dir)
    handler = _configure_logging(settings, out / "gateway.log")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
    # Two processes on the same cores: each gets half, or their OpenMP threads fight.
    threads = max(1, (os.cpu_count() or 2) // 2)
    torch.set_num_threads(threads)
    shape = (
        f"steps at most, live {options.live}: {options.arrival_rate or LIVE_ARRIVAL_RATES[options.live]:g} "
        f"sessions/s, groups of {options.rollouts}"
        if options.live
        else f"steps x {settings.groups_per_step} groups x {options.rollouts} rollouts"
    )
    print(
        f"rlproxy demo --task {options.task}: {load_task(options.task).DESCRIPTION}\n"
        f"  {options.steps} {shape}; outputs in {out}/",
        file=sys.stderr,
    )
    if settings.engine == "vllm":
        print(
            f"  starting vLLM (a minute on a CPU; its log: {settings.state_dir / 'vllm.log'})",
            file=sys.stderr,
        )
    starting = time.monotonic()
    warm = warm_start(settings, options, out, threads) if options.warm_start else None
    trainer = live = None
    try:
        with contextlib.ExitStack() as stack:
            # --live shadows: the scripted judge the gateway's RULER reaches through litellm
            shadows = options.live == "shadows"
            judge = stack.enter_context(ScriptedJudge(load_task(options.task).reward)) if shadows else None
            settings = live_settings(settings, options, judge.url if judge else None)
            url = stack.enter_context(serve_gateway(settings))
            # The engine is up (vLLM started and healthy): from here on is the demo's time and budget.
            started = time.monotonic()
            trainer = Trainer(settings, out / "trainer.log", threads, max_steps=options.steps)
            try:
                deadline = started + options.seconds
                if options.live:
                    record, live = asyncio.run(drive_live(url, settings, options, trainer, deadline, progress))
                else:
                    record = asyncio.run(drive(url, settings, options, trainer, deadline, progress))
            finally:
                trainer.stop()
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    summary = summarize(record, settings, options, time.monotonic() - started, started - starting, warm, starting, live)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(summary, out / "reward_curve.png")
    return summary


def report(summary: dict) -> str:
    """The closing lines a newcomer reads."""
    aim = summary["aim"]
    verdict = (
        "aim reached"
        if aim["reached"]
        else (f"aim not reached (baseline <= {aim['baseline_at_most']}, final >= {aim['final_at_least']})")
    )
    final = summary["final_reward"]
    warm = summary.get("warm_start")
    live = summary.get("live")
    stream = ""
    if live:
        posted = (
            f"{live['rewarded']} rewarded ({live['stale_rewards']} stale)"
            if live["mode"] == "rewards"
            else f"no reward posted, {live['groups_judged']} shadow groups judged"
        )
        trained = f"{live['groups_trained']} {live['origin']} groups trained"
        stream = f"live {live['mode']}: {live['sessions']} sessions, {posted}, {trained}\n"
    before = "after the warm start (sft)" if warm else "baseline"
    return stream + (
        f"{before} reward {summary['baseline_reward']:.2f} -> final reward "
        f"{final if final is None else f'{final:.2f}'} at step {summary['final_step']} "
        f"in {summary['seconds']:.0f} s ({summary['stopped_because']}): {verdict}"
    )
