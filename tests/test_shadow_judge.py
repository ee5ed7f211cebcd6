"""A shadow group's judge that fails: the judgement is tried again a bounded number of times,
then the group is set aside as failed, with the reason, instead of staying pending for ever
(nothing but its judge ever rewards a shadow group)."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from gateway.app import create_app
from gateway.ruler.scoring import STOPPED
from gateway.shadow import sampler
from tests.helpers import ThreadServer
from tests.helpers_judge import FakeJudge
from tests.helpers_vllm import wait_until
from tests.test_shadow import ask, live_call, shadow_settings
from tests.test_shadow_discard import _shadows


@pytest.fixture(autouse=True)
def no_wait_between_tries(monkeypatch):
    monkeypatch.setattr(sampler, "JUDGE_RETRY_S", (0.0, 0.0))


def settled(server, call_id: str) -> dict:
    """The shadow group of `call_id` once it is scored or set aside."""

    def look():
        response = httpx.get(f"{server.url}/v1/groups/shadow-{call_id}")
        group = response.json() if response.status_code == 200 else {}
        return group if group.get("ruler_status") == "scored" or group.get("failed") else None

    return wait_until(look, what=f"the shadow group of {call_id} to be scored or set aside")


def judged(server, call_id: str, status: str) -> dict | None:
    """The shadow group of `call_id` once its `ruler_status` is `status`."""
    response = httpx.get(f"{server.url}/v1/groups/shadow-{call_id}")
    group = response.json() if response.status_code == 200 else {}
    return group if group.get("ruler_status") == status else None


def group_ids(server, **params) -> list[str]:
    return [g["id"] for g in httpx.get(f"{server.url}/v1/groups", params=params).json()["data"]]


def test_a_judge_that_answers_wrongly_once_does_not_cost_the_group(tmp_path):
    # The first judgement fails (a wrong answer, then a wrong answer to the retry); the next one scores.
    with FakeJudge(answers=["not json", "still not json"]) as judge:
        with ThreadServer(create_app(shadow_settings(tmp_path, judge.url))) as server:
            call_id, _ = ask(server, "flaky-judge-1", temperature=1.0)
            group = settled(server, call_id)
            metrics = httpx.get(f"{server.url}/metrics").text
    assert group["ruler_status"] == "scored" and group["failed"] is None
    assert group["n_rewarded"] == group["n_sessions"] >= 2
    assert 'rlproxy_shadow_judge_calls_total{outcome="failed"} 1.0' in metrics
    assert 'rlproxy_shadow_judge_calls_total{outcome="scored"} 1.0' in metrics
    assert 'rlproxy_shadow_calls_total{outcome="completed"} 1.0' in metrics


def test_a_judge_that_keeps_failing_sets_the_group_aside_as_failed_not_pending(tmp_path):
    with FakeJudge(status=500) as judge:
        with ThreadServer(create_app(shadow_settings(tmp_path, judge.url))) as server:
            call_id, _ = ask(server, "judge-down-1", temperature=1.0)
            group = settled(server, call_id)
            pending, failed = group_ids(server, state="pending"), group_ids(server, state="failed")
            metrics = httpx.get(f"{server.url}/metrics").text
            reward = httpx.post(f"{server.url}/v1/sessions/{group['sessions'][1]['id']}/reward", json={"reward": 1.0})
    assert group["failed"].startswith(f"RULER could not judge it in {sampler.JUDGE_TRIES} tries; the last: ")
    assert "HTTP 500" in group["failed"] and group["ruler_status"] == "failed"
    assert group["id"] not in pending and group["id"] in failed
    assert f'rlproxy_shadow_judge_calls_total{{outcome="failed"}} {sampler.JUDGE_TRIES}.0' in metrics
    assert 'rlproxy_shadow_calls_total{outcome="failed_judge"} 1.0' in metrics
    # Set aside for good: a reward for one of its sessions is refused, as for any group set aside.
    # Set aside by its judge giving up, not by the trainer: the 409 says who.
    message = reward.json()["error"]["message"]
    assert reward.status_code == 409 and "RULER could not judge it" in message
    assert "set aside once its RULER judge gave up" in message and "trainer" not in message


def test_a_gateway_stopped_between_two_tries_of_the_judge_judges_the_group_again_once_restarted(tmp_path, monkeypatch):
    monkeypatch.setattr(sampler, "JUDGE_RETRY_S", (600.0, 600.0))  # stopped while it waits for its second try
    with FakeJudge(answers=["not json", "still not json"]) as judge:
        settings = shadow_settings(tmp_path, judge.url)
        with ThreadServer(create_app(settings)) as server:
            call_id, _ = ask(server, "stopped-between-tries-1", temperature=1.0)
            waiting = wait_until(lambda: judged(server, call_id, "failed"), what="the first judgement to fail")
        with ThreadServer(create_app(settings)) as server:
            group = settled(server, call_id)
    assert waiting["ruler_error"].startswith("the judge answered wrongly twice")
    assert group["ruler_status"] == "scored" and group["failed"] is None and group["closed"]
    assert group["n_rewarded"] == group["n_sessions"] >= 2  # ready for the trainer
    assert len(judge.bodies) == 3  # the first judgement and its retry, then one after the restart


@pytest.fixture
def store(either_backend):
    return either_backend


def test_only_a_shadow_group_whose_judgement_failed_is_set_aside_on_either_backend(store):
    for live in (live_call(), live_call(id="req-2", session_id="s-2")):
        store.record_call_sync(live)
        asyncio.run(store.record_shadow_group(_shadows(live)))
    asyncio.run(store.set_ruler_status("shadow-req-1", "failed", "the judge is down"))
    asyncio.run(store.set_ruler_status("shadow-req-2", "scored"))  # a manual judgement won meanwhile
    assert asyncio.run(store.give_up_shadow_group("shadow-req-1", "RULER could not judge it")) is True
    assert asyncio.run(store.give_up_shadow_group("shadow-req-1", "again")) is False  # once
    assert asyncio.run(store.give_up_shadow_group("shadow-req-2", "RULER could not judge it")) is False
    assert store.get_group("shadow-req-1")["failed"] == "RULER could not judge it"
    assert store.get_group("shadow-req-2")["failed"] is None


def test_a_group_a_shutdown_left_unjudged_is_taken_up_by_one_gateway_only_on_either_backend(store):
    def stopped(group_id: str) -> str:
        return STOPPED.format(group_id=group_id)

    lives = [live_call(), live_call(id="req-2", session_id="s-2"), live_call(id="req-3", session_id="s-3")]
    for live in lives:
        store.record_call_sync(live)
        asyncio.run(store.record_shadow_group(_shadows(live)))
    asyncio.run(store.stop_shadow_judgement("shadow-req-1", stopped("shadow-req-1")))  # recorded, not judged yet
    asyncio.run(store.set_ruler_status("shadow-req-2", "failed", "the judge is down"))  # its sampler tries again
    asyncio.run(store.set_ruler_status("shadow-req-3", "scored"))  # a manual judgement won before the stop
    asyncio.run(store.stop_shadow_judgement("shadow-req-3", stopped("shadow-req-3")))
    # Two gateways starting on the store: the first takes the group, the second finds none left.
    assert asyncio.run(store.claim_stopped_shadow_group(stopped)) == "shadow-req-1"
    assert asyncio.run(store.claim_stopped_shadow_group(stopped)) is None
    assert store.get_group("shadow-req-1")["ruler_status"] is None  # taken: the judgement marks it running
    assert store.get_group("shadow-req-2")["ruler_error"] == "the judge is down"
    assert store.get_group("shadow-req-3")["ruler_status"] == "scored"


def test_a_group_a_client_judged_between_two_tries_keeps_the_clients_judgement(tmp_path, monkeypatch):
    retry = threading.Event()

    async def wait_for_the_test(self, attempt: int) -> None:  # the wait before the next try, ended by the test
        await asyncio.to_thread(retry.wait, 60)

    monkeypatch.setattr(sampler.ShadowSampler, "_wait_to_retry", wait_for_the_test)
    with FakeJudge(answers=["not json", "still not json"]) as shadow_judge, FakeJudge() as manual_judge:
        settings = shadow_settings(tmp_path, shadow_judge.url).model_copy(
            update={"judge_model": ["openai/manual"], "judge_api_base": [manual_judge.url]}
        )
        with ThreadServer(create_app(settings)) as server:
            call_id, _ = ask(server, "judged-meanwhile-1", temperature=1.0)
            wait_until(lambda: judged(server, call_id, "failed"), what="the first judgement to fail")
            manual = httpx.post(
                f"{server.url}/v1/groups/shadow-{call_id}/ruler",
                json={"judge_model": "openai/manual", "judge_api_base": manual_judge.url},
                timeout=60,
            )
            retry.set()
            wait_until(
                lambda: (
                    httpx.get(f"{server.url}/v1/dashboard").json()["live_traffic"]["shadow_samples"]["in_flight"] == 0
                ),
                what="the sampler to be done with the group",
            )
            group = httpx.get(f"{server.url}/v1/groups/shadow-{call_id}").json()
    assert manual.status_code == 200, manual.text
    assert len(shadow_judge.bodies) == 2  # the failed judgement and its retry; not asked again once scored
    assert group["ruler_status"] == "scored" and group["failed"] is None
    assert {j["judge_model"] for j in group["judgements"]} == {"openai/manual"}
