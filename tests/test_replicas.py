"""Two gateway processes and a trainer process, each with its own state dir, on one PostgreSQL
(no shared filesystem): sessions alternate between replicas, a trained step reaches both,
and a replica killed (SIGKILL) under load loses no acknowledged call."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psycopg
import pytest

from tests.helpers import gateway_process, stop_process

ROOT = Path(__file__).resolve().parents[1]


def _gateway_args(url: str, state_dir: Path) -> list[str]:
    return [
        "--engine",
        "local",
        "--store",
        url,
        "--state-dir",
        str(state_dir),
        "--trainer",
        "off",
        "--poll-interval",
        "0.2",
        "--log-level",
        "warning",
    ]


def _chat(http: httpx.Client, base: str, session: str, group: str, text: str, request_id: str) -> dict:
    reply = http.post(
        base + "/v1/chat/completions",
        json={"model": "agent", "max_tokens": 4, "messages": [{"role": "user", "content": text}]},
        headers={"X-Session-Id": session, "X-Group-Id": group, "X-Request-Id": request_id},
    )
    assert reply.status_code == 200, reply.text
    return reply.json()


def _served(http: httpx.Client, base: str) -> set[str]:
    return {m["id"] for m in http.get(base + "/v1/models").json()["data"]}


def _drive(base: str, worker: int, completed: list[str], stop: threading.Event) -> None:
    with httpx.Client(timeout=60) as http:
        for n in range(100_000):
            if stop.is_set():
                return
            request_id = f"load-{worker}-{n}"
            try:
                reply = http.post(
                    base + "/v1/chat/completions",
                    json={
                        "model": "agent",
                        "max_tokens": 2,
                        "messages": [{"role": "user", "content": f"{worker} {n}"}],
                    },
                    headers={"X-Session-Id": f"load-{worker}", "X-Request-Id": request_id},
                )
            except httpx.HTTPError:
                return  # the replica is gone
            if reply.status_code == 200:
                completed.append(request_id)


@pytest.mark.timeout(900)
def test_two_replicas_and_a_trainer_share_one_postgres(tmp_path, postgres_db):
    url = postgres_db
    with (
        gateway_process(_gateway_args(url, tmp_path / "a")) as (proc_a, a),
        gateway_process(_gateway_args(url, tmp_path / "b")) as (proc_b, b),
        httpx.Client(timeout=120) as http,
    ):
        # Sessions whose calls alternate between the replicas form single trajectories.
        for k, reward in enumerate((1.0, 0.0)):
            session = f"s{k}"
            for n in range(4):
                _chat(http, (a, b)[n % 2], session, "g1", f"session {k} turn {n}", f"{session}-{n}")
            assert http.post((b, a)[k] + f"/v1/sessions/{session}/reward", json={"reward": reward}).status_code == 200
        for base in (a, b):
            for k in range(2):
                body = http.get(base + f"/v1/sessions/s{k}").json()
                assert [c["request"]["messages"][0]["content"] for c in body["calls"]] == [
                    f"session {k} turn {n}" for n in range(4)
                ]
        assert http.post(a + "/v1/groups/g1/close", json={}).status_code == 200
        group = http.get(b + "/v1/groups/g1").json()
        assert group["ready"] and group["n_sessions"] == 2

        # A trainer on its own state dir trains one step; it reaches both replicas through the store.
        trainer = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "train",
                "--store",
                url,
                "--state-dir",
                str(tmp_path / "t"),
                "--groups-per-step",
                "1",
                "--max-steps",
                "1",
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            output, _ = trainer.communicate(timeout=600)
        finally:
            stop_process(trainer)
        assert trainer.returncode == 0, output.decode(errors="replace")[-3000:]
        assert [s["step"] for s in http.get(a + "/v1/training/steps").json()["data"]][-1] == 1
        for base, state in ((a, tmp_path / "a"), (b, tmp_path / "b")):
            deadline = time.monotonic() + 120
            while "agent@1" not in _served(http, base) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert "agent@1" in _served(http, base)
            fetched = state / "models" / "agent" / "store" / "0001"
            assert (fetched / "adapter_model.safetensors").is_file()  # fetched into its own models dir
            assert not (state / "models" / "agent" / "checkpoints").exists()  # no trainer files here
            reply = _chat(http, base, "after", "g2", "hello", f"after-{base[-5:]}")
            assert reply["model"].startswith("agent")

        # A trainer on a new machine (an empty state dir) resumes from the checkpoint in the store.
        for k, reward in enumerate((0.0, 1.0)):
            _chat(http, (a, b)[k], f"m{k}", "g3", f"moved {k}", f"m{k}-0")
            assert http.post((a, b)[k] + f"/v1/sessions/m{k}/reward", json={"reward": reward}).status_code == 200
        assert http.post(b + "/v1/groups/g3/close", json={}).status_code == 200
        moved = subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "train",
                "--store",
                url,
                "--state-dir",
                str(tmp_path / "t2"),
                "--groups-per-step",
                "1",
                "--max-steps",
                "1",
                "--log-level",
                "info",
            ],
            cwd=ROOT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            capture_output=True,
            timeout=600,
        )
        log = moved.stdout.decode(errors="replace") + moved.stderr.decode(errors="replace")
        assert moved.returncode == 0, log[-3000:]
        assert "checkpoint fetched from the store" in log
        assert [s["step"] for s in http.get(b + "/v1/training/steps").json()["data"]][-1] == 2
        assert http.get(a + "/v1/groups/g3").json()["trained_step"] == 2

        # A replica killed under load loses no acknowledged call.
        completed: list[str] = []
        stop = threading.Event()
        workers = [threading.Thread(target=_drive, args=(a, w, completed, stop)) for w in range(4)]
        for thread in workers:
            thread.start()
        deadline = time.monotonic() + 300
        while len(completed) < 20 and time.monotonic() < deadline and proc_a.poll() is None:
            time.sleep(0.01)
        os.killpg(proc_a.pid, signal.SIGKILL)
        proc_a.wait(timeout=30)
        stop.set()
        for thread in workers:
            thread.join(timeout=120)
        acknowledged = list(completed)
        assert len(acknowledged) >= 20
        with psycopg.connect(url) as conn:
            stored = {row[0] for row in conn.execute("SELECT client_request_id FROM calls")}
        missing = [rid for rid in acknowledged if rid not in stored]
        assert not missing, f"{len(missing)} acknowledged calls lost, e.g. {missing[:5]}"
        # The other replica still serves, and sees what the dead one recorded.
        assert http.get(b + "/v1/sessions/load-0").json()["n_calls"] >= 1
