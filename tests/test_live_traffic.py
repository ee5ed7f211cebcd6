"""Live traffic (issue 30, Deliver 1): ungrouped sessions carry a task key (the URL, the header,
the metadata, or their system prompt), and with --live-group-size K their rewards gather them
into groups of K, one key at a time; a reward that comes after the policy moved on is stored
and marked, never trained."""

from __future__ import annotations

import asyncio
import hashlib
import random
import sqlite3

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.settings import Settings
from gateway.store import CallRecord, LiveRule, Store
from gateway.store.lineage import StepParents, chain_distance, further_than
from gateway.store.live import Policy, stale_reason
from tests.helpers import ThreadServer
from tests.helpers_vllm import wait_until

SYSTEM = "You are a billing assistant."


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    settings = Settings(
        state_dir=tmp_path_factory.mktemp("state"), trainer="off", default_max_tokens=4, live_group_size=3
    )
    with ThreadServer(create_app(settings)) as server:
        yield server


def chat(url: str, session_id: str, *, system: str | None = SYSTEM, headers=None, metadata=None) -> None:
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": "my invoice?"}
    ]
    extra = {"metadata": metadata} if metadata else None
    client.chat.completions.create(
        model="agent",
        messages=messages,
        max_tokens=4,
        extra_headers={"X-Session-Id": session_id, **(headers or {})},
        extra_body=extra,
    )


def session(server, session_id: str) -> dict:
    response = httpx.get(f"{server.url}/v1/sessions/{session_id}")
    response.raise_for_status()
    return response.json()


def reward(server, session_id: str, value: float) -> dict:
    response = httpx.post(f"{server.url}/v1/sessions/{session_id}/reward", json={"reward": value})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_task_key_comes_from_the_url_the_header_and_the_metadata(gateway):
    chat(f"{gateway.url}/tasks/refunds/sessions/tk-url/v1", "tk-url")
    chat(gateway.url + "/v1", "tk-header", headers={"X-Task-Id": "refunds"})
    chat(gateway.url + "/v1", "tk-metadata", metadata={"task_id": "refunds"})
    for session_id in ("tk-url", "tk-header", "tk-metadata"):
        assert session(gateway, session_id)["task_key"] == "refunds"
    # The header wins over the metadata, as for session and group ids.
    chat(gateway.url + "/v1", "tk-both", headers={"X-Task-Id": "from-header"}, metadata={"task_id": "from-body"})
    assert session(gateway, "tk-both")["task_key"] == "from-header"
    bad = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        headers={"X-Task-Id": "../etc/passwd"},
        json={"model": "agent", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert bad.status_code == 400 and "task_id" in bad.json()["error"]["message"]


def test_without_a_key_the_system_prompt_is_the_key(gateway):
    chat(gateway.url + "/v1", "sys-a")
    chat(gateway.url + "/v1", "sys-b")
    chat(gateway.url + "/v1", "sys-other", system="You are a travel agent.")
    chat(gateway.url + "/v1", "sys-none", system=None)
    expected = "system:" + hashlib.sha256(SYSTEM.encode()).hexdigest()[:16]
    assert session(gateway, "sys-a")["task_key"] == session(gateway, "sys-b")["task_key"] == expected
    assert session(gateway, "sys-other")["task_key"] not in (expected, "system:none")
    assert session(gateway, "sys-none")["task_key"] == "system:none"
    # A harness session (it has a group) keeps only a key it was given.
    chat(gateway.url + "/v1", "sys-harness", headers={"X-Group-Id": "g-harness"})
    assert session(gateway, "sys-harness")["task_key"] is None


def test_rewarded_sessions_of_one_key_form_groups_of_k_and_two_keys_never_share(gateway):
    for i in range(4):
        chat(gateway.url + "/v1", f"k-a{i}", headers={"X-Task-Id": "key-a"})
        chat(gateway.url + "/v1", f"k-b{i}", headers={"X-Task-Id": "key-b"})
    answers = {}
    for i in range(4):  # interleaved: a, b, a, b, ...
        answers[f"k-a{i}"] = reward(gateway, f"k-a{i}", float(i))
        answers[f"k-b{i}"] = reward(gateway, f"k-b{i}", float(i))
    assert all(answer["trainable"] for answer in answers.values())
    groups = {session_id: answer["group_id"] for session_id, answer in answers.items()}
    # The first three of each key share a group, closed at K = 3; the fourth opens the next.
    assert groups["k-a0"] == groups["k-a1"] == groups["k-a2"] != groups["k-a3"]
    assert groups["k-b0"] == groups["k-b1"] == groups["k-b2"] != groups["k-b3"]
    assert not {groups[f"k-a{i}"] for i in range(4)} & {groups[f"k-b{i}"] for i in range(4)}
    full = httpx.get(f"{gateway.url}/v1/groups/{groups['k-a0']}").json()
    assert full["origin"] == "live" and full["task_key"] == "key-a" and full["closed"]
    assert sorted(s["id"] for s in full["sessions"]) == ["k-a0", "k-a1", "k-a2"]
    filling = httpx.get(f"{gateway.url}/v1/groups/{groups['k-a3']}").json()
    assert not filling["closed"] and [s["id"] for s in filling["sessions"]] == ["k-a3"]
    # A reward posted again to a live session stays in its group.
    assert reward(gateway, "k-a0", 0.5)["group_id"] == groups["k-a0"]


def test_a_val_session_and_a_harness_session_never_join_a_live_group(gateway):
    chat(gateway.url + "/v1", "val-1", headers={"X-Task-Id": "key-v", "X-Split": "val"})
    answer = reward(gateway, "val-1", 1.0)
    assert answer["trainable"] is False and "val" in answer["reason"]
    chat(gateway.url + "/v1", "harness-1", headers={"X-Group-Id": "g-h1"})
    assert reward(gateway, "harness-1", 1.0)["group_id"] == "g-h1"


def test_a_session_whose_every_call_failed_takes_no_place_in_a_live_group(gateway):
    # The engine refuses a prompt longer than the model's context: the call is recorded, failed.
    failed = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        headers={"X-Session-Id": "all-failed", "X-Task-Id": "key-f"},
        json={"model": "agent", "messages": [{"role": "user", "content": "hi " * 3000}], "max_tokens": 4},
    )
    assert failed.status_code == 400 and session(gateway, "all-failed")["n_calls"] == 1
    answer = reward(gateway, "all-failed", 1.0)
    assert answer["trainable"] is False and "no answered call" in answer["reason"]
    assert session(gateway, "all-failed")["group_id"] is None
    # Its place goes to sessions that have something to train: three of them fill the group.
    for i in range(3):
        chat(gateway.url + "/v1", f"answered-{i}", headers={"X-Task-Id": "key-f"})
    groups = {reward(gateway, f"answered-{i}", float(i))["group_id"] for i in range(3)}
    (group_id,) = groups
    full = httpx.get(f"{gateway.url}/v1/groups/{group_id}").json()
    assert full["closed"] and sorted(s["id"] for s in full["sessions"]) == [f"answered-{i}" for i in range(3)]


def test_without_live_groups_an_ungrouped_reward_is_kept_and_says_it_will_not_train(tmp_path):
    settings = Settings(state_dir=tmp_path, trainer="off", default_max_tokens=4)
    with ThreadServer(create_app(settings)) as server:
        chat(server.url + "/v1", "lone")
        answer = reward(server, "lone", 1.0)
        assert answer["trainable"] is False and "--live-group-size" in answer["reason"]
        assert session(server, "lone")["reward"] == 1.0 and session(server, "lone")["group_id"] is None


# ------------------------------------------------------------------ staleness, on the store


@pytest.fixture
def store(either_backend):
    """Both backends: the live-group ops are portable SQL run inside the reward's transaction."""
    return either_backend


def _call(store: Store, session_id: str, step: int | None, engine: str = "local", model: str = "agent") -> None:
    store.record_call_sync(
        CallRecord(
            id=f"{session_id}-c",
            session_id=session_id,
            group_id=None,
            task_key="key",
            split="train",
            model=model,
            served=None if step is None else f"agent@{step}",
            step=step,
            engine=engine,
            stream=False,
            status="ok",
            request={"messages": [{"role": "user", "content": "x"}]},
            response={"choices": [{"index": 0, "message": {"role": "assistant", "content": "Y"}}]},
            latency_ms=1.0,
            prompt_ids=[1, 2],
            completion_ids=[[3]],
            behaviour_logprobs=[[-0.1]],
        )
    )


def _step(store: Store, step: int) -> None:
    store.insert_step("agent", step, f"/nowhere/{step}", {}, [])


def test_a_live_session_under_a_long_model_name_joins_its_group_on_either_backend(store):
    # The model name is the request's (an upstream's model id, of any length): on PostgreSQL the
    # open-live-group index held it, and past its ~2.7 kB entry limit the reward was a 500.
    rule = LiveRule(group_size=2, max_staleness=1)
    model = "".join(hashlib.sha256(str(i).encode()).hexdigest() for i in range(150))  # 9,600 that do not compress
    for session_id in ("long-a", "long-b"):
        _call(store, session_id, step=None, engine="openai", model=model)
    first = asyncio.run(store.set_reward("long-a", 0.0, {}, rule))
    second = asyncio.run(store.set_reward("long-b", 1.0, {}, rule))
    assert first["trainable"] and second["trainable"] and first["group_id"] == second["group_id"]
    assert [g["id"] for g in store.ready_groups(model)] == [first["group_id"]]


def test_a_reward_after_the_session_went_stale_is_stored_marked_and_never_trained(store):
    rule = LiveRule(group_size=2, max_staleness=1)
    _call(store, "old", step=1)
    _call(store, "fresh", step=3)
    _call(store, "upstream", step=None, engine="openai")  # an upstream's policy is not ours: never stale
    for step in range(4):
        _step(store, step)
    old = asyncio.run(store.set_reward("old", 1.0, {}, rule))
    assert old["trainable"] is False
    assert old["reason"].startswith("stale: answered by step 1, training goes on from step 3 (--live-max-staleness 1)")
    stored = store.get_session("old")
    assert stored["reward"] == 1.0 and stored["group_id"] is None and stored["untrained_reason"] == old["reason"]
    fresh = asyncio.run(store.set_reward("fresh", 0.0, {}, rule))
    upstream = asyncio.run(store.set_reward("upstream", 1.0, {}, rule))
    assert fresh["trainable"] and upstream["trainable"] and fresh["group_id"] == upstream["group_id"]
    ready = store.ready_groups("agent")
    assert [g["id"] for g in ready] == [fresh["group_id"]]  # the stale session is in no group the trainer sees


def test_a_member_that_went_stale_while_its_group_filled_leaves_it(store):
    rule = LiveRule(group_size=2, max_staleness=1)
    _step(store, 0)
    _call(store, "early", step=0)
    first = asyncio.run(store.set_reward("early", 1.0, {}, rule))
    assert first["trainable"]
    _step(store, 1)
    _step(store, 2)  # the policy moved two steps while the group waited for its second session
    _call(store, "late", step=2)
    second = asyncio.run(store.set_reward("late", 0.0, {}, rule))
    assert second["group_id"] == first["group_id"]
    group = store.get_group(first["group_id"])
    assert [s["id"] for s in group["sessions"]] == ["late"] and not group["closed"]
    assert store.get_session("early")["untrained_reason"].startswith("stale: answered by step 0")


def test_rejected_candidates_do_not_make_the_serving_steps_sessions_stale(store):
    """Under --promote canary|manual a rejected candidate is not where training goes on from:
    a session the serving step answered joins a live group however many were turned down, as
    the trainer would train it (staleness along the parent chain, as trainer.selection counts)."""
    rule = LiveRule(group_size=2, max_staleness=2)
    _step(store, 0)
    _step(store, 1)
    for step in (2, 3, 4):  # three candidates trained from step 1, each rejected: step 1 still serves
        store.insert_step("agent", step, f"/nowhere/{step}", {}, [], state="candidate")
        store.decide_step("agent", step, "rejected", {"by": "operator"})
    _call(store, "served-by-1", step=1)
    _call(store, "served-by-0", step=0)
    answer = asyncio.run(store.set_reward("served-by-1", 1.0, {}, rule))
    assert answer["trainable"] is True, answer
    assert asyncio.run(store.set_reward("served-by-0", 0.0, {}, rule))["group_id"] == answer["group_id"]
    assert [g["id"] for g in store.ready_groups("agent")] == [answer["group_id"]]


def test_a_live_group_a_close_made_full_takes_no_more_sessions_once_claimed_or_trained(store):
    # `POST /v1/groups/{id}/close {"expected_sessions": 2}` on a live group leaves it open
    # (`closed` 0) but ready at 2: the trainer claims it and trains it. The next rewards of its key
    # joined it all the same, answered `trainable: true` with its id, and were never trained.
    rule = LiveRule(group_size=4, max_staleness=2)
    _step(store, 0)
    for session_id in ("a", "b", "c", "d"):
        _call(store, session_id, step=0)
    first = asyncio.run(store.set_reward("a", 1.0, {}, rule))["group_id"]
    asyncio.run(store.set_reward("b", 0.0, {}, rule))
    asyncio.run(store.close_group(first, 2))
    assert [g["id"] for g in store.ready_groups("agent")] == [first]
    assert store.claim_for_step([first], 1) == [first]  # the trainer's claim, then its step
    during = asyncio.run(store.set_reward("c", 0.5, {}, rule))
    store.insert_step("agent", 1, "/nowhere/1", {}, [first], ["a", "b"], advantages={"a": 1.0, "b": -1.0})
    after = asyncio.run(store.set_reward("d", 0.5, {}, rule))
    assert during["trainable"] and after["trainable"]
    assert during["group_id"] != first and after["group_id"] == during["group_id"]  # a group of their own
    assert sorted(s["id"] for s in store.get_group(first)["sessions"]) == ["a", "b"]
    assert sorted(s["id"] for s in store.get_group(during["group_id"])["sessions"]) == ["c", "d"]


def test_a_live_reward_reads_the_steps_between_the_serving_one_and_its_own_not_every_step(store):
    # The staleness check runs inside the reward's write transaction: it read every step row of
    # the run there (25 ms at 5,000 steps on SQLite, its write lock held), more each step trained.
    rule = LiveRule(group_size=2, max_staleness=2)

    def record_steps(conn) -> None:  # 5,000 steps, each trained from the one before
        for step in range(5000):
            conn.execute(
                "INSERT INTO steps (model, step, path, metrics, groups, created_at, parent) VALUES (?,?,?,?,?,?,?)",
                ("agent", step, f"/nowhere/{step}", "{}", "[]", 0.0, step - 1 if step else None),
            )

    store._run_sync(record_steps)
    _call(store, "fresh", step=4998)
    _call(store, "stale", step=4990)

    def check(conn, session_id: str) -> tuple[str | None, int]:
        counting = StepRowsRead(conn)
        return stale_reason(counting, session_id, Policy.read(counting, "agent"), rule), counting.step_rows

    assert store._run_sync(lambda conn: check(conn, "fresh")) == (None, 16)
    reason, step_rows = store._run_sync(lambda conn: check(conn, "stale"))
    assert reason.startswith("stale: answered by step 4990, training goes on from step 4999") and step_rows == 16
    _call(store, "long-ago", step=3)  # stale by thousands of steps: found so without walking down to step 3
    reason, step_rows = store._run_sync(lambda conn: check(conn, "long-ago"))
    assert reason.startswith("stale: answered by step 3,") and step_rows == 16
    assert asyncio.run(store.set_reward("fresh", 1.0, {}, rule))["trainable"] is True


class StepRowsRead:
    """A store connection that counts the step rows its queries return."""

    def __init__(self, conn):
        self.conn, self.step_rows = conn, 0

    def execute(self, sql: str, params=()):
        cursor = self.conn.execute(sql, params)
        if "SELECT step, parent FROM steps" not in sql:
            return cursor
        rows = cursor.fetchall()
        self.step_rows += len(rows)
        return rows_cursor(rows)


def rows_cursor(rows: list):
    class Rows:
        def fetchall(self):
            return rows

    return Rows()


def test_staleness_read_step_by_step_is_the_trainers_along_every_kind_of_chain():
    # Side branches (rejected candidates, rolled-back steps), rows without a parent (an older
    # store), steps not recorded, the base model: the bounded walk answers as the whole chain does.
    rng = random.Random(7)
    for _ in range(25):
        parents: dict[int, int | None] = {}
        for step in range(rng.randint(1, 30)):
            if rng.random() < 0.1:
                continue  # not recorded
            parents[step] = None if step == 0 or rng.random() < 0.1 else rng.randint(max(0, step - 4), step - 1)
        conn = sqlite3.connect(":memory:")
        conn.execute("CREATE TABLE steps (model TEXT, step INTEGER, parent INTEGER, PRIMARY KEY (model, step))")
        conn.executemany("INSERT INTO steps VALUES ('agent', ?, ?)", parents.items())
        for current in range(32):
            for sampled in [None, *range(32)]:
                for limit in (0, 2):
                    expected = chain_distance(parents, current, sampled) > limit
                    assert further_than(StepParents(conn, "agent", span=2), current, sampled, limit) == expected


def test_a_live_group_whose_members_went_stale_sets_them_aside_without_another_reward(store):
    # Members went stale only when another session of their key joined: with no more traffic on
    # that key the group stayed open with them for ever, no reason given, and none counted stale.
    # The gateway sets them aside as the serving step moves (StoreUpkeep), whatever the traffic.
    rule = LiveRule(group_size=3, max_staleness=1)
    _step(store, 0)
    for session_id in ("a", "b"):
        _call(store, session_id, step=0)
    group_id = asyncio.run(store.set_reward("a", 1.0, {}, rule))["group_id"]
    asyncio.run(store.set_reward("b", 0.0, {}, rule))
    assert store.set_aside_stale_live("agent", rule) == []  # within --live-max-staleness: they stay
    for step in (1, 2, 3):
        _step(store, step)
    assert sorted(store.set_aside_stale_live("agent", rule)) == ["a", "b"]
    assert store.get_group(group_id)["sessions"] == []
    for session_id in ("a", "b"):
        stored = store.get_session(session_id)
        assert stored["group_id"] is None
        assert stored["untrained_reason"].startswith("stale: answered by step 0, training goes on from step 3")
    assert store.counts()["sessions_stale"] == 2
    _call(store, "c", step=3)  # the key's next reward opens afresh (the emptied group takes it)
    assert asyncio.run(store.set_reward("c", 1.0, {}, rule))["trainable"] is True
    assert store.set_aside_stale_live("agent", rule) == []


def test_a_running_gateway_sets_aside_live_members_that_went_stale_as_the_step_moves(tmp_path):
    settings = Settings(
        state_dir=tmp_path, trainer="off", default_max_tokens=4, live_group_size=3, live_max_staleness=1
    )
    app = create_app(settings)
    store = app.state.services.store
    with ThreadServer(app) as server:
        for session_id in ("quiet-a", "quiet-b"):
            chat(f"{server.url}/v1", session_id)  # answered by the base model: step 0 of this cold run
        group_id = reward(server, "quiet-a", 1.0)["group_id"]
        reward(server, "quiet-b", 0.0)
        for step in (0, 1, 2, 3):  # the trainer's steps; no more traffic on this key
            store.insert_step("agent", step, str(tmp_path / f"nowhere-{step}"), {}, [])
        wait_until(lambda: session(server, "quiet-a")["group_id"] is None, what="the stale members set aside")
        assert httpx.get(f"{server.url}/v1/groups/{group_id}").json()["sessions"] == []
        assert session(server, "quiet-b")["untrained_reason"].startswith("stale: answered by step 0")
        assert store.counts()["sessions_stale"] == 2
