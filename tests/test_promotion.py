"""Promotion: a step serves as NAME only when a policy (or an admin) decides it is better.

Step rows carry a state, a parent and the decision's record; `--promote always` (the default)
serves every step at once, as before; `--promote manual` waits for POST .../promote or /reject,
which with `--admin-key` set only the admin key may send. A real gateway on the tiny model
serves the steps; the trainer is played by `Publisher` (a PEFT checkpoint, then the step row).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import pytest

from gateway.app import create_app
from gateway.settings import Settings
from gateway.store.lineage import chain_distance
from gateway.store.sqlite import SQLiteStore
from tests.helpers import ThreadServer
from tests.test_hotswap import save_adapter

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*tie_word_embeddings"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing"),
]

API_KEY = "agent-key-0123456789"
ADMIN_KEY = "admin-key-0123456789"
AGENT = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


class Publisher:
    """Plays the trainer: checkpoint files, then the step row (a candidate unless `always`)."""

    def __init__(self, settings: Settings):
        from gateway.models.registry import resolve_base_model

        self.settings = settings
        self.base_dir = Path(resolve_base_model(settings.base_model, settings.state_dir))
        self.store = SQLiteStore(settings.db_path)

    def publish(self, step: int, state: str = "candidate") -> None:
        path = self.settings.checkpoints_dir() / f"{step:04d}"
        path.parent.mkdir(parents=True, exist_ok=True)
        save_adapter(self.base_dir, path, seed=step)
        self.store.insert_step(self.settings.model_name, step, str(path.resolve()), {"loss": 0.0}, [], state=state)


def _steps(client: httpx.Client) -> dict[int, dict]:
    return {row["step"]: row for row in client.get("/v1/training/steps", headers=AGENT).json()["data"]}


def _served_step(client: httpx.Client, session: str) -> str | None:
    response = client.post(
        "/v1/chat/completions",
        headers={**AGENT, "X-Session-Id": session},
        json={"model": "agent", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2},
    )
    assert response.status_code == 200, response.text
    return response.headers.get("x-model-step")


def test_always_serves_each_step_at_once_and_records_its_lineage(tmp_path):
    settings = Settings(engine="local", state_dir=tmp_path, poll_interval=30, default_max_tokens=2, api_key=API_KEY)
    publisher = Publisher(settings)
    for step in range(3):
        publisher.publish(step, state="promoted")  # what the trainer records under the default --promote always
    with ThreadServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        steps = _steps(client)
        assert [steps[s]["state"] for s in range(3)] == ["superseded", "superseded", "promoted"]
        assert [steps[s]["parent"] for s in range(3)] == [None, 0, 1]
        assert steps[2]["decision"]["by"] == "policy" and steps[2]["decision"]["policy"] == "always"
        assert _served_step(client, "s-always") == "2"
        assert "serving_step" not in client.get("/healthz").json()  # /healthz as before under `always`


def test_manual_promote_reject_resume_and_the_admin_key_through_http(tmp_path):
    settings = Settings(
        engine="local",
        state_dir=tmp_path,
        poll_interval=30,
        default_max_tokens=2,
        api_key=API_KEY,
        admin_key=ADMIN_KEY,
        promote="manual",
        max_rejections=2,
    )
    publisher = Publisher(settings)
    publisher.publish(0, state="promoted")  # step 0 serves from the start
    publisher.publish(1)
    with ThreadServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        steps = _steps(client)
        assert steps[1]["state"] == "candidate" and steps[1]["parent"] == 0 and steps[1]["decision"] is None
        assert _served_step(client, "s1") == "0", "a candidate does not serve as NAME before its decision"
        health = client.get("/healthz").json()
        assert health["serving_step"] == 0 and health["candidate_step"] == 1 and health["training"] is None

        decide = {"model": "agent", "reason": "looked at its sessions"}
        refused = client.post("/v1/training/steps/1/promote", headers=AGENT, json=decide)
        assert refused.status_code == 403 and "admin" in refused.json()["error"]["message"]
        assert client.post("/v1/training/trigger", headers=AGENT, json={}).status_code == 403
        assert client.post("/v1/training/resume", headers=AGENT, json={}).status_code == 403
        assert client.post("/v1/training/trigger", headers=ADMIN, json={}).status_code == 202
        assert client.post("/v1/training/steps/1/promote", json=decide).status_code == 401  # no key at all

        promoted = client.post("/v1/training/steps/1/promote", headers=ADMIN, json=decide)
        assert promoted.status_code == 200, promoted.text
        steps = _steps(client)
        assert steps[1]["state"] == "promoted" and steps[0]["state"] == "superseded"
        assert steps[1]["decision"]["by"] == "api" and steps[1]["decision"]["reason"] == "looked at its sessions"
        assert _served_step(client, "s2") == "1"
        again = client.post("/v1/training/steps/1/reject", headers=ADMIN, json=decide)
        assert again.status_code == 409, "a step is decided once"
        other = client.post("/v1/training/steps/1/promote", headers=ADMIN, json={"model": "other"})
        assert other.status_code == 404
        for step in (-1, 2**64):  # no such step, whatever the store's integers hold
            unknown = client.post(f"/v1/training/steps/{step}/reject", headers=ADMIN, json=decide)
            assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "step", unknown.text

        for step in (2, 3):  # two rejections in a row (--max-rejections 2) pause training
            publisher.publish(step)
            rejected = client.post(f"/v1/training/steps/{step}/reject", headers=ADMIN, json={"model": "agent"})
            assert rejected.status_code == 200, rejected.text
            assert _served_step(client, f"s-reject-{step}") == "1", "a rejected step never serves as NAME"
        steps = _steps(client)
        assert steps[2]["state"] == steps[3]["state"] == "rejected" and steps[3]["parent"] == 1
        health = client.get("/healthz").json()
        assert health["status"] == "ok" and "training is paused" in health["training"]
        assert "POST /v1/training/resume" in health["training"]
        resumed = client.post("/v1/training/resume", headers=ADMIN, json={})
        assert resumed.status_code == 200 and resumed.json()["cleared"] == 2
        assert client.get("/healthz").json()["training"] is None
        assert _steps(client)[3]["state"] == "rejected"  # resuming does not undo a decision


async def test_a_store_from_before_promotion_serves_its_steps_as_promoted(tmp_path):
    import sqlite3

    from tests.test_store_migrations import V1_SQLITE

    path = tmp_path / "rlproxy.db"
    conn = sqlite3.connect(path)
    conn.executescript(V1_SQLITE)
    for step in (0, 1):
        conn.execute(
            "INSERT INTO steps (model, step, path, metrics, groups, created_at)"
            " VALUES ('agent', ?, 'p', '{}', '[]', 1)",
            (step,),
        )
    conn.commit()
    conn.close()
    store = SQLiteStore(path)
    try:
        rows = store.steps("agent")
        assert [(r["state"], r["parent"], r["decision"]) for r in rows] == [("promoted", None, None)] * 2
        assert store.serving_step("agent") == 1 and store.undecided_step("agent") is None
        assert chain_distance(store.lineage("agent"), 1, 0) == 1  # by number, as before
    finally:
        await store.close()


def test_staleness_counts_steps_along_the_parent_chain():
    # 0 -> 1 -> 2; 3 was rejected (parent 2); 4 was trained from 2 again; 5 from 4.
    parents = {0: None, 1: 0, 2: 1, 3: 2, 4: 2, 5: 4}
    assert chain_distance(parents, 5, 2) == 2  # 5 - 2 = 3 by number; the rejected 3 does not count
    assert chain_distance(parents, 5, 1) == 3
    assert chain_distance(parents, 4, None) == 3  # the base model is step 0's policy
    assert chain_distance(parents, 2, 3) == -1  # a canary's rejected step is one past where it branched
    # Rows recorded before steps had parents (an older store): their numbers, as before.
    assert chain_distance({0: None, 1: None, 2: None, 3: None}, 3, 1) == 2


def _params(worker) -> list:
    return worker.backend.snapshot()["params"]


def _same(a: list, b: list) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_the_trainer_waits_for_a_decision_and_goes_on_from_the_serving_step(tmp_path, caplog):
    import threading

    from tests.helpers_trainer import Recorder, trainer_settings
    from trainer.worker import TrainerWorker

    settings = trainer_settings(tmp_path, promote="manual", max_staleness=10, max_rejections=2)
    recorder = Recorder(settings)
    store = recorder.store
    for gid, rewards in (("g0", [1.0, 0.0]), ("g1", [0.0, 1.0])):
        recorder.group(gid, rewards)
    worker = TrainerWorker(settings)
    worker.start()
    step_0 = _params(worker)  # the incumbent: step 0's adapter
    assert worker.run(max_steps=1) == 1
    step_1 = _params(worker)
    assert not _same(step_0, step_1)
    rows = {r["step"]: r for r in store.steps("agent")}
    assert rows[1]["state"] == "candidate" and rows[1]["parent"] == 0 and store.serving_step("agent") == 0

    # Step 1 undecided: ready groups accumulate, nothing trains on top of it.
    for gid, rewards in (("g2", [1.0, 0.0]), ("g3", [0.0, 1.0])):
        recorder.group(gid, rewards, step=0)
    stop = threading.Event()
    with caplog.at_level("INFO", logger="rlproxy"):
        thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
        thread.start()
        while "training waits for its decision" not in caplog.text:
            thread.join(0.05)
            assert thread.is_alive()
        stop.set()
        thread.join(60)
        assert [store.get_group(g)["trained_step"] for g in ("g2", "g3")] == [None, None]

        # Rejected: the next step is trained from the incumbent's adapter, not on top of step 1.
        store.decide_step("agent", 1, "rejected", {"by": "test"})
        assert worker.run(max_steps=1) == 1
    assert "step 0 serves; training goes on from its adapter and optimizer" in caplog.text
    rows = {r["step"]: r for r in store.steps("agent")}
    assert rows[2]["parent"] == 0 and rows[2]["state"] == "candidate"
    assert store.get_group("g2")["trained_step"] == 2
    store.decide_step("agent", 2, "rejected", {"by": "test"})
    worker.close()

    # Restarted: resume loads the serving step (0), not the newest checkpoint (2).
    restarted = TrainerWorker(settings)
    restarted.start()
    try:
        assert restarted.next_step == 3 and restarted.weights_step == 0
        assert _same(_params(restarted), step_0), "a restart goes on from the serving step's adapter"
        assert all(not moments for moments in restarted.backend.snapshot()["optimizer"])  # step 0's: no moments yet
        # Two rejections in a row (--max-rejections 2): paused, with the reason in the log.
        recorder.group("g4", [1.0, 0.0], step=0)
        recorder.group("g5", [0.0, 1.0], step=0)
        stop = threading.Event()
        with caplog.at_level("INFO", logger="rlproxy"):
            thread = threading.Thread(target=restarted.run, args=(stop,), daemon=True)
            thread.start()
            while "training is paused: 2 steps in a row were rejected" not in caplog.text:
                thread.join(0.05)
                assert thread.is_alive()
            store.resume_training("agent")  # what POST /v1/training/resume does
            while store.get_group("g4")["trained_step"] is None:
                thread.join(0.05)
                assert thread.is_alive()
            stop.set()
            thread.join(60)
        assert {r["step"]: r for r in store.steps("agent")}[3]["parent"] == 0
    finally:
        restarted.close()
        recorder.close()


def test_a_step_0_saved_but_not_recorded_is_the_serving_step_on_restart_under_canary(tmp_path):
    import sqlite3

    from tests.helpers_trainer import trainer_settings
    from trainer.resume import hold_reason
    from trainer.worker import TrainerWorker

    settings = trainer_settings(tmp_path, promote="canary")
    first = TrainerWorker(settings)
    first.start()  # saves step 0 and records it
    first.close()
    with sqlite3.connect(settings.db_path) as conn:  # as if killed between the checkpoint and its row
        conn.execute("DELETE FROM steps")
    restarted = TrainerWorker(settings)
    restarted.start()  # records step 0 from its checkpoint
    try:
        store = SQLiteStore(settings.db_path)
        assert [(r["step"], r["state"]) for r in store.steps("agent")] == [(0, "promoted")]
        # A candidate step 0 has no incumbent to be compared with: the canary never decided it,
        # and the trainer waited on it for ever.
        assert store.serving_step("agent") == 0 and hold_reason(store, settings, "agent") is None
    finally:
        restarted.close()


def test_a_trainer_under_another_promote_than_the_gateway_is_said_in_healthz(tmp_path):
    # `rlproxy serve --promote canary` and `rlproxy train` run alone, without the flag: the trainer
    # records each step promoted (its own --promote always), which serves every session at once.
    canary = Settings(engine="local", state_dir=tmp_path / "a", poll_interval=0.05, promote="canary")
    publisher = Publisher(canary)
    publisher.publish(0, state="promoted")
    with ThreadServer(create_app(canary)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        assert "promotion_mismatch" not in client.get("/healthz").json()  # step 0 starts every run promoted
        publisher.publish(1, state="promoted")  # what `rlproxy train` records without --promote canary
        for _ in range(400):  # a hang guard: the gateway reads the store at its next poll
            health = client.get("/healthz").json()
            if "promotion_mismatch" in health:
                break
            time.sleep(0.05)
        assert "step 1 was recorded promoted by a trainer running --promote always" in health["promotion_mismatch"]
    # The other way round: the trainer under --promote canary, the gateway under always.
    always = Settings(engine="local", state_dir=tmp_path / "b", poll_interval=30)
    publisher = Publisher(always)
    publisher.publish(0, state="promoted")
    publisher.publish(1)
    with ThreadServer(create_app(always)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        health = client.get("/healthz").json()
        assert "nothing decides it and the trainer waits on it" in health["promotion_mismatch"]
        assert _served_step(client, "s") == "0"


def test_a_step_whose_parent_is_rolled_back_as_it_trains_is_taken_back_and_trained_from_the_serving_step(
    tmp_path, caplog, monkeypatch
):
    import trainer.publish
    from tests.helpers_trainer import Recorder, trainer_settings
    from trainer.worker import TrainerWorker

    settings = trainer_settings(tmp_path, promote="canary", max_staleness=10, groups_per_step=1)
    recorder = Recorder(settings)
    store = recorder.store
    recorder.group("g0", [1.0, 0.0])
    worker = TrainerWorker(settings)
    worker.start()
    try:
        assert worker.run(max_steps=1) == 1
        since = {r["step"]: r for r in store.steps("agent")}[1]["created_at"]
        store.decide_step("agent", 1, "promoted", {"by": "policy", "policy": "canary", "candidate_since": since})
        recorder.group("g1", [0.0, 1.0], step=1)
        rolled_back = []

        def watch_lands(
            phase: str, step: int
        ) -> None:  # the canary's watch rolls the serving step back as `step` trains
            if phase == "train" and not rolled_back:
                serving = store.serving_step("agent")
                rolled_back.append(
                    store.decide_step("agent", serving, "rolled_back", {"by": "policy", "policy": "canary"})
                )

        monkeypatch.setattr(trainer.publish, "_test_pause", watch_lands)
        with caplog.at_level("INFO", logger="rlproxy"):
            assert worker.run(max_steps=1) == 1
        assert "step 2 taken back: step 1, which it was trained from, was rolled_back meanwhile" in caplog.text
        assert "step 0 serves; training goes on from its adapter and optimizer" in caplog.text
        rows = {r["step"]: r for r in store.steps("agent")}
        assert rows[2]["parent"] == 0 and rows[2]["state"] == "candidate"  # trained from what serves, and says so
        assert store.get_group("g1")["trained_step"] == 2

        # Rolled back a moment later, between the check and the step's row: the row names the step it was
        # trained from (which the canary then rejects at once: tests/test_canary.py), not what serves by then.
        since = {r["step"]: r for r in store.steps("agent")}[2]["created_at"]
        store.decide_step("agent", 2, "promoted", {"by": "policy", "policy": "canary", "candidate_since": since})
        recorder.group("g2", [1.0, 0.0], step=2)
        rolled_back.clear()
        monkeypatch.setattr(
            trainer.publish, "_test_pause", lambda phase, step: phase == "record" and watch_lands("train", 3)
        )
        assert worker.run(max_steps=1) == 1
        rows = {r["step"]: r for r in store.steps("agent")}
        assert rows[2]["state"] == "rolled_back" and rows[3]["parent"] == 2
    finally:
        worker.close()
        recorder.close()
