"""The gateway's own CPU per call on the vLLM path, on any machine: no vLLM needed.

bench/vllm.py measures it in front of real CPU vLLMs, which on a 2-core machine puts the load
generator on the gateway's core and vLLM on the other. This bench puts stand-in vLLMs
(tests/fake_vllm.py, each non-streamed answer held for `--answer-delay` seconds, as a vLLM
generating 16 tokens would be busy) in their place, so the same measurement runs wherever there
are cores, a GPU server's included, and so the core layout can be chosen:

- `own`: the gateway on a core of its own, the load generator on another, the stand-ins on the
  rest (needs 4 cores): what a server gives the gateway;
- `shared`: the load generator on the gateway's core, as bench/vllm.py has it on 2 cores.

Targets, one call at a time by default, interleaved per run:
- **rlproxy**: `rlproxy serve --engine vllm --vllm-url` once per stand-in (`--replicas`, its
  VLLMReplicas path from 2), recording on, bearer key on, the client body of bench/vllm.py;
- **relay**: bench/relay_floor.py (uvicorn and the gateway's HTTP client forwarding bytes,
  nothing else) to the first stand-in: what any relay on this stack costs on this machine.

Each server's CPU is read per thread from /proc (schedstat); its idle CPU per second (no calls)
is measured apart and taken off the cell's seconds: **net** = (CPU under load - idle rate x
seconds) / calls, the figure issue 41 sets at <= 0.5 ms at c=1.

    python bench/router_cost.py                      # 3 runs x 5 s, c=1, layout own if 4+ cores
    python bench/router_cost.py --layout shared --concurrency 1 16

Results: a table on stdout, JSON in bench/out/router_cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from bench.proxy import OUT, ROOT, CellResult, Service, _spawn, _wait_http, free_port, run_cell, shut_down  # noqa: E402
from bench.vllm import (  # noqa: E402
    MODEL,
    Layout,
    _interrupt,
    _pin,
    client_body,
    idle_cpu_ms_per_s,
    start_relay,
    start_rlproxy,
    thread_cpu_seconds,
    upstream_body,
)


def layout_for(name: str) -> Layout:
    cores = sorted(os.sched_getaffinity(0))
    if name == "own":
        if len(cores) < 4:
            raise SystemExit(f"--layout own needs 4 cores, this process has {len(cores)}: use --layout shared")
        return Layout(cores[3:], [cores[1]], [cores[2]], pinned=True)
    if len(cores) < 2:
        return Layout(cores, cores, cores, pinned=False)
    return Layout([cores[0]], [cores[1]], [cores[1]], pinned=True)


def start_stand_in(layout: Layout, workdir: Path, services: list[Service], index: int, delay: float) -> Service:
    port = free_port()
    _pin(layout.vllm, layout)
    cmd = [sys.executable, str(ROOT / "tests" / "fake_vllm.py"), "serve", MODEL, "--port", str(port)]
    cmd += ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", "--answer-delay", str(delay)]
    log = workdir / f"stand-in-{index}.log"
    service = Service(f"stand-in-{index}", _spawn(cmd, log), port, "/v1/chat/completions", log)
    services.append(service)
    _wait_http(service, "/health", timeout=60)
    return service


@dataclass
class Row:
    target: str
    concurrency: int
    calls_per_s: float
    p50_ms: float
    raw_ms: float  # the server's CPU per call
    idle_ms_per_s: float
    net_ms: float  # less its idle rate over the cell's seconds: the median over runs
    net_by_run: list[float]
    errors: int


def measure(service: Service, pid: int, concurrency: int, seconds: float, tag: str) -> CellResult:
    return asyncio.run(
        run_cell(
            service.port,
            service.path,
            concurrency,
            seconds,
            1.0,
            tag,
            body=service.body,
            also_pgids=(pid,),
            cpu_of=thread_cpu_seconds,
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=("own", "shared"), default=None, help="default: own with 4+ cores")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per run and cell")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1])
    parser.add_argument("--replicas", type=int, default=2, help="stand-in vLLMs the gateway is attached to")
    parser.add_argument("--answer-delay", type=float, default=0.08, help="seconds each stand-in takes to answer")
    parser.add_argument("--idle-seconds", type=float, default=8.0)
    parser.add_argument("--no-floor", action="store_true", help="leave out the bare relay")
    args = parser.parse_args(argv)
    layout = layout_for(args.layout or ("own" if len(os.sched_getaffinity(0)) >= 4 else "shared"))
    signal.signal(signal.SIGTERM, _interrupt)  # like Ctrl-C: `finally` stops every process
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    OUT.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="router-cost-", dir=OUT))
    services: list[Service] = []
    finished = False
    try:
        stand_ins = [start_stand_in(layout, workdir, services, i, args.answer_delay) for i in range(args.replicas)]
        rlproxy, _ = start_rlproxy(stand_ins, layout, workdir, services)
        client = client_body(16)
        targets = {
            "rlproxy": (
                Service("rlproxy", rlproxy.proc, rlproxy.port, rlproxy.path, rlproxy.log, json.dumps(client).encode()),
                rlproxy.proc.pid,
            )
        }
        if not args.no_floor:
            relay = start_relay(stand_ins[0], layout, workdir, services)
            body = json.dumps(upstream_body(client), separators=(",", ":")).encode()
            targets["relay"] = (Service("relay", relay.proc, relay.port, relay.path, relay.log, body), relay.proc.pid)
        _pin(layout.loadgen, layout)
        for name, (service, pid) in targets.items():
            measure(service, pid, max(args.concurrency), 2.0, f"warm-{name}")
        idle = {name: idle_cpu_ms_per_s(pid, args.idle_seconds) for name, (_, pid) in targets.items()}
        print(
            f"cores: {layout.describe()}; {args.replicas} stand-in(s) answering after {args.answer_delay:g} s; "
            f"cpus: {os.cpu_count()}; load average {os.getloadavg()[0]:.1f}",
            file=sys.stderr,
        )
        cells: dict[tuple[str, int], list] = {}
        for run in range(args.runs):
            order = list(targets.items()) if run % 2 == 0 else list(reversed(targets.items()))
            for name, (service, pid) in order:
                for concurrency in args.concurrency:
                    cell = measure(service, pid, concurrency, args.seconds, f"{name}{run}c{concurrency}")
                    cells.setdefault((name, concurrency), []).append(cell)
        rows = []
        for (name, concurrency), runs in cells.items():
            nets = [(1000 * c.also_cpu_seconds[targets[name][1]] - idle[name] * c.seconds) / c.requests for c in runs]
            raws = [1000 * c.also_cpu_seconds[targets[name][1]] / c.requests for c in runs]
            rows.append(
                Row(
                    name,
                    concurrency,
                    statistics.median(c.rps for c in runs),
                    statistics.median(c.percentile(0.5) for c in runs),
                    statistics.median(raws),
                    idle[name],
                    statistics.median(nets),
                    [round(n, 3) for n in nets],
                    sum(c.errors for c in runs),
                )
            )
        print(f"\n{args.runs} run(s) x {args.seconds:g} s per cell; load average {os.getloadavg()[0]:.1f} after")
        print(
            f"{'target':<8} {'conc':>4} {'calls/s':>8} {'p50 ms':>8} {'raw ms':>7} {'idle ms/s':>9} "
            f"{'net ms':>7}  net by run"
        )
        for row in sorted(rows, key=lambda r: (r.target != "rlproxy", r.concurrency)):
            print(
                f"{row.target:<8} {row.concurrency:>4} {row.calls_per_s:8.1f} {row.p50_ms:8.2f} {row.raw_ms:7.3f} "
                f"{row.idle_ms_per_s:9.2f} {row.net_ms:7.3f}  {row.net_by_run}"
                + (f"  errors {row.errors}" if row.errors else "")
            )
        ones = [r for r in rows if r.target == "rlproxy" and r.concurrency == 1]
        if ones:
            verdict = "met" if ones[0].net_ms <= 0.5 else "missed"
            print(f"  [{verdict}] rlproxy's net CPU per call at c=1 <= 0.5 ms: {ones[0].net_ms:.3f} ms")
        (OUT / "router_cost.json").write_text(
            json.dumps({"layout": layout.describe(), "rows": [asdict(r) for r in rows]}, indent=1)
        )
        finished = True
    finally:
        shut_down(services, workdir, finished)
    return 0


if __name__ == "__main__":
    sys.exit(main())
