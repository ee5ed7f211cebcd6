"""The demo's processes: the gateway in a thread of this one, the trainer as a child.

The gateway runs under uvicorn on a free loopback port in this process (a managed vLLM is
its own child, started and stopped by the gateway's lifespan). The trainer is `rlproxy
train` in a process group of its own, told by Linux to die with the demo.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from pydantic import SecretStr

from gateway.children import die_with_parent
from gateway.devices import trainer_environment
from gateway.errors import RLProxyError
from gateway.flags import SECRET_SETTINGS
from gateway.redact import hidden_in
from gateway.settings import KEEP_ALIVE_SECONDS, Settings
from gateway.settings_env import without_unknown


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # the OS picks a free port; uvicorn serves on this very socket
    return sock


@contextlib.contextmanager
def serve_gateway(settings: Settings) -> Iterator[str]:
    """The gateway under uvicorn in a thread of this process; yields its base URL."""
    import uvicorn

    from gateway.app import create_app

    sock = free_socket()
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


def _secret(name: str, value: object) -> bool:
    return name in SECRET_SETTINGS or bool(hidden_in({name: value}))


def client_key(settings: Settings) -> str:
    """The key the demo's own clients send to its gateway: the gateway's, where RLPROXY_API_KEY
    gave it one (exported for `rlproxy serve`, it reaches the demo too, and the agent's first call
    ended in openai's 401 traceback), else any (a gateway with no key takes every one)."""
    return settings.api_key.get_secret_value() if settings.api_key else "demo"


def _settings_flags(settings: Settings) -> list[str]:
    """The settings as `rlproxy train` flags, but for those that are or hold a secret (`_secret_env`)."""
    argv: list[str] = []
    for name, value in settings.model_dump(mode="json").items():
        if value is None or _secret(name, value):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):  # switches take no value: --x / --no-x
            argv.append(flag if value else "--no-" + flag[2:])
            continue
        for item in value if isinstance(value, list) else [value]:
            argv.append(f"{flag}={item}")  # one token: a value may itself start with "--" (--vllm-arg)
    return argv


def _secret_env(settings: Settings) -> dict[str, str]:
    """The settings `_settings_flags` leaves out, as the trainer's RLPROXY_* variables: argv is every local
    user's to read, and masked there they were wrong (`--store=postgresql://u:***@h` beat the RLPROXY_STORE
    the trainer inherits; `--admin-key=***` is too short a key, and the trainer refused to start)."""
    env = {}
    for name, value in settings.model_dump().items():
        value = value.get_secret_value() if isinstance(value, SecretStr) else value
        if value and _secret(name, value):
            env["RLPROXY_" + name.upper()] = json.dumps(value) if isinstance(value, list) else str(value)
    return env


class Trainer:
    """`rlproxy train` as a child process, its output in OUT/trainer.log."""

    def __init__(
        self,
        settings: Settings,
        log_path: Path,
        threads: int,
        extra: list[str] | None = None,
        max_steps: int | None = None,
    ):
        self.log_path = log_path
        self.max_steps = max_steps
        env = {
            **without_unknown(os.environ),
            **_secret_env(settings),
            "RLPROXY_TORCH_THREADS": str(threads),
            "HF_HUB_OFFLINE": "1",
        }
        trainer_environment(settings, env)  # --trainer-devices: its GPUs, not the demo's
        # Its log is a file the user reads afterwards: one line per step is worth having.
        cmd = [sys.executable, "-m", "gateway.cli", "train", *_settings_flags(settings), "--log-level", "info"]
        cmd += extra or []  # `train`'s own flags (the warm start's --objective sft ...)
        if max_steps is not None:  # the demo's --steps: a step more trained while it evaluates is not in its summary
            cmd += ["--max-steps", str(max_steps)]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )

    def check_alive(self) -> None:
        """Raise with its log's tail where the trainer ended, unless it ended by training its `max_steps`."""
        code = self.proc.poll()
        if code is not None and not (code == 0 and self.max_steps is not None):
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RLProxyError(f"the trainer exited with code {self.proc.returncode}:\n{tail}")

    def wait(self) -> int:
        """Wait for a run that ends by itself (a supervised run's epochs); its exit code."""
        code = self.proc.wait()
        self._log.close()
        return code

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
