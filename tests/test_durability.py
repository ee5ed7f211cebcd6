"""A call the client saw finish survives the gateway being killed (SIGKILL) mid-load."""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
import time

import httpx
import pytest

from tests.fake_upstream import FakeUpstream
from tests.helpers import gateway_process

WORKERS = 6
KILL_AFTER = 60  # completed calls before the kill


def _drive(base_url: str, worker: int, completed: list[str], attempted: list[str], stop: threading.Event) -> None:
    """Alternate plain and streamed calls until the gateway dies; note each call whose answer arrived whole."""
    with httpx.Client(base_url=base_url, timeout=30) as http:
        for n in range(100_000):
            if stop.is_set():
                return
            request_id = f"dur-{worker}-{n}"
            stream = n % 2 == 1
            body = {
                "model": "fake-model",
                "stream": stream,
                "messages": [{"role": "user", "content": f"worker {worker} call {n}"}],
            }
            headers = {"X-Request-Id": request_id, "X-Session-Id": f"dur-{worker}"}
            attempted.append(request_id)
            try:
                if stream:
                    with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as reply:
                        if reply.status_code != 200:
                            return
                        if any(line == "data: [DONE]" for line in reply.iter_lines()):
                            completed.append(request_id)
                else:
                    reply = http.post("/v1/chat/completions", json=body, headers=headers)
                    if reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]:
                        completed.append(request_id)
            except (httpx.HTTPError, ValueError):
                return  # the gateway is gone


@pytest.mark.timeout(240)
def test_every_acknowledged_call_survives_sigkill(tmp_path):
    state_dir = tmp_path / "state"
    completed: list[str] = []
    attempted: list[str] = []
    stop = threading.Event()
    with FakeUpstream(record=False) as upstream:
        args = [
            "--engine",
            "openai",
            "--upstream-url",
            upstream.url,
            "--state-dir",
            str(state_dir),
            "--trainer",
            "off",
            "--log-level",
            "warning",
        ]
        with gateway_process(args) as (proc, url):
            workers = [
                threading.Thread(target=_drive, args=(url, w, completed, attempted, stop)) for w in range(WORKERS)
            ]
            for thread in workers:
                thread.start()
            deadline = time.monotonic() + 120
            while len(completed) < KILL_AFTER and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.01)
            os.killpg(proc.pid, signal.SIGKILL)  # mid-load: requests are in flight right now
            proc.wait(timeout=30)
            stop.set()
            for thread in workers:
                thread.join(timeout=60)
    acknowledged = list(completed)
    assert len(acknowledged) >= KILL_AFTER, f"only {len(acknowledged)} calls completed before the kill"
    assert len(attempted) > len(acknowledged)  # the kill did catch calls in flight

    db = sqlite3.connect(state_dir / "rlproxy.db")  # recovers the WAL the killed writer left
    try:
        rows = dict(db.execute("SELECT client_request_id, status FROM calls").fetchall())
    finally:
        db.close()
    missing = [rid for rid in acknowledged if rid not in rows]
    assert not missing, f"{len(missing)} acknowledged calls lost, e.g. {missing[:5]}"
    assert all(rows[rid] == "ok" for rid in acknowledged)
    # Every stored row is a call somebody asked for (nothing invented while dying).
    assert set(rows) <= set(attempted)
