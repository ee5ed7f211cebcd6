"""Rewards that come after their group is done: a gateway (openai engine, the fake upstream),
the official `openai` client and a real trainer step on the tiny model, in the order a harness
that reuses a group id meets them (the README's example names its group "two-plus-two")."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

from tests.fake_upstream import FakeUpstream
from tests.helpers_trainer import trainer_settings
from tests.helpers_upstream import openai_gateway
from trainer.worker import TrainerWorker


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A gateway whose trainer took one step: group "two-plus-two" trained, "flat" (every reward
    the same) set aside. Yields the gateway's URL."""
    state = tmp_path_factory.mktemp("state")
    with FakeUpstream() as upstream, openai_gateway(upstream.url, state) as (server, services):
        for group_id, rewards in (("two-plus-two", [1.0, 0.0]), ("flat", [1.0, 1.0])):
            for reward in rewards:
                assert rollout(server.url, group_id, reward).status_code == 200
            httpx.post(f"{server.url}/v1/groups/{group_id}/close", json={}).raise_for_status()
        settings = trainer_settings(state, groups_per_step=1, engine="openai", upstream_url=upstream.url)
        worker = TrainerWorker(settings, store=services.store)
        worker.start()
        try:
            assert worker.train_once(worker.groups_to_train()) is not None
        finally:
            worker.close()
        yield server.url


def rollout(url: str, group_id: str, reward: float, session_id: str | None = None) -> httpx.Response:
    """One rollout as the README's agent makes it: a call, then its reward (the response)."""
    session_id = session_id or uuid.uuid4().hex
    client = openai.OpenAI(
        base_url=f"{url}/v1",
        api_key="none",
        max_retries=0,
        default_headers={"X-Session-Id": session_id, "X-Group-Id": group_id},
    )
    client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "What is 2 + 2?"}])
    return httpx.post(f"{url}/v1/sessions/{session_id}/reward", json={"reward": reward})


def test_a_new_rollout_under_a_trained_groups_id_is_told_to_use_a_new_group_id(trained):
    assert httpx.get(f"{trained}/v1/groups/two-plus-two").json()["trained_step"] == 1
    # The harness runs its task again under the same group id: the call is served and kept, never
    # trained; the reward is refused, and the 409 said "post rewards before the group is ready",
    # which this session could not have done: it started after the step.
    answer = rollout(trained, "two-plus-two", 1.0, session_id="second-batch")
    assert answer.status_code == 409
    message = answer.json()["error"]["message"]
    assert "joined group 'two-plus-two' after the group was trained (step 1)" in message
    assert "give each new batch a new group id" in message and "before the group is ready" not in message
    (call,) = httpx.get(f"{trained}/v1/sessions/second-batch").json()["calls"]
    assert call["untrainable"].startswith("late: group 'two-plus-two' was already trained (step 1)")


def test_a_call_into_a_group_the_trainer_set_aside_is_marked_never_trained(trained):
    flat = httpx.get(f"{trained}/v1/groups/flat").json()
    assert flat["skipped"].startswith("no reward spread") and flat["trained_step"] is None
    # Its calls were recorded as trainable though the group never trains: now marked, as a call
    # into a trained group is.
    answer = rollout(trained, "flat", 0.0, session_id="into-flat")
    assert answer.status_code == 409
    assert "joined group 'flat' after the group was set aside (no reward spread" in answer.json()["error"]["message"]
    (call,) = httpx.get(f"{trained}/v1/sessions/into-flat").json()["calls"]
    assert call["untrainable"] == f"late: group 'flat' was set aside ({flat['skipped']}) when this call was recorded"
    tokens = httpx.get(f"{trained}/v1/sessions/into-flat/tokens").json()["calls"]
    assert tokens[0]["untrained_reason"] == call["untrainable"]


def test_a_session_that_was_in_the_group_before_the_step_keeps_the_usual_answer(trained):
    # A session of the group's own batch, posting late, could have posted in time: its 409 says so.
    (session,) = [s for s in httpx.get(f"{trained}/v1/groups/two-plus-two").json()["sessions"] if s["reward"] == 0.0]
    late = httpx.post(f"{trained}/v1/sessions/{session['id']}/reward", json={"reward": 0.5})
    assert late.status_code == 409
    assert "post rewards before the group is ready" in late.json()["error"]["message"].lower()


def test_a_reward_to_a_session_whose_every_call_failed_says_it_will_not_train(trained):
    # The agent's call failed (the upstream answered 503) and the harness scored the attempt 0, as
    # agents do: the answer said `trainable: true`, but the trainer leaves a session with nothing
    # answered out of its group. A live session in that state was already told; a harness's too now.
    client = openai.OpenAI(
        base_url=f"{trained}/v1",
        api_key="none",
        max_retries=0,
        default_headers={"X-Session-Id": "upstream-down", "X-Group-Id": "fresh-batch"},
    )
    with pytest.raises(openai.APIStatusError):
        client.chat.completions.create(model="agent", messages=[{"role": "user", "content": "[[status=503]] 2 + 2?"}])
    failed = httpx.post(f"{trained}/v1/sessions/upstream-down/reward", json={"reward": 0.0})
    assert failed.status_code == 200 and failed.json()["group_id"] == "fresh-batch"
    assert failed.json()["trainable"] is False
    assert failed.json()["reason"].startswith("no answered call: every call of the session failed")
    answered = rollout(trained, "fresh-batch", 1.0)
    assert answered.status_code == 200 and answered.json()["trainable"] is True
