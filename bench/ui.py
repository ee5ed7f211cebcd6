"""Dashboard first-screen load time with 10,000 recorded sessions, in headless Chromium.

    python bench/ui.py [--sessions 10000] [--runs 5]

Fills a fresh store with SESSIONS sessions (groups of 8, two calls each with token ids and
logprobs, rewards, one training step per 32 groups), serves it with `rlproxy serve`'s app
(API key on), signs in once, then loads each page RUNS times and prints the median time
from navigation start to the page's first screen being built (`body[data-ready]`: every
JSON request answered and rendered). Target: under 1 s for each page.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.settings import Settings  # noqa: E402
from gateway.store import CallRecord  # noqa: E402
from gateway.store import rows as store_rows  # noqa: E402
from gateway.store.sqlite import SQLiteStore

KEY = "bench-key-4b9e2d7a1c"
GROUP_SIZE = 8


def fill(db: Path, sessions: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    store = SQLiteStore(db)
    groups = sessions // GROUP_SIZE
    steps = max(1, groups // 32)
    now = time.time() - sessions  # one session a second, ending now
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]

    def op(conn):
        for g in range(groups):
            group_id = f"g{g:06d}"
            step = g * steps // groups
            split = "val" if g % 10 == 0 else "train"
            for r in range(GROUP_SIZE):
                session_id = f"{group_id}-s{r}"
                t = now + g * GROUP_SIZE + r
                messages = [
                    {"role": "system", "content": "You are a helpful agent."},
                    {"role": "user", "content": f"Task {g}: find the answer."},
                ]
                for c in range(2):
                    ids = [rng.randrange(256) for _ in range(24)]
                    store_rows.insert_call(
                        conn,
                        CallRecord(
                            id=f"{session_id}-c{c}",
                            session_id=session_id,
                            group_id=group_id,
                            split=split,
                            model="agent",
                            served=f"agent@{step}",
                            step=step,
                            engine="local",
                            stream=False,
                            status="ok",
                            request={"model": "agent", "messages": messages, "tools": tools},
                            response={"choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * 24}}]},
                            latency_ms=12.0,
                            prompt_ids=list(range(64 + 30 * c)),
                            completion_ids=[ids],
                            behaviour_logprobs=[[-rng.random() for _ in ids]],
                            created_at=t + c * 0.1,
                        ),
                    )
                reward = min(1.0, max(0.0, rng.gauss(0.2 + 0.6 * step / steps, 0.15)))
                store_rows.set_reward(conn, session_id, reward, {"turns": 2.0})
            store_rows.close_group(conn, group_id, None)
        for step in range(steps + 1):
            trained = [f"g{g:06d}" for g in range(groups) if g * steps // groups == step - 1 and g % 10][:32]
            conn.execute(
                "INSERT INTO steps (model, step, path, metrics, groups, created_at) VALUES (?,?,?,?,?,?)",
                (
                    "agent",
                    step,
                    f"/ckpt/{step:04d}",
                    json.dumps(
                        {}
                        if step == 0
                        else {
                            "loss": 0.1 / step,
                            "kl": 0.01,
                            "grad_norm": 1.0,
                            "clip_fraction": 0.05,
                            "tokens": 4000,
                            "seconds": 3.0,
                        }
                    ),
                    json.dumps(trained),
                    now + step,
                ),
            )
            conn.executemany("UPDATE groups SET trained_step = ? WHERE id = ?", [(step, g) for g in trained])

    # Written straight into the file the store created, in one transaction: the store's API
    # records one call per transaction, which would take minutes for 10,000 sessions.
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        conn.execute("BEGIN")
        op(conn)
        conn.execute("COMMIT")
    finally:
        conn.close()
    counts = store.counts()
    asyncio.run(store.close())
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if args.sessions < GROUP_SIZE:
        parser.error(f"--sessions must be at least {GROUP_SIZE} (one group)")
    group = f"g{min(100, args.sessions // GROUP_SIZE // 2):06d}"  # g000100 as before, or one that exists

    from playwright.sync_api import sync_playwright

    from tests.browser import find_or_install_chromium
    from tests.fake_upstream import FakeUpstream
    from tests.helpers import ThreadServer

    chromium, why = find_or_install_chromium()
    if chromium is None:
        print(f"no Chromium: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        counts = fill(Path(tmp) / "rlproxy.db", args.sessions)
        print(f"filled {counts} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        from gateway.app import create_app

        with FakeUpstream() as upstream:
            settings = Settings(
                state_dir=Path(tmp),
                engine="openai",
                upstream_url=upstream.url,
                api_key=KEY,
                trainer="off",
                log_level="warning",
            )
            with ThreadServer(create_app(settings)) as server, sync_playwright() as p:
                browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"{server.url}/ui")  # the login form sets the cookie once
                page.fill("input[name=key]", KEY)
                page.click("button[type=submit]")
                page.wait_for_selector("body[data-ready='1']")
                rows = []
                for path in (
                    "/ui",
                    "/ui/sessions",
                    "/ui/groups",
                    "/ui/steps",
                    f"/ui/groups/{group}",
                    f"/ui/sessions/{group}-s0",
                ):
                    times = []
                    for _ in range(args.runs):
                        page.goto("about:blank")
                        t0 = time.perf_counter()
                        page.goto(server.url + path)
                        page.wait_for_selector("body[data-ready='1']", timeout=60_000)
                        times.append(time.perf_counter() - t0)
                    rows.append((path, statistics.median(times), max(times)))
                browser.close()
    print(f"\nfirst-screen load, {args.sessions:,} sessions, median of {args.runs} (headless Chromium, loopback)\n")
    print("| page | median | slowest | under 1 s |")
    print("| --- | --- | --- | --- |")
    for path, median, slowest in rows:
        print(f"| `{path}` | {median * 1000:.0f} ms | {slowest * 1000:.0f} ms | {'yes' if median < 1 else 'NO'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
