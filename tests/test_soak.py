"""A short run of bench/soak.py: concurrent streaming sessions with rewards, closes, a
hot-swap and a RULER judgement; nothing a client saw finish is lost or mixed up in the store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_short_soak_loses_and_mixes_nothing(tmp_path):
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "soak.py"),
            "--seconds",
            "8",
            "--sessions",
            "16",
            "--interval",
            "2",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert summary["errors"] == 0, summary["error_examples"]
    assert summary["calls_acknowledged"] > 0 and summary["rewards_acknowledged"] > 0
    assert summary["calls_lost"] == 0 and summary["calls_mixed"] == 0
    assert summary["rewards_lost"] == 0 and summary["rewards_wrong"] == 0
    assert summary["calls_recorded"] >= summary["calls_acknowledged"]
    assert "1" in summary["steps_served"]  # the hot-swap happened under load
    assert summary["ruler_scored"] > 0  # and a group was judged
    assert len(json.loads(out.read_text())["rows"]) >= 3  # memory and rate over time
