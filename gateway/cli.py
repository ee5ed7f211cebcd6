"""`rlproxy`: a thin CLI over the library.

Flags are generated from `gateway.settings.Settings`, so every setting is a
flag and shows in `--help`. Precedence: flags > RLPROXY_* environment > defaults.
"""

from __future__ import annotations

import argparse
import logging
import sys
import typing
from typing import Callable, Literal

from pydantic import SecretStr

from gateway.errors import RLProxyError
from gateway.settings import Settings

SERVICE = ("host", "port", "state_dir", "store_sync", "api_key", "log_level")
ENGINE = ("engine", "base_model", "model_name", "upstream_url", "upstream_api_key", "upstream_timeout",
          "max_batch_size", "default_max_tokens", "device", "vllm_url", "vllm_port", "vllm_arg", "max_loras",
          "gpu_mode", "max_staleness")
TRAINER = ("trainer", "backend", "groups_per_step", "learning_rate", "loss_type", "epsilon", "epsilon_high", "beta",
           "scale_rewards", "lora_rank", "lora_alpha", "lora_dropout", "max_tokens_per_row", "epochs_per_step",
           "max_grad_norm", "seed", "keep_adapters", "poll_interval")


def _add_settings_flags(parser: argparse.ArgumentParser, names: tuple[str, ...], title: str) -> None:
    group = parser.add_argument_group(title)
    for name in names:
        field = Settings.model_fields[name]
        flag = "--" + name.replace("_", "-")
        annotation = field.annotation
        origin = typing.get_origin(annotation)
        args = typing.get_args(annotation)
        default = field.default if field.default_factory is None else field.default_factory()
        shown = "***" if "key" in name and default else default
        help_text = f"{field.description} (env RLPROXY_{name.upper()}; default: {shown})"
        kwargs: dict = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        if origin is Literal:
            kwargs["choices"] = list(args)
        elif origin is list:
            kwargs["action"] = "append"
            kwargs["metavar"] = "ARG"
        elif annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        group.add_argument(flag, **kwargs)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Flags given on the command line override the environment and defaults."""
    given = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    return Settings(**given)


def _configure_logging(settings: Settings) -> None:
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import create_app

    settings = settings_from_args(args)
    _configure_logging(settings)
    app = create_app(settings)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                access_log=settings.log_level == "debug")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from gateway.export import export_trajectories

    settings = settings_from_args(args)
    count = export_trajectories(settings.db_path, args.output, split=args.split, only_rewarded=args.rewarded)
    print(f"exported {count} sessions to {args.output}", file=sys.stderr)
    return 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.Namespace], int], tuple[tuple[tuple[str, ...], str], ...]]] = {
    "serve": ("run the gateway (and, with --trainer auto, a trainer worker beside it)", cmd_serve,
              ((SERVICE, "service"), (ENGINE, "engine"), (TRAINER, "trainer"))),
    "export": ("write recorded sessions as JSON lines", cmd_export, ((("state_dir",), "store"),)),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlproxy", description=__doc__.splitlines()[0].strip("`: "))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, _, groups) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        for names, title in groups:
            _add_settings_flags(command, names, title)
        if name == "export":
            command.add_argument("--output", "-o", default="-", help="file to write, or - for stdout")
            command.add_argument("--split", choices=["train", "val"], default=None, help="only this split")
            command.add_argument("--rewarded", action="store_true", help="only sessions with a reward")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _, handler, _ = COMMANDS[args.command]
    try:
        return handler(args) or 0
    except RLProxyError as exc:
        print(f"rlproxy {args.command}: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
