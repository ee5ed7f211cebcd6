"""Promotion on the vllm engine: NAME is two adapters at once, and vLLM's own log says which
answered. A managed fake vLLM (tests/fake_vllm.py, on its Unix socket) logs the adapter name
each chat was sent with; the trainer is played by inserting step rows over PEFT-shaped files.

- `--promote canary`: a session whose share hash is below `--canary-share` goes to the
  candidate's adapter, every other to the incumbent's, every call of a session to one; a
  rejected candidate is unloaded from vLLM and answers NAME no more.
- `--promote manual`: NAME goes to the incumbent's adapter until the candidate is promoted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx

from gateway.app import create_app
from gateway.engines.vllm.build import vllm_engine
from gateway.promotion.canary import share_of
from gateway.store.sqlite import SQLiteStore
from tests.helpers import ThreadServer
from tests.helpers_vllm import FAKE_LAUNCHER, fake_state, make_adapter, vllm_settings, wait_until

SHARE = 0.4


@contextlib.contextmanager
def vllm_gateway(settings) -> Iterator[tuple[httpx.Client, SQLiteStore, str]]:
    """A gateway managing the fake vLLM; yields an HTTP client, the store and vLLM's URL."""
    engine = vllm_engine(settings, launcher=FAKE_LAUNCHER, startup_timeout=60)
    engine.supervisor.health_interval = 0.1
    store = SQLiteStore(settings.db_path)
    with ThreadServer(create_app(settings, engine=engine, store=store)) as server:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            yield client, store, engine.url


def publish(settings, store: SQLiteStore, step: int, state: str) -> None:
    path = make_adapter(settings.checkpoints_dir(), f"{step:04d}")
    store.insert_step("agent", step, str(path), {}, [], state=state)


def chats(vllm_url: str) -> list[str]:
    """The adapter (or base model) of every chat vLLM received, in order."""
    return [event["model"] for event in fake_state(vllm_url)["events"] if event["kind"] == "chat"]


def call(client: httpx.Client, vllm_url: str, store: SQLiteStore, sid: str) -> str:
    """One call of session `sid` for NAME; the adapter vLLM was asked for, checked against what
    the gateway said (X-Model-Step) and recorded (the call's step)."""
    before = len(chats(vllm_url))
    response = client.post(
        "/v1/chat/completions",
        headers={"X-Session-Id": sid},
        json={"model": "agent", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2},
    )
    assert response.status_code == 200, response.text
    (adapter,) = chats(vllm_url)[before:]
    step = adapter.removeprefix("agent@")
    assert response.headers["x-model-step"] == step
    assert store.session_calls(sid)[-1]["step"] == int(step)
    return adapter


def test_canary_on_vllm_sends_the_share_to_the_candidates_adapter_until_it_is_rejected(tmp_path):
    settings = vllm_settings(tmp_path, promote="canary", canary_share=SHARE)
    with vllm_gateway(settings) as (client, store, vllm_url):
        publish(settings, store, 0, "promoted")
        publish(settings, store, 1, "candidate")
        # Both adapters in vLLM at once: the incumbent's for NAME, the candidate's for its share.
        wait_until(lambda: {"agent@0", "agent@1"} <= set(fake_state(vllm_url)["loaded"]), what="both adapters")
        assert client.get("/healthz").json()["candidate_step"] == 1

        sessions = [f"s-{i}" for i in range(16)]
        served = {sid: [call(client, vllm_url, store, sid) for _ in range(2)] for sid in sessions}
        below = {sid for sid in sessions if share_of(f"session:{sid}") < SHARE}
        assert 0 < len(below) < len(sessions)  # both sides answered some sessions
        for sid, adapters in served.items():
            assert adapters == ["agent@1" if sid in below else "agent@0"] * 2, (sid, adapters)

        rejected = client.post("/v1/training/steps/1/reject", json={"model": "agent", "reason": "worse"})
        assert rejected.status_code == 200, rejected.text
        wait_until(lambda: "agent@1" not in fake_state(vllm_url)["loaded"], what="the rejected adapter to unload")
        # Neither a new session nor one that had the candidate gets it as NAME any more.
        assert call(client, vllm_url, store, "after") == "agent@0"
        assert call(client, vllm_url, store, sorted(below)[0]) == "agent@0"


def test_manual_on_vllm_sends_name_to_the_incumbent_until_the_candidate_is_promoted(tmp_path):
    settings = vllm_settings(tmp_path, promote="manual")
    with vllm_gateway(settings) as (client, store, vllm_url):
        publish(settings, store, 0, "promoted")
        wait_until(lambda: "agent@0" in fake_state(vllm_url)["loaded"], what="the incumbent to load")
        publish(settings, store, 1, "candidate")
        assert [call(client, vllm_url, store, f"m-{i}") for i in range(4)] == ["agent@0"] * 4

        promoted = client.post("/v1/training/steps/1/promote", json={"model": "agent", "reason": "looks good"})
        assert promoted.status_code == 200, promoted.text
        assert [call(client, vllm_url, store, f"n-{i}") for i in range(4)] == ["agent@1"] * 4
        steps = {row["step"]: row["state"] for row in client.get("/v1/training/steps").json()["data"]}
        assert steps == {0: "superseded", 1: "promoted"}
