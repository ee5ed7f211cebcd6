"""A call's step is what served it (issue 38, item 3). A run started with `--init-from` has
another run's adapter as its step 0, and the base model is not that policy: the gateway answers
NAME only once step 0 is loaded (503 with the reason before, and `/healthz` says `loading`), and a
call the base model answered (step None) is never read as step 0, neither by the trainer's
staleness screen nor by live groups. In a cold run step 0 is the untrained LoRA, which equals
the base model: there its calls still count as step 0."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from gateway.app import create_app
from gateway.cli import main
from gateway.models.registry import resolve_base_model
from gateway.settings import Settings
from gateway.store import CallRecord
from gateway.store.sqlite import SQLiteStore
from tests.helpers import ThreadServer
from tests.helpers_trainer import Recorder, trainer_settings
from tests.test_hotswap import save_adapter

# The adapters here put a LoRA on the tiny model's tied output head, as the trainer does for it.
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*tie_word_embeddings"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing"),
]

LOADING = "loading step 0 of 'agent-rl' from --init-from sft@4"
BY_BASE = "answered by the base model, not by a step of this run: its step 0 is the adapter of --init-from sft@0"


def chat(http: httpx.Client, session_id: str, **body) -> httpx.Response:
    return http.post(
        "/v1/chat/completions",
        json={"model": "agent-rl", "messages": [{"role": "user", "content": "Say something."}], **body},
        headers={"X-Session-Id": session_id},
    )


def test_name_answers_only_once_its_init_from_step_0_is_loaded(tmp_path):
    settings = Settings(state_dir=tmp_path, model_name="agent-rl", init_from="sft@4", trainer="off", poll_interval=0.1)
    trainer = SQLiteStore(settings.db_path)  # plays the trainer: its own connection
    with ThreadServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        health = http.get("/healthz")
        assert health.status_code == 503
        assert health.json()["status"] == "loading" and health.json()["reason"] == LOADING
        for stream in (False, True):
            refused = chat(http, "early", max_tokens=4, stream=stream)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "loading_step_0"
            assert LOADING in refused.json()["error"]["message"]
        # the trainer starts: sft@4's adapter saved as step 0 of agent-rl, then its step row
        path = settings.checkpoints_dir() / "0000"
        path.parent.mkdir(parents=True)
        save_adapter(Path(resolve_base_model(settings.base_model, tmp_path)), path, seed=4)
        trainer.insert_step("agent-rl", 0, str(path.resolve()), {"init_from": "sft@4"}, [])
        deadline = time.monotonic() + 120  # a hang guard, not a speed requirement
        while (health := http.get("/healthz")).status_code != 200:
            assert time.monotonic() < deadline, health.text
            time.sleep(0.05)
        assert health.json()["status"] == "ok" and health.json()["step"] == 0
        answered = chat(http, "late", max_tokens=4)
        assert answered.status_code == 200 and answered.headers["x-model-step"] == "0"
        (late,) = http.get("/v1/sessions/late").json()["calls"]
        assert late["step"] == 0 and late["served"] == "agent-rl@0"
        early = http.get("/v1/sessions/early").json()["calls"]
        assert [(c["status"], c["http_status"], c["step"]) for c in early] == [("error", 503, None)]
    asyncio.run(trainer.close())


def test_name_says_step_0_will_not_come_once_the_trainer_that_saves_it_failed(tmp_path):
    # `serve --trainer auto --init-from sft@4` whose trainer refuses its settings (exit 2): /healthz
    # said why, but every call was told "The trainer saves it when it starts; try again shortly",
    # and a client retried for ever a step 0 that will never come.
    import sys

    from gateway.trainer_process import TrainerChild

    said = "import sys; print('rlproxy train: --init-from sft@4: LoRA rank 8, not 16', file=sys.stderr); sys.exit(2)"
    child = TrainerChild([sys.executable, "-c", said], {}).start()
    child._thread.join(timeout=60)
    assert child.status()["state"] == "failed"
    settings = Settings(state_dir=tmp_path, model_name="agent-rl", init_from="sft@4", trainer="off")
    app = create_app(settings)
    app.state.trainer = child  # as `rlproxy serve` sets it
    why = f"{LOADING}; the trainer that saves it failed: --init-from sft@4: LoRA rank 8, not 16"
    with ThreadServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get("/healthz").json()["reason"] == why
        for stream in (False, True):
            refused = chat(http, "early", max_tokens=4, stream=stream)
            assert refused.status_code == 503, refused.text
            error = refused.json()["error"]
            assert error["code"] == "trainer_failed"
            assert error["message"] == (
                f"model 'agent-rl' does not answer: {why}. It will not until that is fixed and the gateway "
                "restarted (GET /healthz: trainer)"
            )
    child.stop(timeout=10)


def test_the_trainer_skips_groups_the_base_model_answered_in_an_init_from_run(tmp_path):
    settings = trainer_settings(tmp_path, model_name="agent-rl")
    train = ["train", "--state-dir", str(tmp_path), "--lora-rank", "4", "--lora-alpha", "8"]
    train += ["--max-tokens-per-row", "256", "--groups-per-step", "1"]
    assert main([*train, "--model-name", "sft", "--max-steps", "0"]) == 0  # the run it starts from: sft@0
    recorder = Recorder(settings)
    recorder.group("by-base", [1.0, 0.0], step=None)  # a gateway not told --init-from: the base model answered
    recorder.group("by-step-0", [1.0, 0.0], step=0)
    recorder.close()
    assert main([*train, "--model-name", "agent-rl", "--init-from", "sft@0", "--max-steps", "1"]) == 0
    store = SQLiteStore(settings.db_path)
    by_base, by_step_0 = store.get_group("by-base"), store.get_group("by-step-0")
    assert by_base["skipped"] == BY_BASE and by_base["trained_step"] is None
    assert by_step_0["skipped"] is None and by_step_0["trained_step"] == 1
    assert [(s["step"], s["groups"]) for s in store.steps("agent-rl")] == [(0, []), (1, ["by-step-0"])]
    asyncio.run(store.close())


def answered(session_id: str, model: str, step: int | None) -> CallRecord:
    """An ungrouped call the local engine answered with `step` (None: the base model)."""
    return CallRecord(
        id=f"{session_id}-c",
        session_id=session_id,
        group_id=None,
        task_key="key",
        split="train",
        model=model,
        served="base" if step is None else f"{model}@{step}",
        step=step,
        engine="local",
        stream=False,
        status="ok",
        request={"messages": [{"role": "user", "content": "x"}]},
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": "Y"}}]},
        latency_ms=1.0,
    )


def test_a_live_reward_for_a_base_model_answer_of_an_init_from_run_is_kept_and_never_trained(tmp_path, upstream):
    store = SQLiteStore(tmp_path / "rlproxy.db")
    for session_id, model, step in (
        ("early", "agent-rl", None),
        ("by-base", "agent-rl", None),
        ("by-0", "agent-rl", 0),
        ("by-0-too", "agent-rl", 0),
        ("cold-by-base", "cold", None),
        ("cold-by-0", "cold", 0),
    ):
        store.record_call_sync(answered(session_id, model, step))
    settings = Settings(
        state_dir=tmp_path, engine="openai", upstream_url=upstream.url, trainer="off", live_group_size=2
    )
    with ThreadServer(create_app(settings)) as server, httpx.Client(base_url=server.url) as http:

        def reward(session_id: str) -> dict:
            answer = http.post(f"/v1/sessions/{session_id}/reward", json={"reward": 1.0})
            assert answer.status_code == 200, answer.text
            return answer.json()

        assert reward("early")["trainable"]  # before step 0 is saved, nothing says what it is
        store.insert_step("agent-rl", 0, "/ckpt/0", {"init_from": "sft@4"}, [])  # the trainer seeds step 0
        by_base = reward("by-base")
        assert by_base["trainable"] is False
        assert by_base["reason"].startswith("answered by the base model, which is not this run's policy")
        first, second = reward("by-0"), reward("by-0-too")
        assert first["trainable"] and second["group_id"] == first["group_id"]
        group = http.get(f"/v1/groups/{first['group_id']}").json()
        assert sorted(s["id"] for s in group["sessions"]) == ["by-0", "by-0-too"]  # "early" left it
        early = http.get("/v1/sessions/early").json()
        assert early["group_id"] is None and early["untrained_reason"].startswith("answered by the base model")
        # a cold run: step 0 is the untrained LoRA, which the base model equals
        store.insert_step("cold", 0, "/ckpt/0", {}, [])
        cold = [reward("cold-by-base"), reward("cold-by-0")]
        assert all(r["trainable"] for r in cold) and cold[0]["group_id"] == cold[1]["group_id"]
    asyncio.run(store.close())
