"""The demo's options and settings: its own flags, the task's choices, the demo's tuning.

Each option and setting is taken from, first to last: the flag, the `RLPROXY_*`
environment (settings only), the task's `OPTIONS` / `SETTINGS`, the demo's defaults
(`DemoOptions`, `DEMO_SETTINGS`), `Settings`' defaults.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from gateway.demo import DEFAULT_TASK, TASKS, load_task
from gateway.errors import ConfigError
from gateway.export.selection import finite  # nan and inf refused: `--arrival-rate inf` spawned sessions forever
from gateway.models.tuning import tuned_defaults
from gateway.settings import Settings

# The demo's settings (flags and RLPROXY_* env win): the model's tuning (the same that
# `rlproxy serve` uses on it), a quick hot-swap, a quiet screen; then the task's own.
DEMO_SETTINGS = {
    "poll_interval": 0.2,
    "keep_adapters": 2,
    "max_batch_size": 32,
    "log_level": "warning",
}


@dataclass
class DemoOptions:
    task: str = DEFAULT_TASK
    out: Path = Path("rlproxy-demo")
    steps: int = 60  # training steps at most (a converged run stops early)
    rollouts: int = 8  # rollouts per group (GRPO compares them)
    seconds: float = 300.0  # budget: no new round starts after this
    max_tokens: int = 6  # reply length: short replies keep a round well under a second
    eval_groups: int = 4  # the held-out set: eval_groups x rollouts tasks, one per val rollout
    eval_temperature: float = 1.0  # the held-out set's sampling temperature (0: greedy); training samples at 1
    converge_after: int = 8  # train groups in a row where every rollout earns the full reward end the run
    warm_start: str | None = None  # "sft": distil the task's teacher before GRPO (`gateway.demo.warm_start`)
    teacher_games: int = 256  # --warm-start: the teacher's recorded games
    warm_start_epochs: int = 2  # --warm-start: passes over them
    live: str | None = None  # "rewards" or "shadows": a stream of live sessions, no harness (`gateway.demo.live`)
    arrival_rate: float | None = None  # --live: sessions per second, Poisson arrivals (None: LIVE_ARRIVAL_RATES)
    reward_delay: float = 1.0  # --live rewards: each reward is posted after a uniform delay in [0, this] s
    unrewarded_share: float = 0.2  # --live rewards: the share of sessions never rewarded
    shuffle_rewards: bool = False  # --live rewards, a control: each session is posted another recent session's score


_CEILINGS = {"rollouts": 64, "eval_groups": 64}
"""A demo's toy agent runs on the machine's CPU: `--rollouts 100000` played 400,000 sessions of
the held-out set before it trained at all. 64 keeps a --live shadows demo (--rollouts - 1 shadow samples) within
--shadow-samples' own ceiling."""
_TASK_OPTIONS = ("steps", "rollouts", "seconds", "max_tokens", "eval_groups", "eval_temperature", "converge_after")
_LIVE_OPTIONS = ("live", "arrival_rate", "reward_delay", "unrewarded_share", "shuffle_rewards")
LIVE_ARRIVAL_RATES = {"rewards": 32.0, "shadows": 4.0}
"""--live's default sessions per second, on 2 CPU cores: with rewards, 40 sessions make a step's
4 live groups of 8 (a fifth are never rewarded), about a second and a half of traffic; with
shadows, each call brings 7 more completions, and shadows wait for an engine with no live call
in it (they yield to live load), so the stream leaves it quiet most of the time."""


# The settings flags that mean more in a demo than in `serve` (cli.py shows these instead).
SETTINGS_HELP = {
    "state_dir": "where the demo's store, checkpoints and model live (default: OUT/state)",
    "seed": "seeds the trainer, the agent's prompts, the val set and sampling: another seed, another run (default: 0)",
}


def settings_help(name: str, text: str | None) -> str | None:
    """A settings flag's help in `demo --help`: its default where the demo or a task sets its own
    (`DEMO_SETTINGS`, the tasks' `SETTINGS`), not `serve`'s (`--log-level` read "default: info"
    and `--poll-interval` "1.0" where the demo runs at warning and 0.2)."""
    if name in SETTINGS_HELP or not text:
        return SETTINGS_HELP.get(name, text)
    by_task = {task: load_task(task).SETTINGS[name] for task in TASKS if name in load_task(task).SETTINGS}
    if name not in DEMO_SETTINGS and not by_task:
        return text
    base = DEMO_SETTINGS.get(name, Settings.model_fields[name].default)
    shown = [f"{by_task.get(task, base)} with --task {task}" for task in TASKS if by_task.get(task, base) != base]
    if len(by_task) < len(TASKS):  # some task keeps the demo's own
        shown.insert(0, str(base))
    head, _, tail = text.rpartition("default: ")  # the last: a description may say "default" itself
    rest = tail[min((i for i in (tail.find(";"), tail.find(")")) if i >= 0), default=len(tail)) :]
    return f"{head}default in the demo: {', '.join(shown)}{rest}"


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
        type=finite,
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
        "--eval-temperature",
        type=finite,
        default=None,
        help=f"the temperature the held-out set is played at, 0 for greedy; training rollouts sample "
        f"at 1 (default: the task's, else {defaults.eval_temperature:g})",
    )
    group.add_argument(
        "--converge-after",
        type=int,
        default=None,
        help=f"stop once this many train groups in a row gave every rollout the full reward: "
        f"nothing is left to learn from them (default: the task's, else {defaults.converge_after})",
    )
    _add_warm_start(group)
    _add_live(group)


def _add_live(group) -> None:
    defaults = DemoOptions()
    group.add_argument(
        "--live",
        choices=["rewards", "shadows"],
        default=None,
        help="learn from live traffic instead of harness groups: a Poisson stream of sessions with no "
        "X-Group-Id. rewards: a share of them is rewarded after a delay and the gateway gathers them into "
        "live groups (--live-group-size = --rollouts); shadows: no reward is ever posted, the gateway "
        "samples --rollouts - 1 shadow completions beside each call and a scripted RULER judge ranks them",
    )
    group.add_argument(
        "--arrival-rate",
        type=finite,
        default=None,
        help="--live: sessions per second, Poisson arrivals (default: "
        + ", ".join(f"{rate:g} with {mode}" for mode, rate in LIVE_ARRIVAL_RATES.items())
        + ")",
    )
    group.add_argument(
        "--reward-delay",
        type=finite,
        default=None,
        help=f"--live rewards: each reward is posted after a random delay of up to this many seconds "
        f"(default {defaults.reward_delay:g})",
    )
    group.add_argument(
        "--unrewarded-share",
        type=finite,
        default=None,
        help=f"--live rewards: the share of sessions never rewarded (default {defaults.unrewarded_share:g})",
    )
    group.add_argument(
        "--shuffle-rewards",
        action="store_true",
        help="--live rewards, a control: post each session another recent session's score, so rewards "
        "say nothing about the reply they are posted for (nothing should be learned)",
    )


def _add_warm_start(group) -> None:
    defaults = DemoOptions()
    group.add_argument(
        "--warm-start",
        choices=["sft"],
        default=None,
        help="sft: first record the task's scripted teacher through a gateway (--engine openai) and "
        "distil it with `rlproxy train --objective sft`, then run GRPO from there (tictactoe)",
    )
    group.add_argument(
        "--teacher-games",
        type=int,
        default=None,
        help=f"--warm-start: the teacher's games recorded (default {defaults.teacher_games})",
    )
    group.add_argument(
        "--warm-start-epochs",
        type=int,
        default=None,
        help=f"--warm-start: passes over them (default {defaults.warm_start_epochs})",
    )


def options_from_args(args: argparse.Namespace) -> DemoOptions:
    """Flags > the task's OPTIONS > DemoOptions' defaults."""
    task = load_task(getattr(args, "task", DEFAULT_TASK))
    chosen = {
        **{k: v for k, v in task.OPTIONS.items() if k in _TASK_OPTIONS},
        **{k: getattr(args, k) for k in _TASK_OPTIONS if getattr(args, k, None) is not None},
    }
    _check_modes(args)
    warm = {k: _given(args, k) for k in ("warm_start", "teacher_games", "warm_start_epochs")}
    live = {k: _given(args, k) for k in _LIVE_OPTIONS}
    options = DemoOptions(task=task.NAME, out=args.out, **chosen, **warm, **live)
    _check_live(options, task)
    if options.warm_start and not hasattr(task, "teacher_reply"):  # here, before the demo clears OUT/state
        raise ConfigError(f"--warm-start sft needs a task with a teacher; '{task.NAME}' has none (tictactoe has)")
    if options.teacher_games < 8 or options.warm_start_epochs < 1:
        raise ConfigError("--teacher-games must be at least 8 and --warm-start-epochs at least 1")
    for name in ("steps", "rollouts", "max_tokens", "eval_groups", "converge_after"):
        if getattr(options, name) < (2 if name == "rollouts" else 1):
            raise ConfigError(
                f"--{name.replace('_', '-')} must be at least {2 if name == 'rollouts' else 1}"
                + (" (GRPO compares rollouts of one group)" if name == "rollouts" else "")
            )
    for name, most in _CEILINGS.items():
        if getattr(options, name) > most:
            raise ConfigError(
                f"--{name.replace('_', '-')} must be at most {most}: the held-out set alone plays --eval-groups x "
                "--rollouts sessions before the first step, and --seconds does not bound it"
            )
    if options.seconds <= 0:
        raise ConfigError("--seconds must be positive")
    if not 0 <= options.eval_temperature <= 2:
        raise ConfigError("--eval-temperature must be in [0, 2] (0: greedy), as the OpenAI API's temperature")
    return options


def _given(args: argparse.Namespace, name: str):
    value = getattr(args, name, None)
    return getattr(DemoOptions, name) if value is None else value


def _check_modes(args: argparse.Namespace) -> None:
    """A mode's flags without the mode are read by nothing: `--arrival-rate 5` ran the harness
    demo and `--teacher-games 64` no warm start, silently (`--reward-delay -1` too)."""

    def given(*names: str) -> str:  # "--a is" / "--a and --b are", or "" if none was given
        flags = ["--" + n.replace("_", "-") for n in names if getattr(args, n, None) is not None]
        return " and ".join(flags) + (" are" if len(flags) > 1 else " is") if flags else ""

    live = getattr(args, "live", None)
    if live is None and (flags := given("arrival_rate", "reward_delay", "unrewarded_share")):
        raise ConfigError(f"{flags} read only with --live (rewards or shadows): add it, or drop the flag")
    if live == "shadows" and (flags := given("reward_delay", "unrewarded_share")):
        raise ConfigError(f"{flags} read only with --live rewards (--live shadows posts no rewards)")
    if getattr(args, "warm_start", None) is None and (flags := given("teacher_games", "warm_start_epochs")):
        raise ConfigError(f"{flags} read only with --warm-start sft: add it, or drop the flag")


def _check_live(options: DemoOptions, task) -> None:
    if options.live is None:
        if options.shuffle_rewards:
            raise ConfigError("--shuffle-rewards is a control of --live rewards")
        return
    if options.warm_start:
        raise ConfigError("--live trains from the untrained model: drop --warm-start")
    if options.shuffle_rewards and options.live != "rewards":
        raise ConfigError("--shuffle-rewards shuffles posted rewards: it goes with --live rewards")
    if options.live == "shadows" and not callable(getattr(task, "reward", None)):
        raise ConfigError(
            f"--live shadows: the scripted judge scores a reply with the task's reward(reply), and "
            f"task '{options.task}' has none (try --task shout)"
        )
    if options.arrival_rate is None:
        options.arrival_rate = LIVE_ARRIVAL_RATES[options.live]
    if options.arrival_rate <= 0 or options.reward_delay < 0 or not 0 <= options.unrewarded_share < 1:
        raise ConfigError("--arrival-rate must be positive, --reward-delay at least 0 and --unrewarded-share in [0, 1)")


def live_settings(settings: Settings, options: DemoOptions, judge_url: str | None = None) -> Settings:
    """The settings of a --live run (an RLPROXY_* variable wins): live groups of --rollouts
    sessions, or --rollouts - 1 shadow samples of every live call judged by the scripted judge
    at `judge_url` (`gateway.demo.judge`)."""
    if options.live == "rewards":
        update: dict = {"live_group_size": options.rollouts, "live_max_staleness": 2}
    elif options.live == "shadows":
        update = {
            "shadow_samples": options.rollouts - 1,
            "shadow_rate": 1.0,
            "shadow_judge_model": SCRIPTED_JUDGE_MODEL,
            "shadow_judge_api_base": judge_url,
        }
    else:
        return settings
    update = {k: v for k, v in update.items() if f"RLPROXY_{k.upper()}" not in os.environ}
    return Settings(**{**settings.model_dump(), **update})


SCRIPTED_JUDGE_MODEL = "openai/scripted-judge"
"""--live shadows: the litellm model string of the demo's scripted judge (`gateway.demo.judge`)."""

WARM_START_LEARNING_RATE = 3e-3
"""--warm-start: the distilled model already plays, and the built-in models' 1e-2 unlearns it
(tic-tac-toe, 256 teacher games, val score after SFT -> after 2-6 GRPO steps: 1e-2 0.66 -> 0.06
with 64 games; 3e-3 0.84 -> 0.82), as 3e-2 did to the instruct model (`tictactoe.OPTIONS`)."""


def demo_settings(given: dict, out: Path, task: str = DEFAULT_TASK, warm_start: bool = False) -> Settings:
    """Flags > RLPROXY_* environment > the task's tuning > the demo's > Settings' defaults.
    The state dir defaults to OUT/state, so a demo never trains on top of another store."""
    warm = {"learning_rate": WARM_START_LEARNING_RATE} if warm_start else {}
    task_settings = load_task(task).SETTINGS
    base_model = given.get("base_model") or os.environ.get("RLPROXY_BASE_MODEL") or task_settings.get("base_model")
    model = tuned_defaults(base_model or Settings.model_fields["base_model"].default)
    tuned = {
        k: v
        for k, v in {**model, **DEMO_SETTINGS, **task_settings, **warm}.items()
        if f"RLPROXY_{k.upper()}" not in os.environ
    }
    if "state_dir" not in given and "RLPROXY_STATE_DIR" not in os.environ:
        tuned["state_dir"] = out / "state"
    settings = Settings(**{**tuned, **given})
    if settings.store:  # no demo flag sets it: an RLPROXY_STORE exported for `serve` (its URL may hold a password)
        raise ConfigError(
            "RLPROXY_STORE is set: the demo keeps its own store in its state dir and trains from scratch, "
            "never in a shared one (its sessions, its trainer and its steps of the model would land there); "
            "unset RLPROXY_STORE for the demo"
        )
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
        # vLLM listens on a socket in the demo's own state dir: no port to collide with another's.
    return settings
