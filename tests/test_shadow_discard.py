"""A discarded session's shadow groups: they hold a copy of its answer and samples of its prompt
under other session ids, so the discard reaches them too, and a shadow group of a session
discarded while its shadows were sampled is never recorded (gateway/store/shadows.py)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.app import create_app
from gateway.engines.base import ChoiceTokens, TokenRecord
from gateway.errors import NotFound
from gateway.shadow.calls import shadow_calls
from tests.helpers import ThreadServer
from tests.helpers_judge import FakeJudge
from tests.test_shadow import ask, judged_group, live_call, shadow_settings


def test_discarding_a_shadowed_session_keeps_its_shadow_group_out_of_training(tmp_path):
    with FakeJudge() as judge, ThreadServer(create_app(shadow_settings(tmp_path, judge.url))) as server:
        call_id, _ = ask(server, "failed-rollout", temperature=1.0)
        assert judged_group(server, call_id)["ready"]  # judged: the trainer would take it
        discarded = httpx.post(f"{server.url}/v1/sessions/failed-rollout/discard", json={"reason": "the tool crashed"})
        assert discarded.status_code == 200 and discarded.json()["discarded"]
        group = httpx.get(f"{server.url}/v1/groups/shadow-{call_id}").json()
        assert not group["ready"] and group["sessions"] == []
        assert {s["discard_reason"] for s in group["discarded_sessions"]} == {
            "the live session 'failed-rollout' this group shadows was discarded"
        }


@pytest.fixture
def store(either_backend):
    return either_backend


def _shadows(live) -> list:
    tokens = TokenRecord(prompt_ids=[1, 2], choices=[ChoiceTokens(completion_ids=[4], logprobs=[-0.3])])
    response = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "B"}}]}
    return shadow_calls(live, response, tokens, 1.0)


def test_a_shadow_group_of_a_session_discarded_while_it_sampled_is_not_recorded(store):
    live = live_call()
    store.record_call_sync(live)
    asyncio.run(store.discard_session("s-1", "a failed rollout"))
    assert asyncio.run(store.record_shadow_group(_shadows(live))) is None
    assert store.ready_groups("agent") == []
    with pytest.raises(NotFound):
        store.get_group("shadow-req-1")


def test_a_discard_reaches_the_shadow_groups_of_its_calls_on_either_backend(store):
    live, other = live_call(), live_call(id="req-2", session_id="s-2")
    for call in (live, other):
        store.record_call_sync(call)
        group_id = asyncio.run(store.record_shadow_group(_shadows(call)))
        for i, session in enumerate(store.get_group(group_id)["sessions"]):
            asyncio.run(store.set_reward(session["id"], float(i)))
        asyncio.run(store.close_group(group_id))  # as RULER's judgement leaves it
    asyncio.run(store.discard_session("s-1"))
    assert [g["id"] for g in store.ready_groups("agent")] == ["shadow-req-2"]
    assert store.get_group("shadow-req-1")["n_discarded"] == 2


def test_the_sampler_counts_a_shadow_of_a_discarded_session_as_dropped_and_never_judges_it(tmp_path):
    from types import SimpleNamespace

    from gateway.metrics import Metrics
    from gateway.settings import Settings
    from gateway.shadow.sampler import ShadowSampler
    from tests.test_shadow import _Engine, _Gate, _Registry

    judged: list[str] = []

    class _Store:
        async def record_shadow_group(self, calls, owner=None):
            return None  # the live session was discarded while its shadows were sampled

    class _Ruler:
        async def score_group(self, group_id, *args):
            judged.append(group_id)

    services = SimpleNamespace(
        chat=SimpleNamespace(gate=_Gate(), registry=_Registry(), engine=_Engine()),
        store=_Store(),
        extras={"ruler": _Ruler()},
    )
    settings = Settings(state_dir=tmp_path, shadow_samples=2, shadow_judge_model="openai/j")
    sampler = ShadowSampler(services, settings, Metrics(), seed=0)

    async def main():
        sampler(live_call(task_key="refunds"))
        await asyncio.gather(*sampler.tasks)

    asyncio.run(main())
    assert judged == [] and sampler.counts["dropped"] == 1 and sampler.counts["completed"] == 0
    assert sampler.summary()["by_task_key"]["refunds"]["dropped"] == 1


def test_a_discard_racing_the_record_of_a_shadow_group_still_reaches_it_on_postgres(postgres_db):
    """The discard lists the session's shadow groups, then waits for the session's row, which the
    shadow group's record holds until it commits: the group it could not list yet is found after."""
    import threading

    from gateway.store.discard import discard_session
    from gateway.store.postgres import PostgresStore
    from gateway.store.shadows import insert_shadow_group

    store = PostgresStore(postgres_db)
    live = live_call()
    store.record_call_sync(live)
    recorded, release = threading.Event(), threading.Event()

    def record(conn):
        insert_shadow_group(conn, _shadows(live), "shadow")
        recorded.set()
        release.wait()  # not committed yet: the discard starts meanwhile

    recording = threading.Thread(target=store._run_sync, args=(record,))
    discarding = threading.Thread(target=store._run_sync, args=(lambda conn: discard_session(conn, "s-1", None),))
    recording.start()
    recorded.wait()
    discarding.start()
    waiting = "SELECT COUNT(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
    while discarding.is_alive() and store._query(waiting)[0]["n"] == 0:  # until it waits for the session's row
        threading.Event().wait(0.01)
    release.set()
    recording.join()
    discarding.join()
    group = store.get_group("shadow-req-1")
    assert group["sessions"] == [] and group["n_discarded"] == 2
    asyncio.run(store.close())
