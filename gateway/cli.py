"""`rlproxy`: a thin CLI over the library.

Flags are generated from `gateway.settings.Settings`, so every setting is a flag and shows in
`serve --help` (gateway/flags.py: which command lists which). Precedence: flags > RLPROXY_*
environment > defaults.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from pydantic import ValidationError

from gateway import version
from gateway.errors import RLProxyError
from gateway.flags import (
    ENGINE,
    EVERY_FLAG,
    TRAIN_NOTE,
    TRAINER,
    add_command_flags,
    idle_settings,
    secret_flags_warning,
    where_set,
)
from gateway.models.tuning import log_settings
from gateway.settings import KEEP_ALIVE_SECONDS, Settings


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Flags given on the command line override the environment and the defaults, which
    are tuned per model (`gateway.models.tuning`: the built-in model has its own)."""
    from gateway.models.tuning import for_model

    given = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    return _checked(for_model(Settings(**given)))


def _checked(settings: Settings) -> Settings:
    """What is wrong with the settings that only reading a file shows, found at start; and the
    replica and device flags against each other, whatever the engine (gateway/devices.py)."""
    from gateway.devices import check_flags, trainer_devices
    from gateway.models.templates import check_chat_template

    check_chat_template(settings.chat_template)
    check_flags(settings)
    trainer_devices(settings)
    return settings


def _check_device(settings: Settings) -> None:
    """--device, where a process of this command computes on it: the local engine in the gateway, or
    the trainer beside it (`gateway.devices.check_torch_device`). A trainer child given
    --trainer-devices numbers its GPUs apart, and checks its own index when it starts."""
    from gateway.devices import check_torch_device

    local = settings.engine == "local"
    if local or (settings.trainer == "auto" and settings.engine != "openai"):
        check_torch_device(settings, own_numbering=local or (settings.trainer_devices is None and settings.nproc == 1))


def _configure_logging(settings: Settings) -> None:
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from gateway.app import create_app
    from gateway.http.listen import listen
    from gateway.http.logs import hide_access_log_secrets
    from gateway.trainer_process import run_gateway, start_trainer

    settings = settings_from_args(args)
    _check_device(settings)
    _configure_logging(settings)
    hide_access_log_secrets(settings.secrets())  # the access line (--log-level debug) holds query strings
    log_settings(settings, logging.getLogger("rlproxy"), "serve")
    for line in idle_settings(settings, args):
        logging.getLogger("rlproxy").warning(line)
    sock = listen(settings.host, settings.port)  # a port in use: said before the engine starts
    app = create_app(settings)
    trainer = app.state.trainer = start_trainer(args, settings, app.state.services.store)  # /healthz shows its state
    try:
        # Keep-alive well past the clients' own 5 s (httpx, openai): with equal timeouts both ends drop
        # an idle connection at once and a request sent then fails with a ReadError. No X-Forwarded-*
        # rewriting: nothing reads the client's address, and it is one more ASGI layer on every call.
        run_gateway(
            app,
            trainer,
            sock,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            access_log=settings.log_level == "debug",
            timeout_keep_alive=KEEP_ALIVE_SECONDS,
            proxy_headers=False,
        )
    finally:
        if trainer is not None:
            trainer.stop()
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    import os
    import signal
    import threading

    from gateway.devices import check_torch_device, trainer_environment
    from gateway.export.selection import sft_selection
    from gateway.signal_handlers import handling

    settings = settings_from_args(args)
    where = sft_selection(args)  # the sessions an sft run distils; a selection flag without it is refused
    _configure_logging(settings)
    # --trainer-devices run by hand: CUDA reads CUDA_VISIBLE_DEVICES once, when torch first uses it,
    # so it is set before the trainer (and torch) is imported.
    trainer_environment(settings, os.environ)
    # A rank takes cuda:LOCAL_RANK whatever --device's index (trainer/distributed/team.py).
    check_torch_device(settings, own_numbering=settings.nproc == 1 and os.environ.get("WORLD_SIZE", "1") == "1")
    if settings.nproc > 1 and "WORLD_SIZE" not in os.environ:  # this process starts the ranks, which train
        from trainer.distributed.launch import launch

        return launch(args.argv, settings.nproc)
    if os.environ.get("RANK", "0") == "0":
        log_settings(settings, logging.getLogger("rlproxy.trainer"), "train")
    from gateway.colocate import needs_gpu_lease, wait_for_vllm
    from trainer.worker import SFTOptions, run_worker

    if needs_gpu_lease(settings):  # vLLM profiles the whole GPU while it starts: load nothing before
        from gateway.engines.vllm.server import vllm_addresses

        for address in vllm_addresses(settings):
            wait_for_vllm(address)
    stop = threading.Event()

    def request_stop(signum, frame) -> None:
        logging.getLogger("rlproxy.trainer").info("stopping after the current step (signal %d again: at once)", signum)
        stop.set()
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)

    sft = None if where is None else SFTOptions(where, args.epochs, args.sft_sessions_per_step)
    with handling({signal.SIGTERM: request_stop, signal.SIGINT: request_stop}):
        run_worker(settings, stop, max_steps=args.max_steps, sft=sft)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from gateway.export.records import export_trajectories
    from gateway.export.selection import selection_from_args

    settings = settings_from_args(args)
    where = selection_from_args(args)
    result = export_trajectories(
        settings.store or settings.db_path,
        args.output,
        fmt=args.format,
        where=where,
        base_model=settings.base_model,
        state_dir=settings.state_dir,
        chat_template=settings.chat_template,
    )
    what = "sessions" if args.format == "rlproxy" else "samples"
    print(f"exported {result.rows} {what} ({result.sessions} sessions matched) to {args.output}", file=sys.stderr)
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    from gateway.forget import run

    print("\n".join(run(settings_from_args(args), args)))
    return 0


def cmd_export_model(args: argparse.Namespace) -> int:
    from gateway.export.model import export_model

    settings = settings_from_args(args)
    done = export_model(settings, args.model, args.out, merged=args.merged)
    kind = "a merged model" if done.merged else "an adapter"
    print(f"exported {done.name}@{done.step} as {kind} to {done.out}", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    import signal

    from gateway.demo.driver import report, run_demo
    from gateway.demo.options import demo_settings, options_from_args
    from gateway.signal_handlers import handling

    def interrupt(signum, frame):  # `kill` as Ctrl-C: unwind, so the trainer and a managed vLLM are stopped
        raise KeyboardInterrupt

    with handling({signal.SIGTERM: interrupt}):
        options = options_from_args(args)
        given = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
        settings = _checked(demo_settings(given, options.out, options.task, options.warm_start is not None))
        _check_device(settings)
        summary = run_demo(settings, options)
    print(report(summary))
    return 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.Namespace], int], tuple[tuple[tuple[str, ...], str], ...]]] = {
    "serve": (
        "run the gateway (and, with --trainer auto, a trainer worker beside it)",
        cmd_serve,
        EVERY_FLAG,
    ),
    "export": (
        "write recorded sessions: rlproxy records, OpenAI fine-tuning JSONL or parquet samples",
        cmd_export,
        ((("state_dir", "store", "base_model", "chat_template"), "store"),),
    ),
    "forget": (
        "delete recorded sessions older than a cutoff that training no longer needs (--dry-run: say which)",
        cmd_forget,
        ((("state_dir", "store"), "store"),),
    ),
    "export-model": (
        "write a trained step as a PEFT adapter or a merged model, with a model card",
        cmd_export_model,
        ((("state_dir", "store", "chat_template"), "store"),),
    ),
    "demo": (
        "watch it learn: gateway, trainer and a toy agent on the built-in tiny model (CPU, minutes)",
        cmd_demo,
        ((("state_dir", "log_level"), "service"), (ENGINE, "engine"), (TRAINER, "trainer")),
    ),
    "train": (
        "run a trainer worker alone: train on ready groups, save adapters, record steps",
        cmd_train,
        EVERY_FLAG,  # the gateway's own hidden (gateway/flags.py)
    ),
}


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: `--store` must never be read as an abbreviation of `--store-sync`.
    parser = argparse.ArgumentParser(
        prog="rlproxy", description="an OpenAI-compatible gateway that trains the model it serves", allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=f"rlproxy {version()}")
    from gateway.export.selection import add_selection_flags, count, positive_int

    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, _, groups) in COMMANDS.items():
        epilog = TRAIN_NOTE if name == "train" else None
        command = sub.add_parser(name, help=help_text, description=help_text, epilog=epilog, allow_abbrev=False)
        add_command_flags(command, name, groups)
        if name == "export":
            command.add_argument("--output", "-o", default="-", help="file to write, or - for stdout")
            command.add_argument(
                "--format",
                choices=["rlproxy", "openai", "parquet"],
                default="rlproxy",
                help="rlproxy: one session per line; openai: chat fine-tuning JSONL, one trained "
                "sample per line; parquet: one row per trained sample with token ids and masks",
            )
            add_selection_flags(command, "which sessions to export (the filters are ANDed)")
        if name == "forget":
            from gateway.forget import add_arguments as add_forget_arguments

            add_forget_arguments(command)
        if name == "export-model":
            command.add_argument(
                "model", metavar="NAME[@STEP]", help="the model and step, as served (newest if no @STEP)"
            )
            command.add_argument("--out", required=True, help="directory to create (must not exist or be empty)")
            command.add_argument(
                "--merged",
                action="store_true",
                help="write the base model with the adapter merged in, instead of the adapter",
            )
        if name == "demo":
            from gateway.demo.options import add_arguments, settings_help

            add_arguments(command)
            for action in command._actions:  # the settings flags that mean more in a demo, or default otherwise
                if action.dest in Settings.model_fields:
                    action.help = settings_help(action.dest, action.help)
        if name == "train":
            command.add_argument("--max-steps", type=count, default=None, help="stop after this many steps")
            sft = command.add_argument_group("objective")
            sft.add_argument(
                "--objective",
                choices=["grpo", "sft"],
                default="grpo",
                help="grpo: reinforce on ready groups (the default); sft: fine-tune on the assistant turns "
                "of the recorded sessions the selection flags pick (a snapshot taken when the run starts)",
            )
            sft.add_argument("--epochs", type=positive_int, default=1, help="sft: passes over the selection")
            per_step = "sft: sessions trained together in one step"
            sft.add_argument("--sft-sessions-per-step", type=positive_int, default=8, help=per_step)
            add_selection_flags(command, "sft: which recorded sessions to distil (the filters are ANDed)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `train --nproc N` starts its ranks with them
    _, handler, _ = COMMANDS[args.command]
    warning = secret_flags_warning(args)
    if warning:  # said, never refused: a key on the command line of a machine of one's own may be fine
        print(f"rlproxy {args.command}: warning: {warning}", file=sys.stderr)
    _warn_of_unknown_variables(args.command)
    try:
        if args.command in ("serve", "train"):  # read by the trainer (the demo sets its own): wrong, said at start
            from trainer.backends import torch_threads

            torch_threads()
        return handler(args) or 0
    except RLProxyError as exc:
        print(f"rlproxy {args.command}: {exc.message}", file=sys.stderr)
        # A trainer's exit tells `serve --trainer auto` whether to start it again (1) or not (2):
        # errors.py's exit_code. The other commands exit 2 for any error they name, as before.
        return exc.exit_code if args.command == "train" else 2
    except ValidationError as exc:  # a setting out of range: say which flag (or variable) and why, no traceback
        for error in exc.errors():
            # a check across settings has no field, and pydantic prefixes a validator's own words
            # with "Value error, ": the reason alone names the flags
            reason = error["msg"].removeprefix("Value error, ")
            where = f"{where_set(error['loc'], args)}: " if error["loc"] else ""
            if reason.startswith(where[:-2] + " "):  # "--init-from takes ...": the flag is said once
                where = ""
            print(f"rlproxy {args.command}: {where}{reason}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _warn_of_unknown_variables(command: str) -> None:
    """A misspelt RLPROXY_* variable, said once: by the command the user ran, not by each training rank
    `train --nproc N` starts (RLPROXY_LOOPBACK_STORE) or torchrun's ranks but the first."""
    import os

    from gateway.settings_env import unknown_variables_warning

    if os.environ.get("RANK", "0") != "0" or os.environ.get("RLPROXY_LOOPBACK_STORE"):
        return
    warning = unknown_variables_warning(os.environ)
    if warning:
        print(f"rlproxy {command}: warning: {warning}", file=sys.stderr)


def run() -> None:
    """The `rlproxy` command (and `python -m gateway.cli`): `main`, then an exit without the
    interpreter's last garbage collection. With torch and transformers loaded that walks a few
    hundred thousand objects, about a second at every stop of a gateway, trainer or demo, and
    frees nothing the OS would not: everything a command keeps is closed before `main` returns
    (the store, the engine, log handlers; atexit hooks still run), only unreachable cycles are
    left to the OS. Not in `main`: a process that calls it and goes on (the tests) must keep
    collecting its garbage."""
    import gc

    code = main()
    gc.freeze()  # every object of this process, out of the collections still to come: the last one
    sys.exit(code)


if __name__ == "__main__":
    run()
