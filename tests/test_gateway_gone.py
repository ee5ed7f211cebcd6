"""A gateway killed without a clean stop (SIGKILL, out of memory) while RULER judged its groups:
its heartbeat row expires, and a gateway still running on the store hands its judgements on
(gateway/ruler/watch.py, gateway/store/gateways.py). A shadow group is judged again, once, by a
gateway with shadow samples; a client's judgement is marked stopped, as a clean stop marks it,
so `GET /v1/groups/{id}` says to POST it again instead of showing "running" for ever."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from unittest import mock

import httpx
import openai
import pytest

from gateway.ruler.watch import stopped
from tests.helpers import gateway_process
from tests.helpers_judge import FakeJudge
from tests.helpers_vllm import wait_until
from tests.test_shadow import MESSAGES, live_call
from tests.test_shadow_discard import _shadows

HEARTBEAT_S, LEASE_S = 0.2, 3.0  # short, so that the test waits seconds, not a minute
# The CLI, with the heartbeat's constants set first (the gateway's own, else: 10 s and 60 s).
SHORT_LEASE = (
    "-c",
    f"from gateway.ruler import watch; watch.HEARTBEAT_S, watch.LEASE_S = {HEARTBEAT_S}, {LEASE_S}; "
    "from gateway.cli import run; run()",
)


def serve(tmp_path, store: str, name: str, judge_url: str) -> contextlib.AbstractContextManager:
    """A gateway with shadow samples judged at `judge_url`, on the store all the test's gateways share."""
    flags = ["--engine", "local", "--trainer", "off", "--insecure-no-api-key", "--default-max-tokens", "6"]
    flags += ["--state-dir", str(tmp_path / name), "--store", store, "--shadow-samples", "2"]
    flags += ["--shadow-judge-model", "openai/judge", "--shadow-judge-api-base", judge_url]
    return gateway_process(flags, startup_timeout=300, python_args=SHORT_LEASE)


def group(url: str, group_id: str) -> dict:
    return httpx.get(f"{url}/v1/groups/{group_id}").json()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_a_killed_gateways_judgements_are_handed_on_by_a_gateway_still_running(tmp_path, request, backend):
    # Two replicas on one store (an SQLite file both open, or PostgreSQL); the first is killed.
    store = str(tmp_path / "shared.db") if backend == "sqlite" else request.getfixturevalue("postgres_db")
    with FakeJudge(stall=True) as stalled, FakeJudge() as judge:
        with (
            serve(tmp_path, store, "a", stalled.url) as (doomed, doomed_url),
            serve(tmp_path, store, "b", judge.url) as (_, url),
        ):
            client = openai.OpenAI(base_url=doomed_url + "/v1", api_key="unused", max_retries=0)
            # A live call whose shadow group the doomed gateway is judging when it is killed ...
            raw = client.chat.completions.with_raw_response.create(
                model="agent", messages=MESSAGES, temperature=1.0, extra_headers={"X-Session-Id": "live-1"}
            )
            shadow = "shadow-" + raw.headers["x-request-id"]
            # ... and a group of two rollouts whose client asked it for RULER's scores (and left).
            for session in ("rollout-1", "rollout-2"):
                client.chat.completions.create(
                    model="agent", messages=MESSAGES, extra_headers={"X-Session-Id": session, "X-Group-Id": "g-1"}
                )
            with contextlib.suppress(httpx.TimeoutException):
                body = {"judge_model": "openai/judge", "judge_api_base": stalled.url}
                httpx.post(f"{doomed_url}/v1/groups/g-1/ruler", json=body, timeout=1.0)
            for group_id in (shadow, "g-1"):
                wait_until(lambda g=group_id: group(url, g)["ruler_status"] == "running", what=f"{group_id} judged")
            os.killpg(doomed.pid, signal.SIGKILL)  # no shutdown: nothing marks its judgements
            doomed.wait(timeout=30)

            scored = wait_until(
                lambda: (g := group(url, shadow))["ruler_status"] == "scored" and g,
                what="the shadow group judged again by the gateway still running",
            )
            left = wait_until(lambda: (g := group(url, "g-1"))["ruler_status"] != "running" and g, what="g-1 marked")
            time.sleep(3 * LEASE_S)  # heartbeats and looks for stopped groups go on: none takes it again
            again = group(url, shadow)
    assert scored["n_rewarded"] == scored["n_sessions"] == 3 and scored["closed"]  # ready for the trainer
    assert len(judge.bodies) == 1 and again["judgements"] == scored["judgements"]  # judged again once
    assert left["ruler_status"] == "failed" and left["ruler_error"] == stopped("g-1")  # "POST ... again"


@pytest.fixture
def store(either_backend):
    return either_backend


def harness_group(store, group_id: str) -> None:
    store.record_call_sync(live_call(id=f"call-{group_id}", session_id=f"s-{group_id}", group_id=group_id))


def test_a_gone_gateways_judgements_are_handed_on_once_on_either_backend(store):
    async def main():
        await store.beat_gateway("alive", 60.0)
        await store.beat_gateway("gone", -1.0)  # its lease ran out: killed a while ago
        for live in (live_call(), live_call(id="req-2", session_id="s-2")):
            store.record_call_sync(live)
        await store.record_shadow_group(_shadows(live_call()), owner="gone")
        await store.record_shadow_group(_shadows(live_call(id="req-2", session_id="s-2")), owner="alive")
        harness_group(store, "g-running")
        harness_group(store, "g-scored")
        await store.set_ruler_status("g-running", "running", owner="gone")  # the client's judgement, cut short
        await store.set_ruler_status("g-scored", "running", owner="gone")
        await store.record_judgement("g-scored", "openai/judge", [{"trajectory_id": "s-g-scored", "score": 1.0}])
        # Two gateways reap at once: the first hands the gone one's judgements on, the second finds none.
        first, second = await store.reap_gateways(stopped), await store.reap_gateways(stopped)
        # A gateway with shadow samples takes the shadow group up; one looking after it finds none.
        taken = [await store.claim_stopped_shadow_group(stopped, "alive") for _ in range(2)]
        return first, second, taken

    first, second, taken = asyncio.run(main())
    assert first == ["g-running", "shadow-req-1"] and second == []
    assert taken == ["shadow-req-1", None]
    running = store.get_group("g-running")
    assert running["ruler_status"] == "failed" and running["ruler_error"] == stopped("g-running")
    assert store.get_group("g-scored")["ruler_status"] == "scored"  # finished before: left as it was
    assert store.get_group("shadow-req-2")["ruler_status"] is None  # its gateway runs: not touched
    assert store.get_group("shadow-req-1")["judged_by"] == "alive"  # judged there now


def test_a_gateway_that_stops_hands_on_at_once_what_it_could_not_mark_on_either_backend(store):
    async def main():
        await store.beat_gateway("leaving", 60.0)
        store.record_call_sync(live_call())
        await store.record_shadow_group(_shadows(live_call()), owner="leaving")
        return await store.leave_gateway("leaving", stopped), await store.reap_gateways(stopped)

    left, reaped = asyncio.run(main())
    assert left == ["shadow-req-1"] and reaped == []
    assert store.get_group("shadow-req-1")["ruler_error"] == stopped("shadow-req-1")


def test_judgements_a_store_held_before_the_heartbeat_are_handed_on_too_on_either_backend(store):
    # A gateway of an older rlproxy, killed mid-judgement, left a group "running" that names no
    # gateway; then rlproxy is upgraded (the column `judged_by` added) and a gateway starts.
    harness_group(store, "g-orphan")
    asyncio.run(store.set_ruler_status("g-orphan", "running"))
    if store.backend == "sqlite":
        store._conn.execute("DROP INDEX groups_judged_by")
        store._conn.execute("ALTER TABLE groups DROP COLUMN judged_by")
    else:
        import psycopg

        with psycopg.connect(store.url, autocommit=True) as conn:
            conn.execute("ALTER TABLE groups DROP COLUMN judged_by")
    asyncio.run(store.close())
    upgraded = type(store)(store.path)
    try:
        assert asyncio.run(upgraded.reap_gateways(stopped)) == []  # an older replica may still be judging it
        upgraded._run_sync(lambda conn: conn.execute("UPDATE gateways SET expires_at = 0"))  # half an hour later
        assert asyncio.run(upgraded.reap_gateways(stopped)) == ["g-orphan"]
        assert upgraded.get_group("g-orphan")["ruler_error"] == stopped("g-orphan")
    finally:
        asyncio.run(upgraded.close())


def test_replicas_whose_clocks_disagree_by_more_than_a_lease_take_no_live_gateway_for_gone(postgres_db):
    # Two replicas on one PostgreSQL store, on hosts whose clocks are four minutes apart (NTP off, a VM
    # resumed). Each wrote its heartbeat in its own host's time: the one ahead took the other for gone
    # at every beat and handed its judgements on while they ran (a shadow group judged twice). Rows are
    # now written and compared in the database's clock, so the hosts' clocks do not matter.
    from gateway.store.postgres import PostgresStore

    real = time.time

    def host_clock(offset: float):  # this host's time.time(), `offset` seconds off the true time
        return mock.patch("time.time", lambda: real() + offset)

    ahead, behind = PostgresStore(postgres_db), PostgresStore(postgres_db)

    async def main():
        with host_clock(-120):
            await behind.beat_gateway("behind", 60.0)
            behind.record_call_sync(live_call())
            await behind.record_shadow_group(_shadows(live_call()), owner="behind")  # its sampler judges it
        with host_clock(+120):
            await ahead.beat_gateway("ahead", 60.0)
            by_ahead = await ahead.reap_gateways(stopped)
        with host_clock(-120):
            by_behind = await behind.reap_gateways(stopped)
            await behind.beat_gateway("behind", -1.0)  # then it is killed: its lease runs out
        with host_clock(+120):
            gone = await ahead.reap_gateways(stopped)
        return by_ahead, by_behind, gone

    try:
        by_ahead, by_behind, gone = asyncio.run(main())
        assert by_ahead == [] and by_behind == []  # both alive: neither takes the other for gone
        assert gone == ["shadow-req-1"]  # a gateway gone is still found, whatever the clocks say
    finally:
        for store in (ahead, behind):
            asyncio.run(store.close())
