"""`rlproxy demo --engine vllm`: the demo's loop through a real vLLM (its CPU build) that the
gateway starts and stops. Whether it learns through vLLM is tests/test_learning_vllm.py's job
(and docs/demo.md's table's); here, that it runs, reports the sampler/trainer mismatch per
step, and leaves no vLLM behind, ended or interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gateway.demo.options import demo_settings
from gateway.demo.processes import _settings_flags
from gateway.errors import ConfigError
from tests.helpers_real_vllm import vllm_python
from tests.test_demo import ROOT, run_demo

pytestmark = pytest.mark.timeout(900)

SMALL = ("--rollouts", "4", "--groups-per-step", "2", "--eval-groups", "1", "--max-tokens", "4", "--seed", "1")


def vllm_processes_of(out: Path) -> list[psutil.Process]:
    """Every process, orphans included, started for this demo's vLLM (its log is under OUT)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "environ"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            if "vllm" in cmdline and str(out) in cmdline + " ".join((proc.info["environ"] or {}).values()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def test_the_demo_runs_through_vllm_reports_the_mismatch_and_leaves_no_vllm(tmp_path):
    out = tmp_path / "demo"
    result = run_demo(out, "--engine", "vllm", "--vllm-python", vllm_python(), "--steps", "2", *SMALL, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engine"] == "vllm" and summary["final_step"] == 2
    assert summary["startup_seconds"] > 0  # vLLM's start, kept out of the demo's clock
    # Steps 0 and 1 sampled through vLLM and were trained on: the trainer's pi_old against the
    # behaviour logprobs vLLM recorded, to float error (both float32 on CPU).
    assert set(summary["mismatch_by_step"]) == {"0", "1"}
    assert all(0 <= m < 1e-3 for m in summary["mismatch_by_step"].values()), summary["mismatch_by_step"]
    assert "mismatch" in result.stdout  # shown on each step's line
    log = (out / "state" / "vllm.log").read_text()
    assert "--no-enable-chunked-prefill" in log and "POST /v1/load_lora_adapter" in log
    assert vllm_processes_of(out) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "kill"])
def test_an_interrupted_demo_leaves_no_vllm(tmp_path, signum):
    out = tmp_path / "demo"
    cmd = [
        sys.executable,
        "-m",
        "gateway.cli",
        "demo",
        "--out",
        str(out),
        "--engine",
        "vllm",
        "--vllm-python",
        vllm_python(),
        "--steps",
        "50",
        *SMALL,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 600
        while not ((out / "state" / "rlproxy.db").exists() and _steps(out) >= 1):  # training, through vLLM
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the demo never trained a step"
            time.sleep(0.5)
        assert vllm_processes_of(out), "vLLM should be running while the demo trains"
        proc.send_signal(signum)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    deadline = time.monotonic() + 30
    while vllm_processes_of(out) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert vllm_processes_of(out) == []


def _steps(out: Path) -> int:
    import sqlite3

    with sqlite3.connect(out / "state" / "rlproxy.db", timeout=5) as db:
        try:
            return db.execute("SELECT COUNT(*) FROM steps WHERE step > 0").fetchone()[0]
        except sqlite3.OperationalError:  # not created yet
            return 0


def test_the_demo_starts_its_own_vllm_on_a_port_of_its_own(tmp_path, monkeypatch):
    monkeypatch.delenv("RLPROXY_VLLM_PORT", raising=False)
    settings = demo_settings({"engine": "vllm"}, tmp_path)
    assert settings.vllm_port != 8001  # never the default a vLLM of the user's may hold
    assert demo_settings({"engine": "vllm", "vllm_port": 8123}, tmp_path).vllm_port == 8123
    with pytest.raises(ConfigError, match="drop --vllm-url"):
        demo_settings({"engine": "vllm", "vllm_url": "http://127.0.0.1:8000"}, tmp_path)
    with pytest.raises(ConfigError, match="--engine local .* or --engine vllm"):
        demo_settings({"engine": "openai", "upstream_url": "http://127.0.0.1:9"}, tmp_path)


def test_vllm_args_reach_the_trainer_whole(tmp_path):
    # `--vllm-arg --x` must stay one value on the trainer's command line, not a flag of its own.
    from gateway.cli import build_parser

    settings = demo_settings({"engine": "vllm", "vllm_arg": ["--max-model-len=1024", "--enforce-eager"]}, tmp_path)
    args = build_parser().parse_args(["train", *_settings_flags(settings)])
    assert args.vllm_arg == ["--max-model-len=1024", "--enforce-eager"]
