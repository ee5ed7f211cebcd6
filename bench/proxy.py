"""Proxy overhead: direct vs rlproxy (openai engine, recording on) vs LiteLLM's proxy vs rLLM's gateway.

One run, one loopback upstream (tests/fake_upstream.py in its own process), each
proxy in its own process. For each target and concurrency: requests/s, p50 and
p99 latency (medians over the runs) and the p50 added over calling the upstream
directly. Non-stream chat completions; every connection sends a session id that
changes every few calls, as an agent would (in the URL for rLLM's gateway, which takes it
from there). `rlproxy-resp` is the same rlproxy answering the Responses API
(`POST /v1/responses`, translated to chat completions for the chat-only upstream).
`rllm` is `rllm-model-gateway` from PyPI (the nearest RL capture gateway: its SQLite
store, sessions in its URL), installed like LiteLLM into a venv under bench/out/.

The load generator is a raw asyncio HTTP/1.1 client (uvloop + httptools, one
keep-alive connection per concurrent slot, pre-encoded requests): it costs a
fraction of what aiohttp's client would per request, so on a 2-core machine the
CPU goes to the servers being measured, not to the measuring.

    python bench/proxy.py            # 3 runs x 3 s per cell; installs litellm[proxy] if missing
    python bench/proxy.py --quick    # 1 run x 1 s per cell; LiteLLM only if already there
    python bench/proxy.py --profile  # also py-spy the gateway at the highest concurrency

LiteLLM's proxy extras would change packages other code here uses (websockets,
rich), so they go into a venv under bench/out/ that sees the system packages.
Results: a table on stdout, JSON in bench/out/proxy.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httptools

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
LITELLM_VENV = OUT / "litellm-venv"
RLLM_VENV = OUT / "rllm-venv"
RLLM_PACKAGE = "rllm-model-gateway==0.1.0"
MODEL = "fake-model"
BODY = json.dumps(
    {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Say hello to the benchmark."},
        ],
        "max_tokens": 16,
        "temperature": 0.7,
    }
).encode()
RESPONSES_BODY = json.dumps(
    {
        "model": MODEL,
        "instructions": "You are a terse assistant.",
        "input": "Say hello to the benchmark.",
        "max_output_tokens": 16,
        "temperature": 0.7,
    }
).encode()
CALLS_PER_SESSION = 8
# Both proxies authenticate every call with this key (LiteLLM refuses to start without one).
API_KEY = "sk-bench-" + secrets.token_hex(24)


# ---------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Service:
    name: str
    proc: subprocess.Popen
    port: int
    path: str  # the chat completions path; `{session}` is replaced by the call's session id
    log: Path
    body: bytes = BODY

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)


def _spawn(cmd: list[str], log: Path, env: dict | None = None, drop_env: tuple[str, ...] = ()) -> subprocess.Popen:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    for name in drop_env:
        full_env.pop(name, None)
    with log.open("wb") as handle:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            cmd, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True, env=full_env
        )


def _wait_http(service: Service, path: str, timeout: float = 180.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service.proc.poll() is not None:
            raise RuntimeError(
                f"{service.name} exited ({service.proc.returncode}); see {service.log}:\n"
                + service.log.read_text(errors="replace")[-3000:]
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{service.port}{path}", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{service.name} did not come up in {timeout:.0f} s; see {service.log}")


def warm_up(service: Service, calls: int = 30) -> None:
    """A few calls before any measuring, so lazy imports and client caches are built (LiteLLM
    imports most of the openai package on its first call: a second of CPU)."""
    import httpx

    with httpx.Client(
        base_url=f"http://127.0.0.1:{service.port}",
        timeout=120,
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    ) as http:
        for _ in range(calls):
            reply = http.post(service.path.format(session="warm-up"), content=service.body)
            if reply.status_code != 200:
                raise RuntimeError(
                    f"{service.name} answered {reply.status_code} to the warm-up call: {reply.text[:500]}"
                )


def start_upstream(workdir: Path) -> Service:
    port = free_port()
    log = workdir / "upstream.log"
    proc = _spawn([sys.executable, "tests/fake_upstream.py", "--port", str(port)], log)
    service = Service("upstream", proc, port, "/v1/chat/completions", log)
    _wait_http(service, "/v1/models")
    return service


def start_rlproxy(upstream: Service, workdir: Path) -> tuple[Service, Path]:
    port = free_port()
    state_dir = workdir / "rlproxy-state"
    log = workdir / "rlproxy.log"
    proc = _spawn(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--engine",
            "openai",
            "--upstream-url",
            f"http://127.0.0.1:{upstream.port}/v1",
            "--state-dir",
            str(state_dir),
            "--trainer",
            "off",
            "--log-level",
            "warning",
        ],
        log,
        env={"RLPROXY_API_KEY": API_KEY},
    )  # environment, not argv: keys stay out of `ps`
    service = Service("rlproxy", proc, port, "/v1/chat/completions", log)
    _wait_http(service, "/healthz")
    return service, state_dir / "rlproxy.db"


def rllm_python(install: bool) -> Path | None:
    """The interpreter of a venv (system packages visible) with rLLM's gateway, installed if asked."""
    python = RLLM_VENV / "bin" / "python"
    check = [str(python), "-c", "import rllm_model_gateway.server"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    if not install:
        return None
    print(f"installing {RLLM_PACKAGE} into bench/out/rllm-venv ...", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(RLLM_VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", RLLM_PACKAGE], check=True)
    return python if subprocess.run(check, capture_output=True).returncode == 0 else None


def start_rllm(python: Path, upstream: Service, workdir: Path) -> Service:
    port = free_port()
    log = workdir / "rllm.log"
    proc = _spawn(
        [
            str(python),
            "-m",
            "rllm_model_gateway",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker",
            f"http://127.0.0.1:{upstream.port}/v1",
            "--store",
            "sqlite",
            "--db-path",
            str(workdir / "rllm.db"),
            "--log-level",
            "warning",
        ],
        log,
    )
    service = Service("rllm", proc, port, "/sessions/{session}/v1/chat/completions", log)
    _wait_http(service, "/health")
    return service


def litellm_python() -> Path | None:
    """The interpreter that has litellm's proxy extras, or None."""
    for python in (Path(sys.executable), LITELLM_VENV / "bin" / "python"):
        if (
            python.exists()
            and subprocess.run(
                [str(python), "-c", "import litellm.proxy.proxy_server"], capture_output=True, cwd=tempfile.gettempdir()
            ).returncode
            == 0
        ):
            return python
    return None


def install_litellm() -> Path:
    """`pip install 'litellm[proxy]'` into bench/out/litellm-venv (system packages visible, so only the
    extras are downloaded and nothing the rest of rlproxy uses changes version)."""
    if not (LITELLM_VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(LITELLM_VENV)], check=True)
    print("installing litellm[proxy] into bench/out/litellm-venv ...", file=sys.stderr, flush=True)
    subprocess.run(
        [str(LITELLM_VENV / "bin" / "python"), "-m", "pip", "install", "--quiet", "litellm[proxy]"], check=True
    )
    python = litellm_python()
    if python is None:
        raise RuntimeError("litellm[proxy] installed but `import litellm.proxy.proxy_server` still fails")
    return python


def start_litellm(python: Path, upstream: Service, workdir: Path) -> Service:
    port = free_port()
    config = workdir / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: http://127.0.0.1:{upstream.port}/v1\n"
        "      api_key: sk-bench\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
        "  drop_params: true\n"
    )
    log = workdir / "litellm.log"
    # The litellm CLI script lives next to the interpreter; `-m litellm` has no __main__.
    cli = python.parent / "litellm"
    cmd = [str(cli)] if cli.exists() else [str(python), "-c", "from litellm import run_server; run_server()"]
    proc = _spawn(
        [*cmd, "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"],
        log,
        env={
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_LOG": "ERROR",
            "LITELLM_TELEMETRY": "False",
            "LITELLM_MASTER_KEY": API_KEY,
        },
        drop_env=("DATABASE_URL", "STORE_MODEL_IN_DB"),
    )  # no database: LiteLLM's lightest set-up
    service = Service("litellm", proc, port, "/v1/chat/completions", log)
    _wait_http(service, "/health/liveliness")
    return service


def group_cpu_seconds(pgid: int) -> float:
    """CPU time (user + system) used so far by every live process in a process group."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields[2] is pgrp; utime, stime are fields[11], fields[12]
            total += int(fields[11]) + int(fields[12])
    return total / tick


# ---------------------------------------------------------------- load generator


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; `request()` sends bytes and waits for the whole response."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.done: asyncio.Future | None = None
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def connection_lost(self, exc) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("connection closed mid-response"))
        if not self.lost.done():
            self.lost.set_result(None)

    def on_message_complete(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(self.parser.get_status_code())

    async def request(self, data: bytes) -> int:
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return await self.done


def _request_bytes(port: int, path: str, session: str, body: bytes = BODY) -> bytes:
    head = (
        f"POST {path.format(session=session)} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nAuthorization: Bearer {API_KEY}\r\nX-Session-Id: {session}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


@dataclass
class CellResult:
    requests: int
    errors: int
    seconds: float
    latencies_ms: list[float] = field(repr=False, default_factory=list)
    cpu_seconds: float | None = None  # CPU the measured server's process group used during the cell
    also_cpu_seconds: dict[int, float] = field(default_factory=dict)  # the same for each of `also_pgids`

    @property
    def cpu_ms_per_request(self) -> float | None:
        return None if self.cpu_seconds is None or not self.requests else 1000 * self.cpu_seconds / self.requests

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def run_cell(
    port: int,
    path: str,
    concurrency: int,
    seconds: float,
    warmup: float,
    tag: str,
    pgid: int | None = None,
    body: bytes = BODY,
    protocol=_Connection,
    also_pgids: tuple[int, ...] = (),
    cpu_of=None,
) -> CellResult:
    """`protocol`: a factory of `_Connection`s (a subclass may read the bodies); `also_pgids`: more
    process groups whose CPU during the measured seconds goes into `also_cpu_seconds`; `cpu_of`,
    what reads a group's CPU seconds (default `group_cpu_seconds`)."""
    cpu_of = cpu_of or group_cpu_seconds
    loop = asyncio.get_running_loop()
    connections = [(await loop.create_connection(protocol, "127.0.0.1", port))[1] for _ in range(concurrency)]
    latencies: list[float] = []
    counts = {"ok": 0, "errors": 0}
    measuring = False

    async def worker(index: int, conn: _Connection, stop_at: float) -> None:
        nonlocal measuring
        n = 0
        while time.perf_counter() < stop_at:
            data = _request_bytes(port, path, f"bench-{tag}-{index}-{n // CALLS_PER_SESSION}", body)
            n += 1
            started = time.perf_counter()
            status = await conn.request(data)
            if measuring:
                latencies.append((time.perf_counter() - started) * 1000.0)
                counts["ok" if status == 200 else "errors"] += 1

    try:
        warm_until = time.perf_counter() + warmup
        await asyncio.gather(*(worker(i, c, warm_until) for i, c in enumerate(connections)))
        measuring = True
        cpu_before = cpu_of(pgid) if pgid else None
        also_before = {g: cpu_of(g) for g in also_pgids}
        began = time.perf_counter()
        await asyncio.gather(*(worker(i, c, began + seconds) for i, c in enumerate(connections)))
        elapsed = time.perf_counter() - began
        cpu = cpu_of(pgid) - cpu_before if pgid else None
        also = {g: cpu_of(g) - before for g, before in also_before.items()}
    finally:
        for conn in connections:
            conn.transport.close()
    return CellResult(
        requests=counts["ok"],
        errors=counts["errors"],
        seconds=elapsed,
        latencies_ms=latencies,
        cpu_seconds=cpu,
        also_cpu_seconds=also,
    )


# ---------------------------------------------------------------- the bench


@dataclass
class Row:
    target: str
    concurrency: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    runs: list[dict]
    cpu_ms_per_request: float | None = None
    added_p50_ms: float | None = None


def summarise(target: str, concurrency: int, cells: list[CellResult]) -> Row:
    return Row(
        target=target,
        concurrency=concurrency,
        rps=statistics.median(c.rps for c in cells),
        p50_ms=statistics.median(c.percentile(0.50) for c in cells),
        p99_ms=statistics.median(c.percentile(0.99) for c in cells),
        errors=sum(c.errors for c in cells),
        cpu_ms_per_request=(
            statistics.median(c.cpu_ms_per_request for c in cells)
            if all(c.cpu_ms_per_request is not None for c in cells)
            else None
        ),
        runs=[
            {
                "rps": round(c.rps, 1),
                "p50_ms": round(c.percentile(0.5), 3),
                "p99_ms": round(c.percentile(0.99), 3),
                "requests": c.requests,
                "errors": c.errors,
            }
            for c in cells
        ],
    )


def print_table(rows: list[Row], concurrencies: list[int]) -> None:
    print(
        f"\n{'target':<13} {'conc':>5} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} "
        f"{'cpu ms/req':>10} {'errors':>6}"
    )
    for row in rows:
        added = "" if row.added_p50_ms is None else f"{row.added_p50_ms:+.3f}"
        cpu = "" if row.cpu_ms_per_request is None else f"{row.cpu_ms_per_request:.3f}"
        print(
            f"{row.target:<13} {row.concurrency:>5} {row.rps:>9.0f} {row.p50_ms:>8.3f} {row.p99_ms:>8.3f} "
            f"{added:>8} {cpu:>10} {row.errors:>6}"
        )
    by = {(r.target, r.concurrency): r for r in rows}
    print()
    for c in concurrencies:
        if ("rlproxy", c) in by and ("litellm", c) in by:
            ratio = by[("rlproxy", c)].rps / by[("litellm", c)].rps
            print(f"rlproxy / litellm req/s at c={c}: {ratio:.1f}x")
        if ("rlproxy", c) in by and ("rllm", c) in by:
            print(f"rlproxy / rllm    req/s at c={c}: {by[('rlproxy', c)].rps / by[('rllm', c)].rps:.1f}x")
        if ("rlproxy", c) in by and ("direct", c) in by:
            print(f"rlproxy / direct  req/s at c={c}: {by[('rlproxy', c)].rps / by[('direct', c)].rps:.2f}")


def print_targets(rows: list[Row]) -> None:
    """The issue's targets, met or not."""
    by = {(r.target, r.concurrency): r for r in rows}
    checks = []
    if ("rlproxy", 1) in by and by[("rlproxy", 1)].added_p50_ms is not None:
        added = by[("rlproxy", 1)].added_p50_ms
        checks.append((f"p50 added at c=1 <= 0.5 ms: {added:.3f} ms", added <= 0.5))
    if ("rlproxy", 64) in by and ("rllm", 64) in by:
        ratio = by[("rlproxy", 64)].rps / by[("rllm", 64)].rps
        checks.append((f"rlproxy >= 10x rLLM's gateway at c=64: {ratio:.1f}x", ratio >= 10))
    if ("rlproxy", 64) in by:
        rps = by[("rlproxy", 64)].rps
        checks.append((f"rlproxy >= 1,500 req/s at c=64 (recording on): {rps:.0f}", rps >= 1500))
        if ("litellm", 64) in by:
            ratio = rps / by[("litellm", 64)].rps
            checks.append((f"rlproxy >= 25x LiteLLM at c=64: {ratio:.1f}x", ratio >= 25))
    for text, met in checks:
        print(f"  [{'met' if met else 'MISSED'}] {text}")


def profile_gateway(pid: int, port: int, path: str, concurrency: int, seconds: float) -> Path | None:
    """py-spy the gateway under load; returns the collapsed-stack file (and prints the hottest frames)."""
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        print("py-spy not found: pip install py-spy", file=sys.stderr)
        return None
    out = OUT / "gateway-profile.txt"
    spy = subprocess.Popen(
        [
            py_spy,
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(int(seconds) + 1),
            "--rate",
            "250",
            "--format",
            "raw",
            "--nonblocking",
            "--output",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    asyncio.run(run_cell(port, path, concurrency, seconds + 1.5, 0.2, "profile"))
    spy.wait(timeout=60)
    if not out.exists():
        return None
    inclusive: dict[str, int] = {}
    total = 0
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        total += int(count)
        # Per function (file kept, line dropped), counted once per sample even when recursive.
        for frame in {re.sub(r":\d+\)$", ")", frame) for frame in stack.split(";")}:
            inclusive[frame] = inclusive.get(frame, 0) + int(count)
    # Frames every sample of the event loop shares (runpy, CLI, uvicorn.run) say nothing.
    shared = max(inclusive.values(), default=0)
    ranked = [(frame, n) for frame, n in sorted(inclusive.items(), key=lambda kv: -kv[1]) if n < shared]
    print(
        f"\ngateway profile at c={concurrency}: {total} samples, share of samples per function "
        f"(inclusive; py-spy counts a thread waiting for the GIL as busy in its current frame): {out}"
    )
    for frame, count in ranked[:30]:
        print(f"  {100 * count / total:5.1f}%  {frame[:150]}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 run of 1 s per cell; LiteLLM only if installed")
    parser.add_argument("--runs", type=int, default=None, help="runs per cell (default 3; --quick 1)")
    parser.add_argument("--seconds", type=float, default=None, help="measured seconds per run (default 3)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--no-litellm", action="store_true", help="skip LiteLLM's proxy")
    parser.add_argument("--no-rllm", action="store_true", help="skip rLLM's gateway")
    parser.add_argument("--no-responses", action="store_true", help="skip the Responses API row")
    parser.add_argument("--profile", action="store_true", help="py-spy the gateway at the highest concurrency")
    args = parser.parse_args(argv)
    runs = args.runs or (1 if args.quick else 3)
    seconds = args.seconds or (1.0 if args.quick else 3.0)
    warmup = 0.3 if args.quick else 1.0
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    OUT.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="proxy-", dir=OUT))
    services: list[Service] = []
    finished = False
    try:
        upstream = start_upstream(workdir)
        services.append(upstream)
        rlproxy, db_path = start_rlproxy(upstream, workdir)
        services.append(rlproxy)
        targets: dict[str, Service] = {"direct": upstream, "rlproxy": rlproxy}
        if not args.no_responses:
            targets["rlproxy-resp"] = Service(
                "rlproxy-resp", rlproxy.proc, rlproxy.port, "/v1/responses", rlproxy.log, RESPONSES_BODY
            )
        if not args.no_rllm:
            python = rllm_python(install=not args.quick)
            if python is None:
                print("rLLM's gateway skipped: not installed (a run without --quick installs it)", file=sys.stderr)
            else:
                rllm = start_rllm(python, upstream, workdir)
                services.append(rllm)
                targets["rllm"] = rllm
        if not args.no_litellm:
            python = litellm_python()
            if python is None and not args.quick:
                python = install_litellm()
            if python is None:
                print("LiteLLM's proxy skipped: not installed (a run without --quick installs it)", file=sys.stderr)
            else:
                litellm = start_litellm(python, upstream, workdir)
                services.append(litellm)
                targets["litellm"] = litellm

        for service in targets.values():
            warm_up(service)
        print(
            f"{runs} run(s) x {seconds:g} s per cell (after {warmup:g} s warm-up), concurrency "
            f"{args.concurrency}; cpus: {os.cpu_count()}",
            file=sys.stderr,
        )
        load_before = os.getloadavg()[0]
        cells: dict[tuple[str, int], list[CellResult]] = {}
        for run in range(runs):  # runs interleave targets, so a noisy neighbour hits all of them alike
            for name, service in targets.items():
                for concurrency in args.concurrency:
                    cell = asyncio.run(
                        run_cell(
                            service.port,
                            service.path,
                            concurrency,
                            seconds,
                            warmup,
                            f"{name}{run}c{concurrency}",
                            pgid=service.proc.pid,
                            body=service.body,
                        )
                    )
                    cells.setdefault((name, concurrency), []).append(cell)
                    print(
                        f"  run {run + 1}/{runs} {name:<8} c={concurrency:<3} {cell.rps:8.0f} req/s "
                        f"p50 {cell.percentile(0.5):7.3f} ms  cpu {cell.cpu_ms_per_request or 0:.3f} ms/req  "
                        f"errors {cell.errors}",
                        file=sys.stderr,
                        flush=True,
                    )

        load_after = os.getloadavg()[0]
        rows = [summarise(name, c, cells[(name, c)]) for name in targets for c in args.concurrency]
        direct = {r.concurrency: r for r in rows if r.target == "direct"}
        for row in rows:
            if row.target != "direct":
                row.added_p50_ms = row.p50_ms - direct[row.concurrency].p50_ms

        # Recording on means recorded: every answered rlproxy call is a row.
        answered = sum(c.requests + c.errors for (name, _), runs_ in cells.items() if name == "rlproxy" for c in runs_)
        with contextlib.closing(sqlite3.connect(db_path)) as db:
            recorded = db.execute("SELECT COUNT(*) FROM calls").fetchone()[0]
        print_table(rows, args.concurrency)
        print(f"rlproxy recorded {recorded} calls (>= the {answered} measured; warm-ups are recorded too)")
        print(
            f"load average (1 min) {load_before:.1f} before, {load_after:.1f} after, on {os.cpu_count()} cpus: "
            "other work on the machine shows in req/s and latency, much less in cpu ms/req"
        )
        print_targets(rows)

        profile = None
        if args.profile:
            profile = profile_gateway(rlproxy.proc.pid, rlproxy.port, rlproxy.path, max(args.concurrency), seconds)
        result = {
            "runs": runs,
            "seconds": seconds,
            "cpus": os.cpu_count(),
            "load_average": [load_before, load_after],
            "rows": [asdict(r) for r in rows],
            "recorded_calls": recorded,
            "profile": str(profile) if profile else None,
        }
        (OUT / "proxy.json").write_text(json.dumps(result, indent=2))
        finished = True
    finally:
        shut_down(services, workdir, finished)
    return 0


def shut_down(services: list[Service], workdir: Path, finished: bool, stop=Service.stop) -> None:
    """Stop every service, the last started first; keep the logs of a run that did not finish."""
    for service in reversed(services):
        stop(service)
    if finished:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"logs kept in {workdir}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
