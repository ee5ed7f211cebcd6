"""Which settings each command takes as flags, and under which heading its --help lists them.

Every flag is generated from `gateway.settings.Settings`. `rlproxy serve` takes them all.
`rlproxy train` takes them all too, since `serve --trainer auto` and the demo start it with the
gateway's own command line, but its --help lists only those a trainer reads: the gateway's own
(`TRAIN_IGNORES`: listening, keys, the engine's requests, live groups, shadows, judges, the
canary) are taken and ignored there. `rlproxy demo` hides the upstream's flags and --trainer so.
"""

from __future__ import annotations

import argparse
import typing
from typing import Literal

from gateway.redact import hidden_in
from gateway.settings import PromotionSettings, Settings
from gateway.settings_scale import ReplicaSettings, TrainingScaleSettings

SERVICE = (
    "host",
    "port",
    "state_dir",
    "store",
    "store_sync",
    "api_key",
    "insecure_no_api_key",
    "log_level",
    "max_body_mb",
    "max_messages",
    "max_n",
    "cors_origin",
    "allowed_host",
)
ENGINE = (
    "engine",
    "base_model",
    "chat_template",
    "model_name",
    "upstream_url",
    "upstream_api_key",
    "upstream_timeout",
    "upstream_protocol",
    "max_batch_size",
    "default_max_tokens",
    "device",
    "vllm_url",
    *ReplicaSettings.model_fields,
    "vllm_api_key",
    "vllm_port",
    "vllm_python",
    "vllm_arg",
    "max_loras",
    "gpu_mode",
    "max_staleness",
)
LIVE = (
    "live_group_size",
    "live_max_staleness",
    "shadow_samples",
    "shadow_rate",
    "shadow_max_in_flight",
    "shadow_judge_model",
    "shadow_judge_api_base",
)
JUDGES = ("judge_model", "judge_api_base")
PROMOTION = tuple(PromotionSettings.model_fields)  # --promote and its rule's flags
TRAINER = (
    "trainer",
    "backend",
    "load_in_4bit",
    "init_from",
    "groups_per_step",
    "learning_rate",
    "weight_decay",
    "loss_type",
    "epsilon",
    "epsilon_high",
    "delta",
    "beta",
    "reward_kl",
    "reward_kl_sharpen",
    "kl_estimator",
    "tis_cap",
    "max_tokens_norm",
    "scale_rewards",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "max_tokens_per_row",
    "epochs_per_step",
    "max_grad_norm",
    *TrainingScaleSettings.model_fields,
    "seed",
    "keep_adapters",
    "keep_checkpoints",
    "poll_interval",
    "report_to",
    "report_project",
)


# The settings that are secrets, or may hold one (a postgresql:// URL's password): the gateway hands
# them to its trainer in the environment, never on its command line, and `--help` steers to the variable.
SECRET_SETTINGS = ("api_key", "admin_key", "upstream_api_key", "vllm_api_key", "store")


def secret_flags(args: argparse.Namespace) -> list[str]:
    """The flags of this command line that carry a secret: a key, or a password or token inside a URL
    or a --vllm-arg (`gateway.redact.hidden_in`), as they were written."""
    given = {name: value for name, value in vars(args).items() if name in Settings.model_fields}
    return ["--" + name.replace("_", "-") for name, value in given.items() if hidden_in({name: value})]


def secret_flags_warning(args: argparse.Namespace) -> str | None:
    """One line on the secrets this command line shows to every user of the machine, without them."""
    flags = secret_flags(args)
    named = [flag for flag in flags if flag != "--vllm-arg"]
    said = []
    if named:
        variables = ", ".join("RLPROXY_" + flag[2:].replace("-", "_").upper() for flag in named)
        said.append(f"{', '.join(named)} on the command line: set {variables} in the environment instead")
    if "--vllm-arg" in flags:  # on vLLM's own command line too, whichever way rlproxy was given it
        said.append("a secret in --vllm-arg: pass it to vLLM in its environment instead (HF_TOKEN for --hf-token)")
    if not said:
        return None
    return "; ".join(said) + " (every user of this machine can read a command line: ps, /proc/PID/cmdline)"


def add_settings_flags(
    parser: argparse.ArgumentParser, names: tuple[str, ...], title: str, *, hidden: bool = False
) -> None:
    """`names` as flags, under `title` in --help; `hidden`: taken, and left out of --help."""
    from gateway.models.tuning import MODEL_SETTINGS

    tuned = set().union(*MODEL_SETTINGS.values())
    group = parser.add_argument_group(title)
    for name in names:
        field = Settings.model_fields[name]
        flag = "--" + name.replace("_", "-")
        annotation = field.annotation
        origin = typing.get_origin(annotation)
        args = typing.get_args(annotation)
        default = field.default if field.default_factory is None else field.default_factory()
        shown = "***" if "key" in name and default else default
        per_model = "; the built-in models have their own: docs/training.md" if name in tuned else ""
        env = f"env RLPROXY_{name.upper()}"
        if name in SECRET_SETTINGS:
            env = f"better as {env}: a flag shows in `ps` to every user of the machine"
        help_text = f"{field.description} ({env}; default: {shown}{per_model})"
        kwargs: dict = {"dest": name, "default": argparse.SUPPRESS, "help": argparse.SUPPRESS if hidden else help_text}
        if origin is Literal:
            kwargs["choices"] = list(args)
        elif origin is list:
            kwargs["action"] = "append"
            kwargs["metavar"] = "ARG"
        elif annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        group.add_argument(flag, **kwargs)


# `serve` and `train` take every setting (the demo passes the gateway's settings to its trainer).
EVERY_FLAG = (
    (SERVICE, "service"),
    (ENGINE, "engine"),
    (LIVE, "live traffic"),
    (JUDGES, "RULER judges"),
    (TRAINER, "trainer"),
    (PROMOTION, "promotion"),
)
# What only the gateway reads: `train` takes these and its --help leaves them out. A trainer
# reads the store, the model, the GPU layout (to share one with vLLM), staleness and promotion.
TRAIN_IGNORES = frozenset(
    (
        *("host", "port", "api_key", "insecure_no_api_key", "max_body_mb", "max_messages", "max_n"),
        *("cors_origin", "allowed_host", "upstream_url", "upstream_api_key", "upstream_timeout"),
        *("upstream_protocol", "max_batch_size", "routing", "vllm_api_key", "vllm_python", "vllm_arg"),
        *("max_loras", *LIVE, *JUDGES, "trainer", "keep_adapters", "admin_key", "canary_share"),
        *("canary_margin", "canary_min_sessions", "canary_max_wait", "watch_sessions"),
    )
)
TRAIN_NOTE = (
    "It also takes `rlproxy serve`'s other flags (--host, --api-key, --upstream-url, --shadow-samples, "
    "...) and ignores them: `serve --trainer auto` starts it with the gateway's own command line."
)
# The demo serves a model it trains (never an upstream's) and always starts its own trainer.
DEMO_IGNORES = frozenset(("upstream_url", "upstream_api_key", "upstream_timeout", "upstream_protocol", "trainer"))
IGNORED = {"train": TRAIN_IGNORES, "demo": DEMO_IGNORES}


def add_command_flags(parser: argparse.ArgumentParser, command: str, groups: tuple) -> None:
    """A command's settings as flags, each group under its title; those the command ignores
    (`IGNORED`) are taken all the same and left out of its --help."""
    ignored = IGNORED.get(command, frozenset())
    for names, title in groups:
        add_settings_flags(parser, tuple(n for n in names if n not in ignored), title)
    hidden = tuple(n for names, _ in groups for n in names if n in ignored)
    if hidden:
        add_settings_flags(parser, hidden, "", hidden=True)


# Settings that do something only beside another: (the setting, whether it acts, what it needs).
NEEDS = (
    (("kl_estimator",), lambda s: s.beta > 0, "--beta above 0 (the KL term it estimates)"),
    (("reward_kl_sharpen",), lambda s: s.reward_kl > 0, "--reward-kl above 0"),
    (PROMOTION[3:], lambda s: s.promote == "canary", "--promote canary"),  # --canary-* and --watch-sessions
    (("shadow_rate", "shadow_max_in_flight"), lambda s: s.shadow_samples > 0, "--shadow-samples"),
    (("live_max_staleness",), lambda s: s.live_group_size is not None, "--live-group-size"),
)


def where_set(loc: tuple, args: argparse.Namespace) -> str:
    """Where the setting at `loc` (a pydantic error's) came from: its flag, or, where no flag gave it,
    the RLPROXY_* variable Settings read it from (`RLPROXY_PORT=abc` was blamed on a `--port` never
    given, and the user went looking for a flag)."""
    import os

    name = str(loc[0])
    where = "--" + name.replace("_", "-")
    if name in Settings.model_fields and name not in vars(args):
        variable = f"RLPROXY_{name.upper()}"
        if any(key.upper() == variable for key in os.environ):  # Settings reads them case-insensitively
            where = f"{variable} (environment variable)"
    # One value of a repeatable flag: `--upstream-protocol chat` was blamed on `--upstream-protocol-1`.
    return f"{where}, its value {loc[1] + 1}" if len(loc) == 2 and isinstance(loc[1], int) else where


def idle_settings(settings: Settings, args: argparse.Namespace) -> list[str]:
    """One line for each setting the user gave (a flag or its variable) that the others leave with nothing
    to do, so that a run is not taken for one with it: `--canary-share 0.3` without `--promote canary`.
    Each is named as it was given (`where_set`): RLPROXY_CANARY_SHARE=0.3 was blamed on a flag never given."""
    lines = []
    for names, acts, needs in NEEDS:
        given = [name for name in names if name in settings.model_fields_set]
        if given and not acts(settings):
            named = ", ".join(where_set((name,), args) for name in given)
            lines.append(f"{named} {'does' if len(given) == 1 else 'do'} nothing without {needs}: ignored")
    return lines
