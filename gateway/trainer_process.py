"""`rlproxy serve --trainer auto`: the trainer as a child of the gateway, started with the
gateway's own settings and stopped with it."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from subprocess import Popen

from gateway.children import die_with_parent
from gateway.devices import trainer_environment
from gateway.errors import TRY_AGAIN_EXIT
from gateway.flags import SECRET_SETTINGS
from gateway.redact import hidden_in, mask_text, redact
from gateway.settings import Settings
from gateway.settings_env import without_unknown
from gateway.store import Store


def _holds_secret(name: str, value: object) -> bool:
    """A value with a secret inside: `--vllm-url http://u:PASSWORD@h`, `--vllm-arg=--hf-token=T`,
    `--judge-api-base https://h/v1?key=K`."""
    return bool(hidden_in({name: value}))


def settings_argv(args: argparse.Namespace) -> list[str]:
    """The settings flags given on this command line, to hand on to a child command
    (secrets left out: the trainer needs none, and argv is visible to every user, and to
    trackers: wandb records a run's command line; `secret_settings_env` hands on the rest)."""
    argv: list[str] = []
    for name, value in vars(args).items():
        if name not in Settings.model_fields or name in SECRET_SETTINGS or _holds_secret(name, value):
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


def secret_settings_env(args: argparse.Namespace) -> dict[str, str]:
    """The settings flags `settings_argv` leaves out for a secret inside them, as the child's
    RLPROXY_* variables (lists as JSON, as Settings reads them): private to the child."""
    return {
        "RLPROXY_" + name.upper(): json.dumps(value) if isinstance(value, list) else str(value)
        for name, value in vars(args).items()
        if name in Settings.model_fields and name not in SECRET_SETTINGS and _holds_secret(name, value)
    }


class TrainerChild:
    """`rlproxy train` as the gateway's child, brought back when it fails: a trainer that died (a
    crash, out of host memory, killed) must not stop training until someone notices; one that
    exits with 0 was asked to stop (SIGTERM to it alone) and stays stopped. One that exits with
    2 was refused its settings (`--init-from` naming a step of another LoRA shape, a GPU that is
    not there): starting it again fails the same way for ever, so it stays `failed`, with the
    line it printed as `/healthz`'s `last_error`, until the gateway is restarted. One refused
    for the moment (exit 75: another trainer holds the model's lock, the store is restarting) is
    tried again for as long as it takes: it takes over later. A crash (any other exit) is tried
    again too, but one that crashes `CRASH_LIMIT` times in a row, each run shorter than 10 minutes
    (a CUDA build that does not fit the card, a broken install), crashes the same way for ever:
    it is left `failed` too, as systemd's StartLimitBurst does, where it was started again every
    minute for ever while /healthz said `running` or `restarting`. Restarts wait 1, 2, 4 ... 60 s;
    a run of 10 minutes sets the wait back to 1 s and the crash count to 0. `status()` is what
    `/healthz` shows of it."""

    STABLE_SECONDS = 600.0
    FIRST_DELAY_SECONDS = 1.0
    MAX_DELAY_SECONDS = 60.0
    CRASH_LIMIT = 5  # crashes in a row, each within STABLE_SECONDS of its start, that leave it failed
    SETTINGS_EXIT = 2  # `rlproxy train`'s exit for settings it refuses (gateway/errors.py: exit_code)

    def __init__(self, cmd: list[str], env: dict[str, str], secrets: list[str] | None = None) -> None:
        self.cmd, self.env = cmd, env
        self._secrets = [secret for secret in secrets or [] if secret]  # kept out of last_error
        self.proc: Popen | None = None
        self.restarts = 0
        self.last_exit: int | None = None
        self.last_error: str | None = None
        self._output: ChildOutput | None = None
        self._stopping = threading.Event()
        self._delay = self.FIRST_DELAY_SECONDS
        self._started_at = 0.0
        self._crashes = 0  # quick crashes in a row
        self._gave_up = False  # crashed CRASH_LIMIT times in a row: not started again
        self._thread = threading.Thread(target=self._watch, name="rlproxy-trainer-watch", daemon=True)

    def start(self) -> TrainerChild:
        self._spawn()
        self._thread.start()
        return self

    def _spawn(self) -> None:
        import subprocess

        # Its stderr through the gateway's (`ChildOutput`), so the reason it exits with is known here.
        self.proc = subprocess.Popen(self.cmd, env=self.env, stderr=subprocess.PIPE, preexec_fn=die_with_parent)
        self._output = ChildOutput(self.proc)
        self._started_at = time.monotonic()

    def _watch(self) -> None:
        log = logging.getLogger("rlproxy")
        while not self._stopping.is_set():
            assert self.proc is not None and self._output is not None
            code = self.proc.wait()
            error = self._output.reason(code)
            if self._stopping.is_set():
                return
            # /healthz answers without a key: no secret of the settings, no password in a URL, in it.
            self.last_exit, self.last_error = code, error and mask_text(redact(error, self._secrets))
            if code == 0:  # it was asked to stop (SIGTERM to it alone): not brought back
                log.warning("the trainer stopped (code 0) while the gateway serves; restart the gateway to train again")
                return
            if code == self.SETTINGS_EXIT:
                log.error(
                    "the trainer refused its settings and is not started again (fix them and restart the "
                    "gateway; serving goes on): %s",
                    error or f"exit code {code}",
                )
                return
            if time.monotonic() - self._started_at >= self.STABLE_SECONDS:  # it trained: not a crash loop
                self._delay, self._crashes = self.FIRST_DELAY_SECONDS, 0
            if code != TRY_AGAIN_EXIT:
                self._crashes += 1
                if self._crashes >= self.CRASH_LIMIT:
                    self._give_up()
                    return
            if code == TRY_AGAIN_EXIT:  # a standby waiting for the lock says so every minute: not an error
                log.warning("the trainer cannot train for the moment (%s); trying again in %.0f s", error, self._delay)
            else:
                log.error(
                    "the trainer exited (%s) while the gateway serves; starting it again in %.0f s",
                    error or f"code {code}",
                    self._delay,
                )
            if not self._respawn():
                return

    def _give_up(self) -> None:
        """Left `failed`: /healthz, /metrics and the dashboard say so, and why (`last_error`)."""
        self._gave_up = True
        self.last_error = (
            f"crashed {self._crashes} times in a row, each within {self.STABLE_SECONDS / 60:g} minutes of its "
            "start, and is not started again (fix the cause and restart the gateway; serving goes on); the last: "
            f"{self.last_error or f'exit code {self.last_exit}'}"
        )
        logging.getLogger("rlproxy").error("the trainer %s", self.last_error)

    def _respawn(self) -> bool:
        """Start it again after the delay, and again later while it cannot be started (no memory
        to fork: often what killed it); False once the gateway stops. An OSError here ended the
        watcher's thread, and the trainer was never started again while /healthz said `restarting`."""
        while not self._stopping.wait(self._delay):
            self._delay = min(self._delay * 2, self.MAX_DELAY_SECONDS)
            try:
                self._spawn()
            except OSError as exc:
                self.last_error = f"could not be started again: {exc}"
                logging.getLogger("rlproxy").error(
                    "the trainer %s; trying again in %.0f s", self.last_error, self._delay
                )
                continue
            self.restarts += 1
            return True
        return False

    def status(self) -> dict:
        running = self.proc is not None and self.proc.poll() is None
        if running:
            state = "running"
        elif self._stopping.is_set() or self.last_exit == 0:
            state = "stopped"
        elif self.last_exit == self.SETTINGS_EXIT or self._gave_up:
            state = "failed"
        else:
            state = "restarting"
        status = {"state": state, "restarts": self.restarts, "last_exit": self.last_exit}
        if self.last_error is not None:
            status["last_error"] = self.last_error
        return status

    def stopping(self) -> None:
        """The gateway is shutting down: a trainer that exits from now on is not started again,
        nor is its exit news (a terminal's Ctrl-C, systemd's SIGTERM to the whole unit, reach it
        first, while the gateway still finishes its requests)."""
        self._stopping.set()

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping.set()
        stop_trainer(self.proc, timeout)
        self._thread.join(timeout=timeout)
        stop_trainer(self.proc, timeout)  # one the watcher started as this began


class ChildOutput:
    """A child's stderr copied to the gateway's as it comes (bytes unchanged: progress bars keep
    their carriage returns), its last lines kept to say why it exited: the `rlproxy train: ...`
    lines the CLI prints for an error it names, else the last line (a traceback's exception)."""

    KEEP_BYTES = 8192

    def __init__(self, proc: Popen) -> None:
        assert proc.stderr is not None
        self._pipe = proc.stderr
        self._tail = b""
        self._thread = threading.Thread(target=self._copy, name="rlproxy-trainer-stderr", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        with self._pipe:
            while chunk := self._pipe.read1(65536):
                with contextlib.suppress(OSError):  # a gateway whose stderr is gone still reads the pipe
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(2, view) :]
                self._tail = (self._tail + chunk)[-self.KEEP_BYTES :]

    def reason(self, code: int) -> str | None:
        """Why the child exited with `code`, in one line (once its output has ended)."""
        self._thread.join(timeout=5)  # a grandchild (a rank) may still hold the pipe: do not wait on it
        lines = [line.strip() for line in self._tail.decode(errors="replace").replace("\r", "\n").splitlines()]
        lines = [line for line in lines if line]
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
        named = []
        for line in reversed(lines):  # the CLI's own lines at the end: one per error (a flag out of range each)
            if not line.startswith("rlproxy train: "):
                break
            named.insert(0, line.removeprefix("rlproxy train: "))
        if named:
            return "; ".join(named)
        return lines[-1][-500:] if lines else None


def check_init_from(store: Store, settings: Settings) -> None:
    """`--init-from NAME@N` as the trainer will read it, checked before it starts, where it seeds
    this run (no step and no checkpoint of it yet): a step the store lacks, or one of another base
    model or LoRA shape, is a `ConfigError` that `rlproxy serve` says in one line and exits 2 on,
    where the trainer found it out only after loading its model, and the gateway served on with
    NAME `loading` step 0 for ever."""
    if not settings.init_from or store.steps(settings.model_name):
        return
    from trainer.checkpoints import latest_checkpoint
    from trainer.resume import check_init_source

    if latest_checkpoint(settings.checkpoints_dir()) is None:  # else the trainer resumes it instead
        check_init_source(store, settings)  # its settings only: the trainer fetches the adapter, once


def start_trainer(args: argparse.Namespace, settings: Settings, store: Store | None = None) -> TrainerChild | None:
    """`--trainer auto`: `rlproxy train` with the same settings as a child process in the
    gateway's process group, restarted if it exits; None when there is nothing to train for.
    `store`: the gateway's, to check `--init-from` first (`check_init_from`)."""
    log = logging.getLogger("rlproxy")
    if settings.trainer == "off":
        return None
    if settings.engine == "openai":
        log.info(
            "trainer not started: the openai engine serves no adapters, so trained steps could not be "
            "served (calls are still recorded; train them with `rlproxy train` for another engine)"
        )
        return None
    if store is not None:
        check_init_from(store, settings)
    cmd, env = trainer_command(args, settings)
    log.info("starting the trainer worker beside the gateway (--trainer off to run without)")
    return TrainerChild(cmd, env, settings.secrets()).start()


def run_gateway(app, trainer: TrainerChild | None, sock, **options) -> None:
    """`uvicorn.run(app, **options)` on the bound socket `sock` (gateway/http/listen.py), that
    stops the trainer child before the process ends. uvicorn re-raises the SIGTERM that stopped
    it once it has shut down, and that ends the process there: a `finally` after uvicorn.run
    never ran, so the gateway exited at once and its trainer went on alone (mid-step, holding
    its GPU and the state dir) until PR_SET_PDEATHSIG reached it. A second SIGTERM or Ctrl-C
    while the trainer finishes its step ends the gateway at once, as it ends the trainer.

    A SIGTERM that shut the gateway down cleanly is not re-raised: the process exits with 0, as
    it does after Ctrl-C. Re-raised, it ended with -15 (143 in a shell), which Kubernetes, Docker
    and CI runners take for a failure of every rolling update and every `docker stop`."""
    import uvicorn

    from gateway.http.listen import url_of

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if trainer is not None:  # Ctrl-C (or a SIGTERM to the group) stops the trainer too: as asked
                trainer.stopping()
            # uvicorn waits for every request before the lifespan's shutdown: one whose write the store
            # never answers (a stalled disk, a frozen PostgreSQL) held the gateway up for ever. An app
            # with no store (yet: a signal while it starts) has no write to give up.
            services = getattr(app.state, "services", None)
            if services is not None:
                services.store.stopping()
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:  # uvicorn logs where it listens only on a socket it bound itself
                logging.getLogger("rlproxy").info("listening on %s (Ctrl-C to stop)", url_of(sock))

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                try:
                    yield
                finally:  # the gateway has shut down; uvicorn re-raises the signals it kept after this
                    self._captured_signals[:] = [sig for sig in self._captured_signals if sig != signal.SIGTERM]
                    if trainer is not None and threading.current_thread() is threading.main_thread():
                        signal.signal(signal.SIGINT, signal.default_int_handler)
                        signal.signal(signal.SIGTERM, signal.SIG_DFL)
                        trainer.stop()

    server = Server(uvicorn.Config(app, **options))
    quiet = _StartupTraceback(app)
    logging.getLogger("uvicorn.error").addFilter(quiet)
    try:
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C, re-raised by uvicorn: as uvicorn.run
            server.run(sockets=[sock])
    except SystemExit:  # uvicorn's exit 3 when the app's startup failed
        error = getattr(app.state, "startup_error", None)
        if error is not None:  # said by `rlproxy serve` in one line, as any other error of the settings
            raise error from None
        raise  # a failure of our own: uvicorn has logged its traceback
    finally:
        logging.getLogger("uvicorn.error").removeFilter(quiet)
    if not server.started:  # the app's startup failed: uvicorn has logged why
        sys.exit(3)


class _StartupTraceback(logging.Filter):
    """Drops the traceback uvicorn logs when the app's startup fails with an RLProxyError (a vLLM
    that does not answer, a --device torch does not know): the error's message says all a user can
    act on, and 40 lines of Starlette's lifespan frames buried it. Any other failure keeps its
    traceback."""

    def __init__(self, app) -> None:
        super().__init__()
        self.app = app

    def filter(self, record: logging.LogRecord) -> bool:
        failed = getattr(self.app.state, "startup_error", None) is not None
        return not (failed and str(record.msg).startswith("Traceback"))


def trainer_command(args: argparse.Namespace, settings: Settings) -> tuple[list[str], dict[str, str]]:
    """The trainer child's command line and environment."""
    cmd = [sys.executable, "-m", "gateway.cli", "train", *settings_argv(args)]
    env = {**without_unknown(os.environ), **secret_settings_env(args)}  # the gateway said them already
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
