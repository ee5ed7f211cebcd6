"""Soak: many concurrent streaming sessions against one gateway for a set time, with rewards,
group closes, a hot-swap and a RULER judgement along the way.

The gateway runs as `rlproxy serve --engine vllm` attached to the loopback stand-in for
vLLM (tests/fake_vllm.py, its own process), so adapters really load and the hot-swap is the
real one; the judge is the loopback judge of the RULER tests. Each of `--sessions` workers
runs rollouts back to back: `--calls` streamed chat completions, each naming its session
and call in its last message, then a reward, then a close of its group (`--group-size`
workers share a group per round). Half-way through, a step row and its adapter appear in
the store (what the trainer leaves) and the gateway hot-swaps to it; at a third, one
finished group is judged with RULER.

Every `--interval` seconds it prints the gateway's RSS, calls/s and errors; at the end, a
table and a check of the store against what the clients saw: every call a client saw
finish (`[DONE]`) is recorded under its session with the request it sent and the text it
got (nothing lost, nothing mixed), and every acknowledged reward is stored.

    python bench/soak.py --seconds 600                    # the run in bench/README.md
    python bench/soak.py --seconds 10 --sessions 20 --json out.json   # what tests/test_soak.py runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gateway.store.sqlite import SQLiteStore  # noqa: E402
from tests.helpers import free_port, stop_process  # noqa: E402
from tests.helpers_judge import FakeJudge  # noqa: E402
from tests.helpers_vllm import BASE, fake_vllm_process, make_adapter  # noqa: E402

JUDGE_KEY = "sk-soak-judge"


@dataclass
class Seen:
    """What the clients saw: finished calls, acknowledged rewards, errors."""

    calls: dict[str, tuple[str, str, str]] = field(default_factory=dict)  # request id -> (session, sent, text)
    rewards: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    steps: set[str] = field(default_factory=set)  # X-Model-Step values seen
    finished: int = 0  # calls finished so far (for calls/s)
    ruler: dict | None = None


async def stream_call(
    http: aiohttp.ClientSession, url: str, session_id: str, group_id: str, text: str, seen: Seen
) -> None:
    body = {
        "model": "agent",
        "stream": True,
        "max_tokens": 16,
        "messages": [{"role": "system", "content": "You are a soak test."}, {"role": "user", "content": text}],
    }
    headers = {"X-Session-Id": session_id, "X-Group-Id": group_id}
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as reply:
        if reply.status != 200:
            seen.errors.append(f"chat {reply.status}: {(await reply.text())[:200]}")
            return
        parts, done = [], False
        async for raw in reply.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                done = True
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                seen.errors.append(f"stream error: {chunk['error']['message'][:200]}")
                return
            for choice in chunk.get("choices") or []:
                parts.append((choice.get("delta") or {}).get("content") or "")
        if not done:
            seen.errors.append("stream ended without [DONE]")
            return
        seen.calls[reply.headers["X-Request-Id"]] = (session_id, text, "".join(parts))
        seen.steps.add(reply.headers.get("X-Model-Step", "base"))
        seen.finished += 1


async def worker(
    index: int, http: aiohttp.ClientSession, url: str, args, seen: Seen, stop: asyncio.Event, finished_groups: list[str]
) -> None:
    rng = random.Random(index)
    slot = index // args.group_size
    rollout = 0
    while not stop.is_set():
        group_id = f"soak-g{slot}-r{rollout}"
        session_id = f"soak-s{index}-r{rollout}"
        try:
            for call in range(args.calls):
                await stream_call(http, url, session_id, group_id, f"session {session_id} call {call}", seen)
            reward = round(rng.random(), 3)
            async with http.post(f"{url}/v1/sessions/{session_id}/reward", json={"reward": reward}) as reply:
                if reply.status == 200:
                    seen.rewards[session_id] = reward
                else:
                    seen.errors.append(f"reward {reply.status}: {(await reply.text())[:200]}")
            async with http.post(
                f"{url}/v1/groups/{group_id}/close", json={"expected_sessions": args.group_size}
            ) as reply:
                if reply.status != 200:
                    seen.errors.append(f"close {reply.status}: {(await reply.text())[:200]}")
                elif (await reply.json())["ready"]:
                    finished_groups.append(group_id)
        except (TimeoutError, aiohttp.ClientError) as exc:
            seen.errors.append(f"{type(exc).__name__}: {exc}")
        rollout += 1


async def hot_swap(db_path: Path, checkpoints: Path, url: str, http: aiohttp.ClientSession) -> float:
    """Leave what the trainer leaves for step 1 (adapter files, then the step row) and wait
    until the gateway serves it; return the seconds that took."""
    started = time.monotonic()
    path = make_adapter(checkpoints, "0001")
    store = SQLiteStore(db_path)
    try:
        store.insert_step("agent", 1, str(path), {"soak": 1.0}, [])
    finally:
        await store.close()
    while time.monotonic() - started < 60:
        async with http.get(url + "/healthz") as reply:
            if (await reply.json()).get("step") == 1:
                return time.monotonic() - started
        await asyncio.sleep(0.1)
    raise RuntimeError("the gateway did not hot-swap to step 1 within 60 s")


async def judge_once(
    http: aiohttp.ClientSession, url: str, judge_url: str, finished_groups: list[str], seen: Seen
) -> None:
    while not finished_groups:
        await asyncio.sleep(0.1)
    group_id = finished_groups[0]
    body = {"judge_model": "openai/soak-judge", "judge_api_base": judge_url}
    async with http.post(
        f"{url}/v1/groups/{group_id}/ruler", json=body, timeout=aiohttp.ClientTimeout(total=300)
    ) as reply:
        data = await reply.json()
        if reply.status != 200:
            seen.errors.append(f"ruler {reply.status}: {data}")
            return
    seen.ruler = {"group_id": group_id, "scores": {s["session_id"]: s["score"] for s in data["scores"]}}


async def drive(url: str, pid: int, db_path: Path, checkpoints: Path, judge_url: str, args) -> tuple[list, Seen, dict]:
    seen, stop, finished_groups = Seen(), asyncio.Event(), []
    process = psutil.Process(pid)
    rows: list[dict] = []
    events: dict = {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:
        workers = [
            asyncio.create_task(worker(i, http, url, args, seen, stop, finished_groups)) for i in range(args.sessions)
        ]
        started = time.monotonic()
        last_t, last_calls, last_errors = started, 0, 0
        swap_at, judge_at = args.seconds / 2, args.seconds / 3
        side_tasks: dict[str, asyncio.Task] = {}
        print(f"{'t (s)':>6} {'RSS (MB)':>9} {'calls/s':>8} {'errors':>7}", flush=True)
        while (now := time.monotonic()) - started < args.seconds:
            await asyncio.sleep(min(args.interval, args.seconds - (now - started)))
            now = time.monotonic()
            if now - started >= judge_at and "ruler" not in side_tasks:
                side_tasks["ruler"] = asyncio.create_task(judge_once(http, url, judge_url, finished_groups, seen))
            if now - started >= swap_at and "swap" not in side_tasks:
                side_tasks["swap"] = asyncio.create_task(hot_swap(db_path, checkpoints, url, http))
            row = {
                "t": round(now - started),
                "rss_mb": round(process.memory_info().rss / 2**20, 1),
                "calls_per_s": round((seen.finished - last_calls) / (now - last_t), 1),
                "errors": len(seen.errors) - last_errors,
            }
            rows.append(row)
            print(f"{row['t']:>6} {row['rss_mb']:>9} {row['calls_per_s']:>8} {row['errors']:>7}", flush=True)
            last_t, last_calls, last_errors = now, seen.finished, len(seen.errors)
        stop.set()
        await asyncio.gather(*workers)
        for name, task in side_tasks.items():
            try:
                result = await task
                if name == "swap":
                    events["hot_swap_seconds"] = round(result, 2)
            except Exception as exc:  # noqa: BLE001 - reported, not raised
                seen.errors.append(f"{name}: {exc}")
        events["seconds"] = round(time.monotonic() - started, 1)
    return rows, seen, events


def check_store(db_path: Path, seen: Seen) -> dict:
    """Every call a client saw finish is recorded as it saw it; every acknowledged reward is stored."""
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        rows = {row[0]: row[1:] for row in db.execute("SELECT id, session_id, status, request, response FROM calls")}
        rewards = dict(db.execute("SELECT id, reward FROM sessions"))
    finally:
        db.close()
    lost, mixed = [], []
    for request_id, (session_id, sent, text) in seen.calls.items():
        row = rows.get(request_id)
        if row is None:
            lost.append(request_id)
            continue
        stored_session, status, request, response = row
        stored_sent = json.loads(request)["messages"][-1]["content"]
        stored_text = (json.loads(response or "{}").get("choices") or [{}])[0].get("message", {}).get("content")
        if (stored_session, status, stored_sent, stored_text or "") != (session_id, "ok", sent, text):
            mixed.append(request_id)
    lost_rewards = [s for s, r in seen.rewards.items() if rewards.get(s) is None]
    if seen.ruler:
        # RULER's scores replaced the rewards of the group it judged.
        lost_rewards = [s for s in lost_rewards if s not in seen.ruler["scores"]]
    wrong_rewards = [
        s
        for s, r in seen.rewards.items()
        if rewards.get(s) is not None and abs(rewards[s] - r) > 1e-9 and not (seen.ruler and s in seen.ruler["scores"])
    ]
    return {
        "calls_acknowledged": len(seen.calls),
        "calls_recorded": len(rows),
        "calls_lost": len(lost),
        "calls_mixed": len(mixed),
        "rewards_acknowledged": len(seen.rewards),
        "rewards_lost": len(lost_rewards),
        "rewards_wrong": len(wrong_rewards),
    }


class Gateway:
    """`rlproxy serve ARGS` as a child process, its output in a log file (a pipe nobody reads
    would fill up over a long run and stall it)."""

    def __init__(self, args: list[str], log_path: Path, env: dict):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "ab")
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def __enter__(self) -> Gateway:
        import httpx

        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the gateway exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not become healthy in 120 s")
            time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        stop_process(self.proc)
        self.log.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0, help="how long to run")
    parser.add_argument("--sessions", type=int, default=200, help="concurrent streaming sessions")
    parser.add_argument("--calls", type=int, default=3, help="calls per session (rollout)")
    parser.add_argument("--group-size", type=int, default=4, help="sessions per group")
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between report lines")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="rlproxy-soak-") as tmp, FakeJudge() as judge:
        state = Path(tmp) / "state"
        with fake_vllm_process(free_port(), sleep_mode=False) as vllm_url:
            gateway_args = [
                "--engine",
                "vllm",
                "--vllm-url",
                vllm_url + "/v1",
                "--base-model",
                BASE,
                "--gpu-mode",
                "dedicated",
                "--trainer",
                "off",
                "--state-dir",
                str(state),
                "--log-level",
                "warning",
                "--poll-interval",
                "0.5",
                "--judge-model",  # the only judge RULER may call here
                "openai/soak-judge",
                "--judge-api-base",
                judge.url,
            ]
            with Gateway(gateway_args, Path(tmp) / "gateway.log", {"RLPROXY_JUDGE_API_KEY": JUDGE_KEY}) as gw:
                checkpoints = state / "models" / "agent" / "checkpoints"
                rows, seen, events = asyncio.run(
                    drive(gw.url, gw.proc.pid, state / "rlproxy.db", checkpoints, judge.url, args)
                )
        checks = check_store(state / "rlproxy.db", seen)
    warm = [r["rss_mb"] for r in rows[len(rows) // 5 :]] or [0.0]  # after the first fifth: warmed up
    summary = {
        "sessions": args.sessions,
        "seconds": events["seconds"],
        "calls_per_s": round(len(seen.calls) / max(events["seconds"], 1e-9), 1),
        "errors": len(seen.errors),
        "error_examples": seen.errors[:5],
        "rss_mb_first": rows[0]["rss_mb"] if rows else None,
        "rss_mb_warm_min": min(warm),
        "rss_mb_warm_max": max(warm),
        "rss_mb_last": rows[-1]["rss_mb"] if rows else None,
        "steps_served": sorted(seen.steps),
        "hot_swap_seconds": events.get("hot_swap_seconds"),
        "ruler_scored": len(seen.ruler["scores"]) if seen.ruler else 0,
        **checks,
    }
    print()
    print("| " + " | ".join(summary_keys := [k for k in summary if k != "error_examples"]) + " |")
    print("|" + "---|" * len(summary_keys))
    print("| " + " | ".join(str(summary[k]) for k in summary_keys) + " |")
    if seen.errors:
        print("errors, first ones:", *seen.errors[:5], sep="\n  ")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))
    ok = not seen.errors and not checks["calls_lost"] and not checks["calls_mixed"] and not checks["rewards_lost"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
