"""Decisions that would serve a step `--keep-checkpoints` removed: refused, and what served goes on.

`--keep-checkpoints N` keeps the serving step and its parent (what one rollback serves again),
not the whole chain: roll back twice and the second would serve a step whose checkpoint is gone.
The store refuses such a decision (409, `checkpoint_removed`) on either backend, and the canary's
watch, which would make it, keeps serving the step it watched and says why in /healthz."""

from __future__ import annotations

import asyncio
import shutil
import time

import httpx
import pytest

from gateway.app import create_app
from gateway.errors import Conflict
from tests.helpers import ThreadServer
from tests.helpers_trainer import Recorder, trainer_settings
from tests.test_canary import canary_settings, session, until_decided
from tests.test_promotion import Publisher

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*tie_word_embeddings"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing"),
]

ROLLED_BACK_TOO_FAR = (
    "step 2 of 'agent' cannot be rolled back: step 1, which it replaced and which would serve again, has no "
    "checkpoint any more (--keep-checkpoints removes old ones), so no gateway could load it; step 2 keeps serving"
)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_second_rollback_to_a_step_keep_checkpoints_removed_is_refused(backend, tmp_path, request):
    """`--promote manual --keep-checkpoints 1`: steps 1-3 promoted, step 4 rejected. Step 3 rolls back
    to step 2 (its parent, kept); rolling step 2 back would serve step 1, removed: refused, step 2 serves."""
    from trainer.worker import TrainerWorker

    store_url = request.getfixturevalue("postgres_db") if backend == "postgres" else None
    on_postgres = {"store": store_url} if store_url is not None else {}
    settings = trainer_settings(
        tmp_path, groups_per_step=1, keep_checkpoints=1, promote="manual", max_rejections=5, **on_postgres
    )
    recorder = Recorder(settings)
    if store_url is not None:
        from gateway.store.postgres import PostgresStore

        asyncio.run(recorder.store.close())
        recorder.store = PostgresStore(store_url)  # the calls and rewards into the shared store
    store = recorder.store
    worker = TrainerWorker(settings)
    try:
        worker.start()
        for step in (1, 2, 3, 4):
            recorder.group(f"g{step}", [1.0, 0.0], step=step - 1)
            assert worker.run(max_steps=1) == 1
            to_state = "promoted" if step < 4 else "rejected"
            store.decide_step("agent", step, to_state, {"by": "api", "reason": "test"})
    finally:
        worker.close()
    root = settings.checkpoints_dir()
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["0002", "0003", "0004"]
    if store_url is not None:
        # A gateway on another machine than the trainer: it loads steps from the store's files, not this disk.
        shutil.rmtree(root)
        assert sorted(store.stored_steps("agent")) == [2, 3, 4]

    store.decide_step("agent", 3, "rolled_back", {"by": "api", "reason": "dropped"})
    assert store.serving_step("agent") == 2
    with pytest.raises(Conflict) as refused:
        store.decide_step("agent", 2, "rolled_back", {"by": "api", "reason": "dropped too"})
    assert refused.value.code == "checkpoint_removed" and refused.value.message == ROLLED_BACK_TOO_FAR
    rows = {row["step"]: row for row in store.steps("agent")}
    assert store.serving_step("agent") == 2 and rows[1]["state"] == "superseded"
    recorder.close()


def test_a_promotion_of_a_candidate_whose_checkpoint_is_gone_is_a_409(tmp_path):
    """`--promote manual`: a candidate whose files are gone (removed by hand) is not promoted: the
    gateway could not load it and would go on serving the incumbent while the store said otherwise."""
    settings = canary_settings(tmp_path, promote="manual")
    publisher = Publisher(settings)
    publisher.publish(0, state="promoted")
    publisher.publish(1)
    shutil.rmtree(settings.checkpoints_dir() / "0001")
    with ThreadServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        refused = client.post("/v1/training/steps/1/promote", json={"model": "agent", "reason": "looks good"})
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["type"] == "conflict_error" and error["code"] == "checkpoint_removed"
        assert error["message"].startswith("step 1 of 'agent' cannot be promoted: its checkpoint is gone from ")
        assert error["message"].endswith("so no gateway could load it; the incumbent keeps serving")
        rows = {r["step"]: r for r in client.get("/v1/training/steps").json()["data"]}
        assert rows[0]["state"] == "promoted" and rows[1]["state"] == "candidate"
        assert session(client, "s", lambda step: 1.0) == ["0", "0"]


def test_the_canary_watch_keeps_serving_a_step_whose_predecessor_is_gone_and_says_why(tmp_path, caplog):
    """Step 1 drops once promoted, as in test_canary's rollback; step 0's checkpoint was removed
    meanwhile: the watch cannot serve it again, so step 1 goes on serving rather than nothing."""
    settings = canary_settings(tmp_path)
    publisher = Publisher(settings)
    publisher.publish(0, state="promoted")
    publisher.publish(1)
    promoted_at: list[float] = []

    def drops_once_promoted(step: int) -> float:  # good during its canary, worse by 0.5 after
        return 0.5 if step == 1 and promoted_at else 1.0

    caplog.set_level("WARNING", logger="rlproxy.promotion")
    with ThreadServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        assert until_decided(client, 1, drops_once_promoted, "a", [])["state"] == "promoted"
        promoted_at.append(time.time())
        shutil.rmtree(settings.checkpoints_dir() / "0000")  # as --keep-checkpoints would, were step 1 rolled back once
        for i in range(60):  # a hang guard: sessions until the watch has judged step 1
            health = client.get("/healthz").json()
            if "rollback_refused" in health:
                break
            session(client, f"w-{i}", drops_once_promoted)
        rows = {r["step"]: r for r in client.get("/v1/training/steps").json()["data"]}
        assert rows[1]["state"] == "promoted" and rows[0]["state"] == "superseded"
        refused = health["rollback_refused"]
        assert refused["step"] == 1 and refused["decision"] == "rolled_back"
        assert refused["reason"].startswith("dropped against step 0, which it replaced, but step 1 of 'agent' cannot")
        assert health["status"] == "ok" and health["serving_step"] == 1
        assert [session(client, f"after-{i}", drops_once_promoted) for i in range(3)] == [["1", "1"]] * 3
    assert "the canary did not record step 1 of agent as rolled_back" in caplog.text


def test_a_rollback_with_no_step_to_serve_again_is_refused_on_either_backend(either_backend, tmp_path):
    """Step 0 replaced no step: rolling it back would leave no promoted step, and every gateway
    would go on serving the step rolled back while /healthz said none serves. Refused, as above."""
    store = either_backend
    path = tmp_path / "0000"
    path.mkdir()
    (path / "adapter_config.json").write_text("{}")
    store.insert_step("agent", 0, str(path), {}, [])
    with pytest.raises(Conflict) as refused:
        store.decide_step("agent", 0, "rolled_back", {"by": "api"})
    assert refused.value.code == "nothing_to_roll_back_to"
    assert refused.value.message == (
        "step 0 of 'agent' cannot be rolled back: it replaced no step, so no step would serve; step 0 keeps serving"
    )
    assert store.serving_step("agent") == 0


def test_healthz_says_when_the_serving_step_does_not_load(tmp_path):
    """The serving step's files removed by hand: NAME goes on answering with the step it has, and
    /healthz says why that is not the store's serving step rather than a bare `ok`."""
    settings = canary_settings(tmp_path, promote="manual")
    publisher = Publisher(settings)
    publisher.publish(0, state="promoted")
    publisher.publish(1, state="promoted")
    shutil.rmtree(settings.checkpoints_dir() / "0001")
    with ThreadServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        health = client.get("/healthz").json()
        assert health["step"] == 0 and health["serving_step"] == 1
        error = health["serving_load_error"]
        assert error.startswith("step 1 does not load (NotFound: no PEFT adapter at ") and "is missing" in error
        assert error.endswith("; 'agent' answers with step 0 meanwhile, retrying every poll")
        assert session(client, "s", lambda step: 1.0) == ["0", "0"]
