"""`rlproxy train` killed (SIGKILL) during a step, then restarted: no group is lost or
trained twice, and step numbers follow the last checkpoint.

The worker's test hook (`RLPROXY_TEST_PAUSE_AT`) announces a phase on stderr and sleeps
there, so the kill lands at a known point: during training (nothing on disk yet) and
between the checkpoint's rename and its step row (a checkpoint the store does not know).
"""

import asyncio
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from gateway.store import Store
from gateway.store.sqlite import SQLiteStore
from tests.helpers import stop_process
from tests.helpers_trainer import Recorder, trainer_settings
from trainer.worker import run_worker

ROOT = Path(__file__).resolve().parents[1]
GROUPS = [f"g{i}" for i in range(6)]


def train_cmd(state_dir: Path) -> list[str]:
    """`rlproxy train` with the settings of `trainer_settings`."""
    return [
        sys.executable,
        "-m",
        "gateway.cli",
        "train",
        "--state-dir",
        str(state_dir),
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
    ]


def kill_at(state_dir: Path, phase: str) -> str:
    """Run the worker until it pauses at `phase` of a step, SIGKILL it; return its log."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "RLPROXY_TORCH_THREADS": "1",
        "RLPROXY_TEST_PAUSE_AT": phase,
        "RLPROXY_TEST_PAUSE_SECONDS": "120",
    }
    proc = subprocess.Popen(
        train_cmd(state_dir),
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if line.startswith(f"rlproxy-test-pause: {phase}"):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                return "".join(lines)
        raise AssertionError(f"worker exited ({proc.wait()}) before pausing at {phase}:\n{''.join(lines)[-3000:]}")
    finally:
        stop_process(proc)
        proc.stderr.close()


def trained_steps(store: Store) -> dict[str, int | None]:
    return {gid: store.get_group(gid)["trained_step"] for gid in GROUPS}


def test_killed_worker_loses_no_group_and_numbers_steps_after_the_last_checkpoint(tmp_path, caplog):
    settings = trainer_settings(tmp_path)
    recorder = Recorder(settings)
    for i, gid in enumerate(GROUPS):
        recorder.group(gid, [1.0, 0.0] if i % 2 else [0.0, 0.5, 1.0])
    recorder.close()
    store = SQLiteStore(settings.db_path)
    root = settings.checkpoints_dir()

    # 1. Killed while training step 1: step 0 is there, nothing of step 1 is.
    log = kill_at(tmp_path, "train")
    assert "rlproxy-test-pause: train step 1" in log
    assert [s["step"] for s in store.steps("agent")] == [0]
    assert sorted(p.name for p in root.iterdir() if p.name[0].isdigit()) == ["0000"]
    assert set(trained_steps(store).values()) == {None}

    # 2. Killed after checkpoint 0001 was renamed into place, before its step row.
    kill_at(tmp_path, "record")
    assert (root / "0001" / "adapter_model.safetensors").is_file()
    assert [s["step"] for s in store.steps("agent")] == [0]
    assert set(trained_steps(store).values()) == {None}
    # A save killed half-way leaves only a hidden temporary directory, never a step number.
    (root / ".tmp-0002-99999").mkdir()
    (root / ".tmp-0002-99999" / "adapter_config.json").write_text("{")

    # 3. Restarted for good (in this process: the CLI path is the one killed above):
    # step 1 is recorded from its checkpoint, then steps 2 and 3 are trained.
    with caplog.at_level(logging.INFO, logger="rlproxy.trainer"):
        assert run_worker(settings, max_steps=2) == 2
    assert "recorded step 1 from its checkpoint" in caplog.text

    steps = store.steps("agent")
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert sorted(p.name for p in root.iterdir() if p.name != ".worker.lock") == ["0000", "0001", "0002", "0003"]
    claimed = [gid for s in steps for gid in s["groups"]]
    assert sorted(claimed) == GROUPS  # every group trained exactly once
    by_group = trained_steps(store)
    assert all(by_group[gid] == s["step"] for s in steps for gid in s["groups"])
    assert [len(s["groups"]) for s in steps] == [0, 2, 2, 2]


def test_a_session_discarded_while_the_worker_was_down_takes_its_unrecorded_step_back(tmp_path):
    settings = trainer_settings(tmp_path)
    recorder = Recorder(settings)
    recorder.group("g0", [0.0, 0.5, 1.0])
    recorder.group("g1", [1.0, 0.0])
    recorder.close()
    kill_at(tmp_path, "record")  # checkpoint 0001 trained on g0-s0 is written, its step row is not

    async def discard() -> None:  # as POST /v1/sessions/g0-s0/discard does, while no trainer runs
        store = SQLiteStore(settings.db_path)
        await store.discard_session("g0-s0", "the rollout's tool crashed")
        await store.close()

    asyncio.run(discard())
    assert run_worker(settings, max_steps=0) == 0  # resumes only
    store = SQLiteStore(settings.db_path)
    assert [s["step"] for s in store.steps("agent")] == [0]  # checkpoint 0001 is dropped, never recorded
    assert not (settings.checkpoints_dir() / "0001").exists()
    assert run_worker(settings, max_steps=1) == 1  # the groups train again, without g0-s0
    assert [(s["step"], s["groups"]) for s in store.steps("agent")] == [(0, []), (1, ["g0", "g1"])]
    assert store.get_session("g0-s0")["advantage"] is None  # never trained
    assert store.get_session("g0-s1")["advantage"] is not None and store.get_session("g0-s2")["advantage"] is not None


def test_a_checkpoint_whose_step_number_was_recorded_meanwhile_is_discarded_on_either_backend(either_backend, tmp_path):
    # Another trainer recorded the number between resume's read and this record: on PostgreSQL the
    # duplicate was psycopg's own error, which stopped the trainer at start (SQLite's was caught), and
    # the refused record's files had replaced the recorded step's.
    from trainer import checkpoints as ckpts
    from trainer.resume import record_orphan

    def weights(text: str):
        return lambda directory: (directory / "adapter_model.safetensors").write_text(text)

    store = either_backend
    store.insert_step("agent", 0, str(tmp_path / "none"), {}, [])
    recorded = ckpts.write_checkpoint(tmp_path / "node-1", 1, weights("recorded"), settings={}, metrics={}, groups=[])
    store.insert_step("agent", 1, str(recorded.path), {}, [])
    orphan = ckpts.write_checkpoint(tmp_path / "node-2", 1, weights("orphan"), settings={}, metrics={}, groups=[])

    record_orphan(store, "agent", orphan)

    assert not orphan.path.exists()  # discarded
    row = next(s for s in store.steps("agent") if s["step"] == 1)
    served = Path(store.fetch_step_files("agent", 1, row["path"], tmp_path / "models"))
    assert (served / "adapter_model.safetensors").read_text() == "recorded"
