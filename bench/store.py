"""Store backends under load: calls/s of one gateway on SQLite, one on PostgreSQL, and two
replicas on one PostgreSQL (the load split evenly between them).

Each gateway runs `--engine openai` against the loopback fake upstream (tests/fake_upstream.py),
recording every call; PostgreSQL is a local server the `pgserver` wheel starts (or the one
`RLPROXY_TEST_POSTGRES` names). The load generator is bench/proxy.py's raw HTTP client.
For each configuration and concurrency: calls/s, p50 and p99 latency, medians over the runs.

    nice -n 10 python bench/store.py            # 3 runs x 3 s per cell
    nice -n 10 python bench/store.py --quick    # 1 run x 1 s per cell

Results: a table on stdout, JSON in bench/out/store.json. On a shared 2-core machine the
servers, the database and the load generator share the cores: read the figures as relative.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.proxy import (  # noqa: E402
    API_KEY,
    OUT,
    Service,
    _spawn,
    _wait_http,
    free_port,
    run_cell,
    start_upstream,
    warm_up,
)


def start_gateway(upstream: Service, workdir: Path, name: str, store: str | None) -> Service:
    port = free_port()
    log = workdir / f"{name}.log"
    env = {"RLPROXY_API_KEY": API_KEY}
    if store:
        env["RLPROXY_STORE"] = store  # environment, not argv: a URL may hold a password
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
            str(workdir / name),
            "--trainer",
            "off",
            "--log-level",
            "warning",
        ],
        log,
        env=env,
    )
    service = Service(name, proc, port, "/v1/chat/completions", log)
    _wait_http(service, "/healthz")
    warm_up(service)
    return service


async def measure(services: list[Service], concurrency: int, seconds: float, tag: str) -> tuple[float, list[float]]:
    """Calls/s summed over the replicas, and every call's latency."""
    share = max(1, concurrency // len(services))
    cells = await asyncio.gather(
        *(run_cell(s.port, s.path, share, seconds, 0.5, f"{tag}-{i}") for i, s in enumerate(services))
    )
    latencies = [lat for c in cells for lat in c.latencies_ms]
    errors = sum(c.errors for c in cells)
    if errors:
        raise RuntimeError(f"{errors} calls failed in {tag}")
    return sum(c.rps for c in cells), latencies


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def new_database(server_url: str) -> str:
    import psycopg

    from tests.helpers_postgres import database_url

    name = "bench_" + uuid.uuid4().hex[:12]
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return database_url(server_url, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    args = parser.parse_args(argv)
    runs, seconds = (1, 1.0) if args.quick else (3, 3.0)
    from tests.helpers_postgres import postgres_server

    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlproxy-bench-store-") as tmp:
        workdir = Path(tmp)
        pg_root = Path(tempfile.gettempdir()) / f"rlproxy-bench-pg-{uuid.uuid4().hex[:8]}"
        with postgres_server(pg_root) as server_url:
            upstream = start_upstream(workdir)
            try:
                configs = [
                    ("sqlite, 1 gateway", [None]),
                    ("postgres, 1 gateway", ["pg"]),
                    ("postgres, 2 replicas", ["pg", "pg"]),
                ]
                for label, stores in configs:
                    url = new_database(server_url) if "pg" in stores else None
                    services = [
                        start_gateway(upstream, workdir, f"gw{i}-{uuid.uuid4().hex[:6]}", url if s else None)
                        for i, s in enumerate(stores)
                    ]
                    try:
                        for concurrency in args.concurrency:
                            results = [
                                asyncio.run(measure(services, concurrency, seconds, f"{label[:3]}{concurrency}-{r}"))
                                for r in range(runs)
                            ]
                            row = {
                                "config": label,
                                "concurrency": concurrency,
                                "calls_per_s": statistics.median(r[0] for r in results),
                                "p50_ms": statistics.median(_pct(r[1], 0.5) for r in results),
                                "p99_ms": statistics.median(_pct(r[1], 0.99) for r in results),
                                "runs": [round(r[0], 1) for r in results],
                            }
                            rows.append(row)
                            print(
                                f"{label:<22} conc {concurrency:>3}: {row['calls_per_s']:8.1f} calls/s", file=sys.stderr
                            )
                    finally:
                        for service in services:
                            service.stop()
            finally:
                upstream.stop()
    print(f"\n{'store':<22} {'conc':>5} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for row in rows:
        print(
            f"{row['config']:<22} {row['concurrency']:>5} {row['calls_per_s']:>9.1f} {row['p50_ms']:>8.2f} "
            f"{row['p99_ms']:>8.2f}"
        )
    (OUT / "store.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
