"""What shadow samples cost live traffic: live-call latency with shadows off and on.

    python bench/shadow_latency.py                  # 3 windows x 20 s per config, 4 calls/s
    python bench/shadow_latency.py --quick          # 1 window x 10 s
    python bench/shadow_latency.py --rate 4 8       # several arrival rates

One gateway per config (`rlproxy serve`, local engine, the built-in tiny model, trainer off),
each in its own process, both up at once and warmed up first; their windows interleave (off
then on, then on then off, ...), each started with no shadow of either gateway in flight. The same Poisson
stream of live SHOUT calls goes to each (`gateway.demo.shout`: its system prompt and prompts,
no X-Group-Id, split train, temperature 1, 6 tokens): shadows off, then `--shadow-samples 7`
with the demo's scripted judge (`gateway.demo.judge`, in this process, reached through litellm
as `openai/scripted-judge` exactly like a real judge). Per config and rate: the live calls'
latency, median and p90 (each the median over the windows), its ratio to shadows off measured
in the same run, and the shadow groups completed (judged: `GET /v1/groups?origin=shadow`,
`ruler_status` 'scored') during the windows, per window.

Results: a table on stdout, JSON in bench/out/shadow_latency.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.demo import shout  # noqa: E402
from gateway.demo.judge import ScriptedJudge  # noqa: E402
from gateway.demo.options import SCRIPTED_JUDGE_MODEL  # noqa: E402

OUT = ROOT / "bench" / "out"
SHADOWS = 7


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def gateway(state: Path, extra: list[str]):
    """`rlproxy serve --trainer off ...` in its own process group; yields its URL once healthy."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--trainer", "off", "--state-dir", str(state), "--log-level", "warning", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    log = open(state.parent / f"{state.name}.log", "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the gateway exited with {proc.returncode}; see {log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"the gateway did not become healthy; see {log.name}")
            time.sleep(0.1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


async def live_call(client: httpx.AsyncClient, rng: random.Random, n: int) -> float:
    body = {
        "model": "agent",
        "messages": shout.messages_for(shout.sample(rng)),
        "max_tokens": 6,
        "temperature": 1.0,
    }
    started = time.perf_counter()
    response = await client.post("/v1/chat/completions", json=body, headers={"X-Session-Id": f"bench-{n:07d}"})
    response.raise_for_status()
    return (time.perf_counter() - started) * 1000.0


async def scored_shadow_groups(client: httpx.AsyncClient) -> set[str]:
    scored: set[str] = set()
    cursor = None
    while True:
        params = {"origin": "shadow", "limit": 200, **({"cursor": cursor} if cursor else {})}
        page = (await client.get("/v1/groups", params=params)).raise_for_status().json()
        scored |= {g["id"] for g in page["data"] if g.get("ruler_status") == "scored"}
        cursor = page.get("next_cursor")
        if not page.get("has_more") or not cursor:
            return scored


async def shadows_in_flight(client: httpx.AsyncClient, url: str) -> float:
    text = (await client.get(url + "/metrics")).text
    for line in text.splitlines():
        if line.startswith("rlproxy_shadow_in_flight "):
            return float(line.split()[1])
    return 0.0


async def quiet(urls: list[str]) -> None:
    """Wait until no gateway has shadows in flight (the last window's are finished)."""
    async with httpx.AsyncClient(timeout=30) as client:
        for url in urls:
            for _ in range(600):
                if await shadows_in_flight(client, url) == 0:
                    break
                await asyncio.sleep(0.1)


async def window(url: str, rate: float, seconds: float, seed: int, first: int) -> tuple[list[float], int]:
    """A Poisson stream for `seconds`; (each live call's latency in ms, shadow groups judged meanwhile)."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        before = await scored_shadow_groups(client)
        calls = []
        start = time.monotonic()
        at, n = start, first
        while at < start + seconds:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            calls.append(asyncio.create_task(live_call(client, rng, n)))
            n += 1
            at += rng.expovariate(rate)
        latencies = await asyncio.gather(*calls)
        judged = len(await scored_shadow_groups(client) - before)
    return list(latencies), judged


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(urls: dict[str, str], rates: list[float], runs: int, seconds: float) -> list[dict]:
    """Each config's windows, interleaved: off then on in even runs, on then off in odd ones, the
    same Poisson stream (seed) for both in a run, each window started with both gateways quiet."""
    for url in urls.values():
        asyncio.run(window(url, 8.0, 3.0, 12345, 9_000_000))  # warm-up: the model's first batches, litellm's import
    rows = []
    for rate in rates:
        results: dict[str, list[tuple[list[float], int]]] = {label: [] for label in urls}
        for run in range(runs):
            order = list(urls) if run % 2 == 0 else list(reversed(urls))
            for label in order:
                asyncio.run(quiet(list(urls.values())))
                seed = 1000 * run + int(rate)
                results[label].append(asyncio.run(window(urls[label], rate, seconds, seed, first=100_000 * run)))
        for label, windows in results.items():
            row = {
                "shadows": label,
                "rate": rate,
                "calls": sum(len(latencies) for latencies, _ in windows),
                "p50_ms": statistics.median(statistics.median(latencies) for latencies, _ in windows),
                "p90_ms": statistics.median(percentile(latencies, 0.9) for latencies, _ in windows),
                "judged_per_window": statistics.median(judged for _, judged in windows),
                "runs": [round(statistics.median(latencies), 1) for latencies, _ in windows],
            }
            rows.append(row)
            print(f"shadows {label:<4} {rate:g}/s: p50 by window {row['runs']} ms", file=sys.stderr)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, nargs="+", default=[4.0], help="live calls per second (Poisson)")
    parser.add_argument("--seconds", type=float, default=20.0, help="one measured window")
    parser.add_argument("--runs", type=int, default=3, help="windows per config and rate")
    parser.add_argument("--quick", action="store_true", help="1 window x 10 s")
    args = parser.parse_args()
    runs, seconds = (1, 10.0) if args.quick else (args.runs, args.seconds)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="rlproxy-bench-shadow-") as tmp, ScriptedJudge(shout.reward) as judge:
        on = ["--shadow-samples", str(SHADOWS), "--shadow-judge-model", SCRIPTED_JUDGE_MODEL]
        on += ["--shadow-judge-api-base", judge.url]
        # Both gateways up at once (the idle one costs next to nothing), so their windows interleave.
        with gateway(Path(tmp) / "state-off", []) as off_url, gateway(Path(tmp) / "state-on", on) as on_url:
            rows += measure({"off": off_url, "on": on_url}, args.rate, runs, seconds)
    off = {row["rate"]: row for row in rows if row["shadows"] == "off"}
    print(
        f"\n{runs} window(s) x {seconds:g} s per row, medians over windows; local engine, tiny model, "
        f"trainer off, {SHADOWS} shadows per live call when on"
    )
    print(
        "| shadows | calls/s | live calls | p50 ms | p90 ms | p50 vs off | p90 vs off | shadow groups judged / window |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        base = off[row["rate"]]
        print(
            f"| {row['shadows']} | {row['rate']:g} | {row['calls']} | {row['p50_ms']:.1f} | {row['p90_ms']:.1f} "
            f"| {row['p50_ms'] / base['p50_ms']:.2f}x | {row['p90_ms'] / base['p90_ms']:.2f}x "
            f"| {row['judged_per_window']:g} |"
        )
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "shadow_latency.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
