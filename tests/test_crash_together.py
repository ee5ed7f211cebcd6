"""Gateway and trainer SIGKILLed at the same moment, mid-step, under traffic, then restarted:
no acknowledged call or reward is lost, no step is written twice, no group is trained twice,
and a half-written checkpoint is ignored.

`rlproxy serve --trainer auto` runs the trainer in the gateway's process group, so one
`killpg` kills both at once. The trainer's test hook (`RLPROXY_TEST_PAUSE_AT`, see
tests/test_trainer_restart.py) holds it at a known point of a step while agents keep calling:
first while training step 1 (its groups read, nothing saved), then between a checkpoint's
rename and its step row. A third start runs to the end.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import free_port, stop_process

ROOT = Path(__file__).resolve().parents[1]
TRAIN_FLAGS = [
    "--groups-per-step",
    "2",
    "--poll-interval",
    "0.05",
    "--lora-rank",
    "4",
    "--lora-alpha",
    "8",
    "--learning-rate",
    "0.01",
    "--max-tokens-per-row",
    "256",
    "--default-max-tokens",
    "6",
]


class Acked:
    """What the gateway acknowledged to the agents, across all runs."""

    def __init__(self) -> None:
        self.calls: dict[str, str] = {}  # request id -> session
        self.rewards: dict[str, float] = {}
        self.closed: set[str] = set()
        self.lock = threading.Lock()
        self.next_group = 0


class Gateway:
    """`rlproxy serve` (local tiny model, trainer beside it) whose output is watched for the
    trainer's pause line."""

    def __init__(self, state: Path, pause_at: str | None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "RLPROXY_TORCH_THREADS": "1", "PYTHONPATH": str(ROOT)}
        env.pop("RLPROXY_TEST_PAUSE_AT", None)
        if pause_at:
            env.update(RLPROXY_TEST_PAUSE_AT=pause_at, RLPROXY_TEST_PAUSE_SECONDS="300")
        cmd = [
            sys.executable,
            "-m",
            "gateway.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--state-dir",
            str(state),
            "--log-level",
            "info",
            *TRAIN_FLAGS,
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, text=True
        )
        self.lines: list[str] = []
        self.paused = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("rlproxy-test-pause:"):
                self.paused.set()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "".join(self.lines)[-4000:]
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError("gateway not healthy:\n" + "".join(self.lines)[-4000:])

    def kill_together(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)  # gateway and trainer, the same instant
        self.proc.wait(timeout=30)
        self.reader.join(timeout=30)

    def stop(self) -> None:
        stop_process(self.proc, timeout=60)
        self.reader.join(timeout=30)


def run_agents(url: str, acked: Acked, stop: threading.Event, workers: int = 3) -> list[threading.Thread]:
    """Agents running groups of two rollouts (rewards 0 and 1, so every group has spread)."""

    def agent() -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            while not stop.is_set():
                with acked.lock:
                    group = f"g{acked.next_group}"
                    acked.next_group += 1
                try:
                    for index, reward in enumerate((0.0, 1.0)):
                        session = f"{group}-s{index}"
                        headers = {"X-Session-Id": session, "X-Group-Id": group}
                        for turn in range(2):
                            body = {
                                "model": "agent",
                                "max_tokens": 6,
                                "stream": turn == 1,
                                "messages": [{"role": "user", "content": f"{session} turn {turn}"}],
                            }
                            reply = http.post("/v1/chat/completions", json=body, headers=headers)
                            if reply.status_code != 200 or (turn == 1 and "data: [DONE]" not in reply.text):
                                return
                            with acked.lock:
                                acked.calls[reply.headers["x-request-id"]] = session
                        if http.post(f"/v1/sessions/{session}/reward", json={"reward": reward}).status_code != 200:
                            return
                        with acked.lock:
                            acked.rewards[session] = reward
                    if http.post(f"/v1/groups/{group}/close", json={}).status_code != 200:
                        return
                    with acked.lock:
                        acked.closed.add(group)
                except httpx.HTTPError:
                    return  # the gateway is gone

    threads = [threading.Thread(target=agent, daemon=True) for _ in range(workers)]
    for thread in threads:
        thread.start()
    return threads


def crash_at(state: Path, phase: str, acked: Acked) -> str:
    gateway = Gateway(state, pause_at=phase)
    stop = threading.Event()
    try:
        gateway.wait_healthy()
        agents = run_agents(gateway.url, acked, stop)
        assert gateway.paused.wait(240), "the trainer never paused:\n" + "".join(gateway.lines)[-4000:]
        time.sleep(0.5)  # traffic keeps flowing while the step is half done
        assert any(t.is_alive() for t in agents), "agents stopped before the kill"
        gateway.kill_together()
        stop.set()
        for thread in agents:
            thread.join(timeout=60)
        return "".join(gateway.lines)
    finally:
        stop.set()
        stop_process(gateway.proc)


def _db(state: Path) -> sqlite3.Connection:
    return sqlite3.connect(state / "rlproxy.db")


@pytest.mark.timeout(900)
def test_gateway_and_trainer_killed_together_lose_nothing_and_train_nothing_twice(tmp_path):
    state = tmp_path / "state"
    checkpoints = state / "models" / "agent" / "checkpoints"
    acked = Acked()

    log = crash_at(state, "train", acked)  # 1. mid-step: groups read, update done, nothing saved
    assert "rlproxy-test-pause: train step 1" in log
    with _db(state) as db:
        assert [r[0] for r in db.execute("SELECT step FROM steps ORDER BY step")] == [0]

    log = crash_at(state, "record", acked)  # 2. checkpoint renamed into place, no step row yet
    assert "rlproxy-test-pause: record step 1" in log
    assert (checkpoints / "0001" / "trainer_state.json").is_file()
    # 3. A save killed half-way leaves a hidden temporary directory: it must never become a step.
    partial = checkpoints / ".tmp-0002-99999"
    partial.mkdir()
    (partial / "adapter_config.json").write_text("{")

    gateway = Gateway(state, pause_at=None)
    stop = threading.Event()
    try:
        gateway.wait_healthy()
        agents = run_agents(gateway.url, acked, stop, workers=2)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # until a step trained after the restarts and is served
            with _db(state) as db:
                top = db.execute("SELECT MAX(step) FROM steps").fetchone()[0]
            if top is not None and top >= 2 and httpx.get(gateway.url + "/healthz").json()["step"] == top:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("no step after the restarts:\n" + "".join(gateway.lines)[-4000:])
        stop.set()
        for thread in agents:
            thread.join(timeout=60)
        httpx.post(gateway.url + "/v1/training/trigger", json={})
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # every closed, rewarded group trained (or skipped)
            with _db(state) as db:
                left = db.execute(
                    "SELECT COUNT(*) FROM groups WHERE closed = 1 AND trained_step IS NULL AND skipped IS NULL"
                ).fetchone()[0]
            if left == 0:
                break
            httpx.post(gateway.url + "/v1/training/trigger", json={})
            time.sleep(0.5)
        gateway.stop()
    finally:
        stop.set()
        stop_process(gateway.proc)

    with _db(state) as db:
        calls = dict(db.execute("SELECT id, session_id FROM calls WHERE status = 'ok'"))
        rewards = dict(db.execute("SELECT id, reward FROM sessions"))
        steps = db.execute("SELECT step, path, groups FROM steps ORDER BY step").fetchall()
        trained = dict(db.execute("SELECT id, trained_step FROM groups"))
        left = db.execute(
            "SELECT id FROM groups WHERE closed = 1 AND trained_step IS NULL AND skipped IS NULL"
        ).fetchall()

    # No acknowledged call or reward lost, across two kills.
    assert len(acked.calls) > 20 and len(acked.rewards) > 10
    lost = {rid: s for rid, s in acked.calls.items() if calls.get(rid) != s}
    assert not lost, f"{len(lost)} acknowledged calls lost or misfiled"
    assert all(rewards.get(s) == r for s, r in acked.rewards.items())

    # Steps: 0..N, each once, each with its own complete checkpoint; the partial save ignored.
    numbers = [s[0] for s in steps]
    assert numbers == list(range(len(numbers))) and len(numbers) >= 3
    assert all(
        Path(path) == checkpoints / f"{n:04d}" and Path(path, "adapter_model.safetensors").is_file()
        for n, path, _ in steps
    )
    assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) == [f"{n:04d}" for n in numbers]
    assert not any(".tmp" in path for _, path, _ in steps)

    # No group trained twice: each in one step's list, and that step is its trained_step.
    listed = [g for _, _, groups in steps for g in json.loads(groups)]
    assert len(listed) == len(set(listed))
    assert all(trained[g] == n for n, _, groups in steps for g in json.loads(groups))
    assert {g for g, step in trained.items() if step is not None} == set(listed)
    assert not left, f"closed groups never trained: {left}"
