"""`rlproxy serve --trainer auto`: the trainer as a child of the gateway, started with the
gateway's own settings and stopped with it."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from subprocess import Popen

from gateway.children import die_with_parent
from gateway.devices import trainer_environment
from gateway.settings import Settings

# A store URL may hold a password.
_SECRET_SETTINGS = ("api_key", "admin_key", "upstream_api_key", "vllm_api_key", "store")


def settings_argv(args: argparse.Namespace) -> list[str]:
    """The settings flags given on this command line, to hand on to a child command
    (secrets left out: the trainer needs none, and argv is visible to every user)."""
    argv: list[str] = []
    for name, value in vars(args).items():
        if name not in Settings.model_fields or name in _SECRET_SETTINGS:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            for item in value:
                argv.append(f"{flag}={item}")  # `--vllm-arg=--x=1`: a value may itself start with --
        else:
            argv += [flag, str(value)]
    return argv


def start_trainer(args: argparse.Namespace, settings: Settings) -> Popen | None:
    """`--trainer auto`: `rlproxy train` with the same settings as a child process in the
    gateway's process group; None when there is nothing to train for."""
    import subprocess

    log = logging.getLogger("rlproxy")
    if settings.trainer == "off":
        return None
    if settings.engine == "openai":
        log.info(
            "trainer not started: the openai engine serves no adapters, so trained steps could not be "
            "served (calls are still recorded; train them with `rlproxy train` for another engine)"
        )
        return None
    cmd, env = trainer_command(args, settings)
    log.info("starting the trainer worker beside the gateway (--trainer off to run without)")
    return subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent)


def trainer_command(args: argparse.Namespace, settings: Settings) -> tuple[list[str], dict[str, str]]:
    """The trainer child's command line and environment."""
    cmd = [sys.executable, "-m", "gateway.cli", "train", *settings_argv(args)]
    env = dict(os.environ)
    trainer_environment(settings, env)  # --trainer-devices: its GPUs, not the gateway's
    if settings.store:
        env["RLPROXY_STORE"] = settings.store  # by environment, not argv: its password stays private
    if settings.device == "cpu":
        # The local engine computes on the same cores: OpenMP threads of two processes
        # competing for every core slow both down many times over, so the trainer takes half.
        env.setdefault("RLPROXY_TORCH_THREADS", str(max(1, (os.cpu_count() or 2) // 2)))
    return cmd, env


def stop_trainer(proc: Popen | None, timeout: float = 30.0) -> None:
    """SIGTERM: the worker finishes its current step and exits; after `timeout`, kill it (safe:
    a checkpoint is never half written, a group is marked trained only with its step row)."""
    import subprocess

    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
