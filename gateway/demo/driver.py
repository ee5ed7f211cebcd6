"""The demo driver: the whole loop on the embedded default, watched as a reward curve.

    gateway (this process, uvicorn on a free loopback port)   trainer (`rlproxy train`, child)
        ▲  chat completions with X-Session-Id / X-Group-Id           │ trains on ready groups,
        │  rewards, group close  (all over HTTP, `openai` client)    │ saves NAME@N, step row
    the toy agent (this process)  ◄── hot-swap: NAME moves to N ─────┘

The agent plays one task of `gateway.demo` (`--task`; the shape every task has is written
there): the driver has no task-specific code. Each round samples `groups_per_step` groups
of `rollouts` parallel rollouts from whatever step `NAME` serves, posts their rewards,
closes the groups, and waits until the trainer's next step is served. A group whose
rollouts all scored the same teaches nothing (the trainer skips it), so the round samples
another one in its place.

What is measured, and why:
- baseline_reward: an evaluation on the `val` split (recorded and scored, never trained
  on) with the untrained adapter, step 0, before any training;
- reward_by_step: the mean reward of the train rollouts each step sampled, attributed by
  the `X-Model-Step` header of each response: exactly the on-policy reward GRPO sees,
  at no extra cost;
- final_reward: the same `val` evaluation as the baseline, on the last step served.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType

from gateway.demo import DEFAULT_TASK, TASKS, load_task
from gateway.errors import ConfigError, RLProxyError
from gateway.models.tuning import TINY_MODEL_SETTINGS
from gateway.settings import KEEP_ALIVE_SECONDS, Settings

log = logging.getLogger("rlproxy.demo")

# The demo's settings (flags and RLPROXY_* env win): the built-in model's tuning (the same
# that `rlproxy serve` uses on it), a quick hot-swap, a quiet screen; then the task's own.
DEMO_SETTINGS = {
    **TINY_MODEL_SETTINGS,
    "poll_interval": 0.2,
    "keep_adapters": 2,
    "max_batch_size": 32,
    "log_level": "warning",
}

AIM_BASELINE_AT_MOST = 0.3
AIM_FINAL_AT_LEAST = 0.8


@dataclass
class DemoOptions:
    task: str = DEFAULT_TASK
    out: Path = Path("rlproxy-demo")
    steps: int = 60  # training steps at most (a converged run stops early)
    rollouts: int = 8  # rollouts per group (GRPO compares them)
    seconds: float = 300.0  # budget: no new round starts after this
    max_tokens: int = 6  # reply length: short replies keep a round well under a second
    eval_groups: int = 4  # the held-out set: eval_groups x rollouts tasks, one per val rollout
    converge_after: int = 8  # train groups in a row where every rollout earns the full reward end the run


_TASK_OPTIONS = ("steps", "rollouts", "seconds", "max_tokens", "eval_groups", "converge_after")


@dataclass
class Record:
    """What the agent saw, for the summary and the curve."""

    baseline_reward: float | None = None
    final_reward: float | None = None
    final_step: int | None = None
    rewards_by_step: dict[int, list[float]] = field(default_factory=dict)
    # mean |log pi_old - log mu| over the tokens step N sampled, as the trainer measured it when it
    # trained step N + 1 on them: how far the engine's behaviour logprobs are from the trainer's
    mismatch_by_step: dict[int, float] = field(default_factory=dict)
    groups_skipped: int = 0
    stopped_because: str = ""


# ---------------------------------------------------------------------------- settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's own flags (the settings flags are added by the CLI)."""
    defaults = DemoOptions()
    group = parser.add_argument_group("demo")
    group.add_argument(
        "--task",
        choices=TASKS,
        default=DEFAULT_TASK,
        help=f"what the agent learns (default: {DEFAULT_TASK}); each is a module of gateway.demo",
    )
    group.add_argument(
        "--out",
        type=Path,
        default=defaults.out,
        help=f"where summary.json, reward_curve.png and the logs go (default: {defaults.out})",
    )
    group.add_argument(
        "--steps", type=int, default=None, help=f"training steps to run (default: the task's, else {defaults.steps})"
    )
    group.add_argument(
        "--rollouts",
        type=int,
        default=None,
        help=f"rollouts per group, sampled in parallel (default: the task's, else {defaults.rollouts})",
    )
    group.add_argument(
        "--seconds",
        type=float,
        default=None,
        help=f"time budget: no new round starts after it (default: the task's, else {defaults.seconds:g})",
    )
    group.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"tokens per reply (default: the task's, else {defaults.max_tokens})",
    )
    group.add_argument(
        "--eval-groups",
        type=int,
        default=None,
        help=f"the held-out set, in groups of --rollouts tasks (one task per val rollout), played "
        f"for the baseline and the final score (default: the task's, else "
        f"{defaults.eval_groups})",
    )
    group.add_argument(
        "--converge-after",
        type=int,
        default=None,
        help=f"stop once this many train groups in a row gave every rollout the full reward: "
        f"nothing is left to learn from them (default: the task's, else {defaults.converge_after})",
    )


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    """Flags > the task's OPTIONS > DemoOptions' defaults."""
    task = load_task(getattr(args, "task", DEFAULT_TASK))
    chosen = {
        **{k: v for k, v in task.OPTIONS.items() if k in _TASK_OPTIONS},
        **{k: getattr(args, k) for k in _TASK_OPTIONS if getattr(args, k, None) is not None},
    }
    options = DemoOptions(task=task.NAME, out=args.out, **chosen)
    for name in ("steps", "rollouts", "max_tokens", "eval_groups", "converge_after"):
        if getattr(options, name) < (2 if name == "rollouts" else 1):
            raise ConfigError(
                f"--{name.replace('_', '-')} must be at least {2 if name == 'rollouts' else 1}"
                + (" (GRPO compares rollouts of one group)" if name == "rollouts" else "")
            )
    if options.seconds <= 0:
        raise ConfigError("--seconds must be positive")
    return options


def demo_settings(given: dict, out: Path, task: str = DEFAULT_TASK) -> Settings:
    """Flags > RLPROXY_* environment > the task's tuning > the demo's > Settings' defaults.
    The state dir defaults to OUT/state, so a demo never trains on top of another store."""
    tuned = {
        k: v
        for k, v in {**DEMO_SETTINGS, **load_task(task).SETTINGS}.items()
        if f"RLPROXY_{k.upper()}" not in os.environ
    }
    if "state_dir" not in given and "RLPROXY_STATE_DIR" not in os.environ:
        tuned["state_dir"] = out / "state"
    settings = Settings(**{**tuned, **given})
    if settings.engine == "openai":
        raise ConfigError(
            "the demo trains the model it serves, and an OpenAI-compatible upstream serves no "
            "adapters: use --engine local (the default) or --engine vllm"
        )
    if settings.engine == "vllm":
        if settings.vllm_url:
            raise ConfigError(
                "the demo starts and stops its own vLLM: drop --vllm-url and give --vllm-python "
                "(the python of the environment vLLM is installed in), or have `vllm` on PATH"
            )
        if "vllm_port" not in given and "RLPROXY_VLLM_PORT" not in os.environ:
            with contextlib.closing(_free_socket()) as sock:  # a port of its own: never another vLLM's 8001
                settings = Settings(**{**tuned, **given, "vllm_port": sock.getsockname()[1]})
    return settings


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


# ---------------------------------------------------------------------------- processes


def _free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # the OS picks a free port; uvicorn serves on this very socket
    return sock


@contextlib.contextmanager
def _gateway(settings: Settings):
    """The gateway under uvicorn in a thread of this process; yields its base URL."""
    import uvicorn

    from gateway.app import create_app

    sock = _free_socket()
    # Keep-alive longer than the clients' (httpx, and so openai: 5 s): with uvicorn's default of
    # 5 s both ends drop an idle connection at the same moment, and a round starting just then
    # reuses a connection the server is closing (ReadError).
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(settings),
            log_level=settings.log_level,
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_keep_alive=KEEP_ALIVE_SECONDS,
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="rlproxy-demo-gateway", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RLProxyError(
                    "the gateway failed to start; see gateway.log"
                    + (" and state/vllm.log" if settings.engine == "vllm" else "")
                )
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)  # its shutdown stops a managed vLLM (SIGTERM, SIGKILL after 30 s)
        sock.close()


def _die_with_parent() -> None:
    """In the trainer child: have Linux SIGTERM it if the demo dies, even by SIGKILL."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _settings_flags(settings: Settings) -> list[str]:
    """The settings as `rlproxy train` flags (no secrets: the trainer needs none)."""
    argv: list[str] = []
    for name, value in settings.public_dict().items():
        if value is None or name in ("api_key", "upstream_api_key"):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):  # switches take no value: --x / --no-x
            argv.append(flag if value else "--no-" + flag[2:])
            continue
        for item in value if isinstance(value, list) else [value]:
            argv.append(f"{flag}={item}")  # one token: a value may itself start with "--" (--vllm-arg)
    return argv


class Trainer:
    """`rlproxy train` as a child process, its output in OUT/trainer.log."""

    def __init__(self, settings: Settings, log_path: Path, threads: int):
        self.log_path = log_path
        env = {**os.environ, "RLPROXY_TORCH_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
        # Its log is a file the user reads afterwards: one line per step is worth having.
        cmd = [sys.executable, "-m", "gateway.cli", "train", *_settings_flags(settings), "--log-level", "info"]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RLProxyError(f"the trainer exited with code {self.proc.returncode}:\n{tail}")

    def stop(self) -> None:
        """SIGTERM (it finishes its step and exits), then SIGKILL to its group if it lingers."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


# ---------------------------------------------------------------------------- the agent


class Agent:
    """Plays the task's episodes against the gateway over its real HTTP API."""

    def __init__(
        self, url: str, settings: Settings, options: DemoOptions, trainer: Trainer, deadline: float, task: ModuleType
    ):
        import httpx
        import openai

        self.settings = settings
        self.options = options
        self.task = task
        self.trainer = trainer
        self.deadline = deadline
        self.model = settings.model_name
        self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="demo", max_retries=2, timeout=120)
        self.http = httpx.AsyncClient(base_url=url, timeout=120)
        self.rng = random.Random(settings.seed)
        # The held-out set: one task per val rollout (not one per group: a trained policy plays
        # a group's shared task nearly the same way 16 times, so 8 groups would score ~8 games),
        # drawn once, so the baseline and the final score are measured on the same tasks.
        val_rng = random.Random(f"val-{settings.seed}")
        self.val_specs = [task.sample(val_rng) for _ in range(options.eval_groups * options.rollouts)]
        self.record = Record()
        self.pending: list[str] = []  # train groups closed but not yet trained or skipped
        self.perfect_in_a_row = 0  # train groups in a row where every rollout got the full reward, across steps
        self._groups = 0

    async def close(self) -> None:
        await self.client.close()
        await self.http.aclose()

    async def served_step(self) -> int | None:
        response = await self.http.get("/healthz")
        response.raise_for_status()
        return response.json().get("step")

    async def read_mismatch(self, sampled_by: int | None = None) -> None:
        """The sampler/trainer mismatch of every step trained so far, from the step rows;
        waiting a moment for the one measured on what step `sampled_by` sampled (the trainer
        records a step just after it saves the adapter the gateway may already serve)."""
        for _ in range(20):
            response = await self.http.get("/v1/training/steps")
            response.raise_for_status()
            for row in response.json()["data"]:
                mismatch = (row.get("metrics") or {}).get("mismatch_logprob_abs")
                if row["step"] > 0 and mismatch is not None:
                    self.record.mismatch_by_step[row["step"] - 1] = float(mismatch)
            if sampled_by is None or sampled_by in self.record.mismatch_by_step:
                return
            await asyncio.sleep(0.1)

    async def rollout(self, group_id: str, index: int, spec, split: str) -> tuple[float, float, int | None]:
        """One session: the task's episode, each of its model calls a chat completion in this
        session; its reward posted. Returns (score, training reward, the oldest step that
        answered)."""
        session_id = f"{group_id}-r{index}"
        steps: list[int] = []

        async def chat(messages: list[dict]) -> str | None:
            raw = await self.client.chat.completions.with_raw_response.create(
                model=self.model,
                messages=messages,
                max_tokens=self.options.max_tokens,
                temperature=1.0,
                seed=self.rng.getrandbits(31),
                extra_headers={"X-Session-Id": session_id, "X-Group-Id": group_id, "X-Split": split},
            )
            step = raw.headers.get("x-model-step")
            if step is not None:
                steps.append(int(step))
            return raw.parse().choices[0].message.content

        result = await self.task.episode(spec, chat)
        reward, score = (float(result), float(result)) if isinstance(result, (int, float)) else map(float, result)
        posted = reward if split == "train" else score  # val is never trained: it gets the score itself
        (
            await self.http.post(
                f"/v1/sessions/{session_id}/reward", json={"reward": posted, "metrics": {"score": score}}
            )
        ).raise_for_status()
        return score, reward, min(steps, default=None)

    async def group(self, split: str, specs: list | None = None) -> tuple[str, list[tuple[float, float, int | None]]]:
        """`rollouts` rollouts in parallel, then the group is closed (ready). A train group's
        rollouts share one task (GRPO compares them); `specs` gives each rollout its own."""
        self._groups += 1
        group_id = f"demo-{split}-{self._groups:05d}"
        specs = specs or [self.task.sample(self.rng)] * self.options.rollouts
        results = await asyncio.gather(*(self.rollout(group_id, i, spec, split) for i, spec in enumerate(specs)))
        (await self.http.post(f"/v1/groups/{group_id}/close", json={})).raise_for_status()
        return group_id, list(results)

    async def evaluate(self) -> tuple[float, int | None]:
        """Mean score over the held-out set (val sessions, never trained on), and the step that answered."""
        n = self.options.rollouts
        groups = await asyncio.gather(
            *(self.group("val", self.val_specs[i : i + n]) for i in range(0, len(self.val_specs), n))
        )
        results = [result for _, rollouts in groups for result in rollouts]
        answered_by = [step for _, _, step in results if step is not None]
        return sum(score for score, _, _ in results) / len(results), max(answered_by, default=None)

    async def wait_for_step(self, step: int, what: str) -> None:
        while True:
            served = await self.served_step()
            if served is not None and served >= step:
                return
            self.trainer.check_alive()
            if time.monotonic() > self.deadline + 120:
                raise RLProxyError(f"gave up waiting for {what}; see trainer.log and gateway.log")
            await asyncio.sleep(0.1)

    async def _still_pending(self, group_id: str) -> bool:
        response = await self.http.get(f"/v1/groups/{group_id}")
        response.raise_for_status()
        group = response.json()
        return group.get("trained_step") is None and not group.get("skipped")

    async def train_round(self, step: int) -> str | None:
        """Sample groups from `step` until the trainer's next step is served. Returns why
        the run should stop instead, or None."""
        checked = -math.inf  # a new step just took some pending groups: look at once
        while True:
            served = await self.served_step()
            if served is not None and served > step:
                return None
            self.trainer.check_alive()
            if time.monotonic() > self.deadline:
                return "time budget"
            if time.monotonic() - checked > 2.0:
                # Which groups did the new step take? Later, rarely needed: the store has the last word.
                self.pending = [g for g in self.pending if await self._still_pending(g)]
                checked = time.monotonic()
            missing = self.settings.groups_per_step - len(self.pending)
            if missing <= 0:
                await asyncio.sleep(0.05)
                continue
            for group_id, results in await asyncio.gather(*(self.group("train") for _ in range(missing))):
                for score, _, sampled_by in results:
                    if sampled_by is not None:
                        self.record.rewards_by_step.setdefault(sampled_by, []).append(score)
                rewards = [reward for _, reward, _ in results]  # what the trainer sees
                if max(rewards) - min(rewards) > 1e-6:
                    self.pending.append(group_id)
                else:  # no spread: the trainer skips it (nothing to learn), so another takes its place
                    self.record.groups_skipped += 1
                self.perfect_in_a_row = self.perfect_in_a_row + 1 if min(rewards) >= 1.0 else 0
            if self.perfect_in_a_row >= self.options.converge_after:
                return "converged"  # every rollout earns the full reward: no group has anything left to teach


async def _drive(
    url: str, settings: Settings, options: DemoOptions, trainer: Trainer, deadline: float, progress: bool
) -> Record:
    from tqdm import tqdm

    agent = Agent(url, settings, options, trainer, deadline, load_task(options.task))
    record = agent.record
    try:
        await agent.wait_for_step(0, "the untrained adapter (step 0)")
        record.baseline_reward, _ = await agent.evaluate()
        bar = tqdm(
            total=options.steps,
            desc="training",
            unit="step",
            disable=not progress,
            leave=True,
            bar_format="{desc}: {n_fmt}/{total_fmt} steps |{bar}| {elapsed}{postfix}",
        )
        bar.set_postfix_str(f"baseline reward {record.baseline_reward:.2f}")
        try:
            step = 0
            while step < options.steps:
                stop = await agent.train_round(step)
                rewards = record.rewards_by_step.get(step, [])
                await agent.read_mismatch(step if stop is None else None)
                if rewards and progress:
                    mismatch = record.mismatch_by_step.get(step)
                    bar.write(
                        f"step {step:3d}: reward {sum(rewards) / len(rewards):.2f}  ({len(rewards)} rollouts"
                        + ("" if mismatch is None else f", mismatch {mismatch:.1e}")
                        + ")"
                    )
                if stop is not None:
                    record.stopped_because = stop
                    break
                if rewards:
                    bar.set_postfix_str(f"reward {sum(rewards) / len(rewards):.2f} (step {step})")
                step = await agent.served_step()
                bar.update(step - bar.n)
            else:
                record.stopped_because = "steps"
        finally:
            bar.close()
        record.final_reward, record.final_step = await agent.evaluate()
        await agent.read_mismatch()
    finally:
        await agent.close()
    return record


# ---------------------------------------------------------------------------- outputs


def summarize(
    record: Record, settings: Settings, options: DemoOptions, seconds: float, startup_seconds: float = 0.0
) -> dict:
    task = load_task(options.task)
    by_step = {str(step): sum(r) / len(r) for step, r in sorted(record.rewards_by_step.items())}
    reached = (
        record.baseline_reward is not None
        and record.final_reward is not None
        and record.baseline_reward <= AIM_BASELINE_AT_MOST
        and record.final_reward >= AIM_FINAL_AT_LEAST
    )
    return {
        "task": task.NAME,
        "task_description": task.DESCRIPTION,
        "baseline_reward": record.baseline_reward,
        "final_reward": record.final_reward,
        "final_step": record.final_step,
        "reward_by_step": by_step,
        "rollouts_by_step": {str(step): len(r) for step, r in sorted(record.rewards_by_step.items())},
        "mismatch_by_step": {str(step): m for step, m in sorted(record.mismatch_by_step.items())},
        "groups_skipped": record.groups_skipped,
        "stopped_because": record.stopped_because,
        "engine": settings.engine,
        "seconds": round(seconds, 1),
        "startup_seconds": round(startup_seconds, 1),
        "aim": {"baseline_at_most": AIM_BASELINE_AT_MOST, "final_at_least": AIM_FINAL_AT_LEAST, "reached": reached},
        "demo": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items()},
        "settings": settings.public_dict(),
    }


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    steps = [int(s) for s in summary["reward_by_step"]]
    rewards = list(summary["reward_by_step"].values())
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, rewards, marker="o", markersize=3, label="train rollouts (mean reward per step)")
    if summary["baseline_reward"] is not None:
        ax.scatter([0], [summary["baseline_reward"]], color="tab:red", zorder=3, label="baseline (val, step 0)")
    if summary["final_reward"] is not None:
        ax.scatter(
            [summary["final_step"] or 0],
            [summary["final_reward"]],
            color="tab:green",
            zorder=3,
            label=f"final (val, step {summary['final_step']})",
        )
    ax.axhline(AIM_FINAL_AT_LEAST, color="grey", linestyle="--", linewidth=1, label=f"aim {AIM_FINAL_AT_LEAST}")
    ax.set(
        xlabel="training step (adapter that sampled)",
        ylabel="reward",
        ylim=(-0.02, 1.02),
        title=f"rlproxy demo: {summary['task']} ({summary['seconds']:.0f} s)",
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------------------- entry point


def _configure_logging(settings: Settings, path: Path) -> logging.Handler:
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(min(logging.INFO, logging.getLevelName(settings.log_level.upper())))
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the agent's own requests: one line each
    return handler


def run_demo(settings: Settings, options: DemoOptions, *, progress: bool = True) -> dict:
    """Run gateway + trainer + agent; write OUT/summary.json and OUT/reward_curve.png."""
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    _prepare_state(settings, out)
    # A built-in model is built on first use (the instruct one takes a minute or two, with
    # progress logged): like a download, that is not the demo's time, nor its budget's.
    from transformers.utils import logging as hf_logging

    from gateway.models.tiny import resolve_base_model

    hf_logging.disable_progress_bar()  # its bars (writing the built model, loading) are not the demo's
    resolve_base_model(settings.base_model, settings.state_dir)
    handler = _configure_logging(settings, out / "gateway.log")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
    # Two processes on the same cores: each gets half, or their OpenMP threads fight.
    threads = max(1, (os.cpu_count() or 2) // 2)
    torch.set_num_threads(threads)
    print(
        f"rlproxy demo --task {options.task}: {load_task(options.task).DESCRIPTION}\n"
        f"  {options.steps} steps x {settings.groups_per_step} groups x "
        f"{options.rollouts} rollouts; outputs in {out}/",
        file=sys.stderr,
    )
    if settings.engine == "vllm":
        print(
            f"  starting vLLM on port {settings.vllm_port} (a minute on a CPU; its log: "
            f"{settings.state_dir / 'vllm.log'})",
            file=sys.stderr,
        )
    starting = time.monotonic()
    trainer = None
    try:
        with _gateway(settings) as url:
            # The engine is up (vLLM started and healthy): from here on is the demo's time and budget.
            started = time.monotonic()
            trainer = Trainer(settings, out / "trainer.log", threads)
            try:
                record = asyncio.run(_drive(url, settings, options, trainer, started + options.seconds, progress))
            finally:
                trainer.stop()
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    summary = summarize(record, settings, options, time.monotonic() - started, started - starting)
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
    return (
        f"baseline reward {summary['baseline_reward']:.2f} -> final reward "
        f"{final if final is None else f'{final:.2f}'} at step {summary['final_step']} "
        f"in {summary['seconds']:.0f} s ({summary['stopped_because']}): {verdict}"
    )
