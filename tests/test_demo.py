"""`rlproxy demo` end to end, on a small budget: gateway, `rlproxy train` child, the SHOUT
agent over HTTP, summary.json and the reward curve. Whether it learns is
tests/test_learning.py's job (and docs/demo.md's runs'); here, that the whole loop runs and
reports what it promises."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.store.sqlite import SQLiteStore

ROOT = Path(__file__).resolve().parents[1]


def run_demo(out: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gateway.cli", "demo", "--out", str(out), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the trainer child dies with it (PR_SET_PDEATHSIG)
        stdout, stderr = proc.communicate()
        pytest.fail(f"rlproxy demo did not finish in {timeout} s:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def test_demo_runs_the_loop_and_writes_summary_and_curve(tmp_path):
    out = tmp_path / "demo"
    result = run_demo(
        out,
        "--steps",
        "2",
        "--rollouts",
        "4",
        "--groups-per-step",
        "2",
        "--eval-groups",
        "1",
        "--max-tokens",
        "4",
        "--seed",
        "1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "baseline reward" in result.stdout

    summary = json.loads((out / "summary.json").read_text())
    for key in (
        "baseline_reward",
        "final_reward",
        "reward_by_step",
        "seconds",
        "final_step",
        "aim",
        "settings",
        "demo",
        "task",
        "stopped_because",
    ):
        assert key in summary, key
    assert 0.0 <= summary["baseline_reward"] <= 1.0
    assert 0.0 <= summary["final_reward"] <= 1.0
    assert summary["final_step"] == 2  # two training steps landed and were hot-swapped in
    assert summary["stopped_because"] == "steps"
    assert {"0", "1"} <= set(summary["reward_by_step"])  # the rollouts each step sampled
    assert all(0.0 <= r <= 1.0 for r in summary["reward_by_step"].values())
    assert summary["seconds"] > 0
    assert summary["demo"]["steps"] == 2 and summary["demo"]["rollouts"] == 4
    assert summary["settings"]["groups_per_step"] == 2
    assert summary["settings"]["learning_rate"] == 1e-2  # the demo's tuning, not the serve default
    assert summary["task"] == "shout"  # the default task; every task writes the same keys
    assert (out / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "step 2" in (out / "trainer.log").read_text()
    # The held-out set: the same tasks for the baseline and the final score (the first and the
    # last val group), one per val rollout
    with sqlite3.connect(out / "state" / "rlproxy.db") as db:
        rows = db.execute("SELECT DISTINCT group_id FROM sessions WHERE group_id LIKE 'demo-val-%'")
        groups = sorted(group for (group,) in rows)
    store = SQLiteStore(out / "state" / "rlproxy.db")
    prompts = [
        [store.session_calls(f"{group}-r{i}")[0]["request"]["messages"][-1]["content"] for i in range(4)]
        for group in (groups[0], groups[-1])
    ]
    assert len(groups) == 2 and prompts[0] == prompts[1]


def test_demo_refuses_a_state_dir_with_checkpoints(tmp_path):
    state = tmp_path / "state"
    (state / "models" / "agent" / "checkpoints" / "0000").mkdir(parents=True)
    result = run_demo(tmp_path / "out", "--state-dir", str(state), timeout=60)
    assert result.returncode == 2
    assert "trains from scratch" in result.stderr
