"""`--report-to`: step metrics and settings reach a tracker, and a tracker never stops training.

The wandb tests use the real SDK in offline mode and read back the run file it wrote."""

from __future__ import annotations

import logging
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.settings import Settings
from tests.wandb_records import config, history
from trainer.reporting import Reporter, step_metrics

CURVE = [  # the store's reward curve: rollouts sampled per step and split
    {"split": "train", "step": 0, "n": 8, "mean": 0.25, "std": 0.1, "min": 0.0, "max": 0.5},
    {"split": "val", "step": 0, "n": 4, "mean": 0.2, "std": 0.05, "min": 0.1, "max": 0.3},
    {"split": "train", "step": 1, "n": 8, "mean": 0.75, "std": 0.2, "min": 0.5, "max": 1.0},
]


class CurveStore:
    def reward_curve(self, model):
        assert model == "agent"
        return CURVE


def test_step_metrics_by_hand():
    metrics = {
        "loss": 0.5,
        "kl": None,
        "clip_fraction": 0.125,
        "grad_norm": float("nan"),
        "tokens": 300,
        "mismatch_logprob_abs": 0.01,
        "reward_mean": 0.3,
        "done": True,
    }
    out = step_metrics(1, metrics, CURVE)
    # Step 1's update started from the policy of step 0: its sampled rollouts are step 0's.
    assert out == {
        "train/loss": 0.5,
        "train/clip_fraction": 0.125,
        "train/tokens": 300.0,
        "train/mismatch_logprob_abs": 0.01,
        "train/reward_mean": 0.3,
        "train/sampled_reward_mean": 0.25,
        "train/sampled_reward_std": 0.1,
        "train/sampled_reward_min": 0.0,
        "train/sampled_reward_max": 0.5,
        "train/sampled_rollouts": 8.0,
        "val/sampled_reward_mean": 0.2,
        "val/sampled_reward_std": 0.05,
        "val/sampled_reward_min": 0.1,
        "val/sampled_reward_max": 0.3,
        "val/sampled_rollouts": 4.0,
    }


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is in the dev extra: pip install -e '.[dev]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_wandb_offline_gets_every_step_and_the_settings(offline_wandb, caplog):
    settings = Settings(
        report_to="wandb",
        report_project="rlproxy-test",
        state_dir=offline_wandb / "state",
        api_key="secret-key-never-sent",
        learning_rate=0.01,
    )
    reporter = Reporter.create(settings)
    assert reporter.tracker is not None
    reporter.report_step(
        1, {"loss": 0.5, "kl": 0.02, "grad_norm": 1.5, "tokens": 100, "seconds": 2.0}, CurveStore(), "agent"
    )
    reporter.report_step(
        2, {"loss": 0.25, "kl": 0.03, "grad_norm": 0.5, "tokens": 120, "seconds": 2.5}, CurveStore(), "agent"
    )
    reporter.close()
    assert not [r.getMessage() for r in caplog.records if "--report-to" in r.getMessage()]  # no step was dropped

    [run_file] = list((offline_wandb / "wandb").glob("offline-run-*/run-*.wandb"))
    rows = history(run_file)
    deadline = time.monotonic() + 30
    while len(rows) < 2 and time.monotonic() < deadline:  # on a loaded machine wandb's service may still be writing
        time.sleep(0.2)
        rows = history(run_file)
    assert [row["_step"] for row in rows] == [1, 2]
    assert rows[0]["train/loss"] == 0.5 and rows[1]["train/loss"] == 0.25
    assert rows[0]["train/kl"] == 0.02 and rows[1]["train/grad_norm"] == 0.5
    assert rows[0]["val/sampled_reward_mean"] == 0.2 and rows[1]["train/sampled_reward_mean"] == 0.75
    assert "val/sampled_reward_mean" not in rows[1]  # no val rollouts at step 1
    settings_logged = config(run_file)
    assert settings_logged["learning_rate"] == 0.01 and settings_logged["report_to"] == "wandb"
    assert settings_logged["api_key"] == "***"
    assert b"secret-key-never-sent" not in run_file.read_bytes()


def test_wandb_never_records_a_secret_of_the_command_line(offline_wandb, monkeypatch):
    # wandb keeps the command line in the run's metadata: `rlproxy train --store URL` with a password.
    command = ["rlproxy", "train", "--store", "postgresql://rl:pw-never-sent@db/rl", "--hf-token", "hf-never-sent"]
    monkeypatch.setattr(sys, "argv", list(command))
    reporter = Reporter.create(Settings(report_to="wandb", state_dir=offline_wandb / "state"))
    assert reporter.tracker is not None
    run_file = Path(reporter.tracker._run.settings.sync_file)  # wandb keeps the first run's WANDB_DIR per process
    reporter.report_step(1, {"loss": 0.5}, CurveStore(), "agent")
    reporter.close()
    assert sys.argv == command  # the trainer's own command line is left as it was

    deadline = time.monotonic() + 30
    while b"postgresql://rl:***@db/rl" not in run_file.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.2)  # on a loaded machine wandb's service may still be writing
    written = run_file.read_bytes()
    assert b"postgresql://rl:***@db/rl" in written  # the command line is there, masked
    assert b"pw-never-sent" not in written and b"hf-never-sent" not in written


def test_a_tracker_not_installed_never_stops_training(monkeypatch, caplog, tmp_path):
    monkeypatch.setitem(sys.modules, "trackio", None)  # `import trackio` raises ImportError
    with caplog.at_level(logging.WARNING, logger="rlproxy.trainer"):
        reporter = Reporter.create(Settings(report_to="trackio", state_dir=tmp_path))
    assert reporter.tracker is None
    assert "not installed" in caplog.text and "pip install trackio" in caplog.text
    reporter.report_step(1, {"loss": 1.0}, CurveStore(), "agent")  # a no-op, no error
    reporter.close()


def test_a_tracker_that_fails_is_switched_off(caplog):
    class Broken:
        logged = 0
        finished = False

        def log(self, metrics, step):
            Broken.logged += 1
            raise ConnectionError("tracker is down")

        def finish(self):
            Broken.finished = True
            raise ConnectionError("still down")

    reporter = Reporter(Broken(), "wandb")
    with caplog.at_level(logging.WARNING, logger="rlproxy.trainer"):
        reporter.report_step(1, {"loss": 1.0}, CurveStore(), "agent")
        reporter.report_step(2, {"loss": 1.0}, CurveStore(), "agent")
    assert Broken.logged == 1 and Broken.finished  # dropped after the first failure
    assert "tracker is down" in caplog.text
    reporter.close()


def test_a_tracker_that_cannot_start_never_stops_training(monkeypatch, caplog, tmp_path):
    import trainer.reporting as reporting

    def refuse(*args, **kwargs):
        raise RuntimeError("no network")

    monkeypatch.setitem(reporting._TRACKERS, "wandb", refuse)
    with caplog.at_level(logging.WARNING, logger="rlproxy.trainer"):
        reporter = Reporter.create(Settings(report_to="wandb", state_dir=tmp_path))
    assert reporter.tracker is None and "no network" in caplog.text


REPORTER_AT_START = """
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from gateway.settings import Settings
from trainer.reporting import Reporter
reporter = Reporter.create(Settings(report_to="wandb", state_dir=sys.argv[1]))
print("tracker:", reporter.tracker)
"""


def test_wandb_online_without_a_login_is_refused_at_start_not_prompted_for(tmp_path):
    """`rlproxy train --report-to wandb` on a terminal, never logged in, WANDB_MODE unset: wandb
    would ask "Enter your choice:" and the trainer would wait there; it must say what to do and train on."""
    pytest.importorskip("wandb", reason="wandb is in the dev extra: pip install -e '.[dev]'")
    env = {name: value for name, value in os.environ.items() if not name.startswith("WANDB_")}
    env |= {"HOME": str(tmp_path), "NETRC": str(tmp_path / "netrc"), "WANDB_DIR": str(tmp_path)}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    terminal, child_end = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", REPORTER_AT_START, str(tmp_path / "state")],
        stdin=child_end,
        stdout=child_end,
        stderr=child_end,
        env=env,
        cwd=tmp_path,
    )
    os.close(child_end)
    output = b""
    try:
        while b"Enter your choice" not in output:
            ready, _, _ = select.select([terminal], [], [], 120)  # a guard against a hang, not a timing
            if not ready:
                break
            try:
                chunk = os.read(terminal, 4096)
            except OSError:  # the child closed the terminal: it ended
                break
            if not chunk:
                break
            output += chunk
    finally:
        os.close(terminal)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    text = output.decode(errors="replace")
    assert "Enter your choice" not in text, text
    assert proc.returncode == 0, text
    assert "no W&B credentials" in text and "WANDB_MODE=offline" in text and "training goes on" in text, text
    assert "tracker: None" in text
