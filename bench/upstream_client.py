"""CPU per request of the two HTTP clients the openai engine could relay a chat completion
with: aiohttp's session (as the engine configured it before) and `gateway.engines.http1`'s
pool (what it uses for whole-body requests now), against the bench's loopback upstream.

    python bench/upstream_client.py               # 5 runs x 3,000 requests per client
    python bench/upstream_client.py --runs 9 --requests 5000

One request at a time, one keep-alive connection, uvloop; the figure is this process's CPU
(user + system) per request, so the upstream's own work is not in it. Clients alternate
run by run, so a noisy neighbour hits both alike. Prints a table: median and spread over
the runs, and the pool's share of aiohttp's cost.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.engines.http1 import HTTP1Pool  # noqa: E402

BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16})
HEADERS = {"Content-Type": "application/json", "Accept": "application/json", "Authorization": "Bearer sk-bench"}


async def aiohttp_cpu(base_url: str, requests: int) -> float:
    connector = aiohttp.TCPConnector(limit=512, limit_per_host=0, keepalive_timeout=60, ttl_dns_cache=300)
    async with aiohttp.ClientSession(
        connector=connector, cookie_jar=aiohttp.DummyCookieJar(), skip_auto_headers=("User-Agent",)
    ) as session:
        url, timeout = base_url + "/chat/completions", aiohttp.ClientTimeout(total=600)

        async def one() -> bytes:
            async with session.post(url, data=BODY, headers=HEADERS, timeout=timeout) as resp:
                return await resp.read()

        return await _timed(one, requests)


async def pool_cpu(base_url: str, requests: int) -> float:
    pool = HTTP1Pool(base_url, HEADERS)
    head = pool.head("POST", "/chat/completions")

    async def one() -> bytes:
        return (await pool.exchange(head, BODY, timeout=600)).body

    try:
        return await _timed(one, requests)
    finally:
        await pool.close()


async def _timed(one, requests: int) -> float:
    for _ in range(200):  # warm: connection made, code paths hot
        assert b"choices" in await one()
    started = time.process_time()
    for _ in range(requests):
        await one()
    return (time.process_time() - started) / requests * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    upstream = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "fake_upstream.py"), "--port", "0"], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(upstream.stdout.readline().split()[-1])
        base_url = f"http://127.0.0.1:{port}/v1"
        results: dict[str, list[float]] = {"aiohttp": [], "http1 pool": []}
        for run in range(args.runs):
            results["aiohttp"].append(uvloop.run(aiohttp_cpu(base_url, args.requests)))
            results["http1 pool"].append(uvloop.run(pool_cpu(base_url, args.requests)))
            print(
                f"  run {run + 1}/{args.runs}: aiohttp {results['aiohttp'][-1]:.1f} us, "
                f"pool {results['http1 pool'][-1]:.1f} us",
                file=sys.stderr,
            )
    finally:
        upstream.kill()
        upstream.wait()
    print(f"\n{'client':<12} {'cpu us/request':>15} {'min':>8} {'max':>8}")
    for name, values in results.items():
        print(f"{name:<12} {statistics.median(values):>15.1f} {min(values):>8.1f} {max(values):>8.1f}")
    ratio = statistics.median(results["http1 pool"]) / statistics.median(results["aiohttp"])
    print(f"\npool / aiohttp: {ratio:.2f} of the CPU per request ({args.runs} runs x {args.requests} requests)")


if __name__ == "__main__":
    main()
