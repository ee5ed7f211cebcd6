"""A trainer killed mid-step leaves its groups claimed: a gateway gives the claims back once the
trainer no longer holds its lock in the store, exactly once, and never a live trainer's.

Only the next trainer's start gave them back: with `serve --trainer off` beside an `rlproxy train`
that was SIGKILLed, rewards to those groups got 409 "is being trained (step N)" for ever.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from gateway.app import create_app
from gateway.errors import Conflict, TrainerBusy
from gateway.settings import Settings
from gateway.store import Store
from gateway.store.sqlite import SQLiteStore
from tests.helpers import ThreadServer, stop_process
from tests.helpers_trainer import Recorder, trainer_settings
from tests.helpers_vllm import wait_until
from tests.test_store import call
from tests.test_trainer_restart import ROOT, train_cmd


def _claimed_group(store: Store, group_id: str, step: int) -> None:
    for i in range(2):
        store.record_call_sync(call(0, f"{group_id}-s{i}", group_id, id=f"{group_id}-s{i}-call"))
        asyncio.run(store.set_reward(f"{group_id}-s{i}", float(i)))
    asyncio.run(store.close_group(group_id))
    assert store.claim_for_step([group_id], step) == [group_id]  # what a trainer's step does first


def test_a_trainer_that_lost_its_lock_has_its_claims_given_back_once_on_either_backend(either_backend):
    store = either_backend
    store.insert_step("agent", 0, "/nowhere/0", {}, [])
    lock = store.lock_trainer("agent")  # the trainer's, as `rlproxy train` takes it at start
    _claimed_group(store, "g", 1)
    assert store.give_back_dead_claims("agent") == 0  # its trainer lives: the claim is its own
    with pytest.raises(Conflict, match="is being trained"):
        asyncio.run(store.set_reward("g-s0", 0.5))

    lock.release()  # what the trainer's death does: the kernel's flock, PostgreSQL's session lock
    # (PostgreSQL drops the lock once the server has seen its connection go: a moment after the close)
    assert wait_until(lambda: store.give_back_dead_claims("agent"), what="the claim given back") == 1
    assert store.give_back_dead_claims("agent") == 0  # once: a second gateway finds nothing to give
    assert store.get_group("g")["claimed_step"] is None
    assert asyncio.run(store.set_reward("g-s0", 0.5))["group_id"] == "g"  # rewards are taken again

    # A trainer that lived on without its lock (PostgreSQL restarted under its step) records nothing
    # of the groups given back: their rewards changed after the step had read them.
    with pytest.raises(Conflict, match="no longer claimed by step 1"):
        store.insert_step("agent", 1, "/nowhere/1", {}, ["g"], ["g-s0", "g-s1"], claimed=True)
    assert store.get_group("g")["trained_step"] is None


def test_a_second_trainer_on_one_sqlite_file_is_refused_whatever_its_state_dir(tmp_path):
    store = SQLiteStore(tmp_path / "shared.db")
    first = store.lock_trainer("agent")
    with pytest.raises(TrainerBusy, match="another trainer is training model 'agent'"):
        SQLiteStore(tmp_path / "shared.db").lock_trainer("agent")
    assert SQLiteStore(tmp_path / "shared.db").lock_trainer("other") is not None  # one per model
    first.release()


@contextmanager
def _paused_trainer(state_dir: Path):
    """`rlproxy train` paused inside step 1 (its groups claimed), yielded alive."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "RLPROXY_TORCH_THREADS": "1",
        "RLPROXY_TEST_PAUSE_AT": "train",
        "RLPROXY_TEST_PAUSE_SECONDS": "300",
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
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("rlproxy-test-pause: train step 1"):
                break
        else:
            raise AssertionError(f"the trainer exited ({proc.wait()}) before its step:\n{''.join(lines)[-3000:]}")
        yield proc
    finally:
        stop_process(proc)
        proc.stderr.close()


def test_a_gateway_gives_back_the_claims_of_a_trainer_killed_mid_step(tmp_path):
    settings = trainer_settings(tmp_path)
    recorder = Recorder(settings)
    for gid in ("g0", "g1"):
        recorder.group(gid, [0.0, 1.0])
    recorder.close()
    store = SQLiteStore(settings.db_path)
    gateway = Settings(state_dir=tmp_path, trainer="off", default_max_tokens=4, poll_interval=0.05)
    with _paused_trainer(tmp_path) as trainer, ThreadServer(create_app(gateway)) as server:
        assert [store.get_group(g)["claimed_step"] for g in ("g0", "g1")] == [1, 1]
        assert store.give_back_dead_claims("agent") == 0  # alive, mid-step: never its claims
        refused = httpx.post(f"{server.url}/v1/sessions/g0-s0/reward", json={"reward": 0.5})
        assert refused.status_code == 409 and "is being trained (step 1)" in refused.text

        os.killpg(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=30)
        wait_until(lambda: store.get_group("g0")["claimed_step"] is None, what="the dead trainer's claims given back")
        answer = httpx.post(f"{server.url}/v1/sessions/g0-s0/reward", json={"reward": 0.5})
        assert answer.status_code == 200, answer.text
        assert store.get_group("g1")["claimed_step"] is None
