"""The store: group commit, readiness, the step transaction, compact arrays."""

import asyncio

import pytest

from gateway.errors import Conflict, NotFound
from gateway.store import CallRecord, Store, pack_floats, pack_ids, unpack_floats, unpack_ids


def call(i: int, session: str, group: str | None = "g1", **extra) -> CallRecord:
    fields = dict(
        id=f"req{i}", session_id=session, group_id=group, split="train", model="agent", served="agent@0", step=0,
        engine="local", stream=False, status="ok", request={"messages": [{"role": "user", "content": str(i)}]},
        response={"choices": []}, latency_ms=1.0, prompt_ids=[1, 2, 3], completion_ids=[[4, 5], [6]],
        completion_logprobs=[[-0.5, -0.25], [-1.0]],
    )
    fields.update(extra)
    return CallRecord(**fields)


@pytest.fixture
async def store(tmp_path):
    s = Store(tmp_path / "rlproxy.db")
    await s.start()
    yield s
    await s.close()


def test_arrays_round_trip_exactly():
    assert unpack_ids(pack_ids([0, 1, 151_643, 2**31 - 1])) == [0, 1, 151_643, 2**31 - 1]
    assert unpack_floats(pack_floats([-0.5, -0.25, 0.0])) == [-0.5, -0.25, 0.0]
    assert len(pack_ids(range(100))) == 400  # 4 bytes a token, not JSON text
    assert unpack_ids(None) is None


async def test_concurrent_writes_share_commits(store):
    await asyncio.gather(*(store.record_call(call(i, f"s{i % 5}")) for i in range(200)))
    assert store.counts()["calls"] == 200
    assert store.counts()["sessions"] == 5
    # Group commit: many calls per transaction, not one transaction per call.
    assert store.commits < 200


async def test_choices_decode_per_choice(store):
    await store.record_call(call(1, "s1"))
    recorded = store.get_session("s1")["calls"][0]
    assert recorded["prompt_ids"] == [1, 2, 3]
    assert recorded["completion_ids"] == [[4, 5], [6]]
    assert recorded["completion_logprobs"] == [[-0.5, -0.25], [-1.0]]


async def test_group_ready_needs_close_and_every_reward(store):
    for i, session in enumerate(["a", "b"]):
        await store.record_call(call(i, session))
    await store.set_reward("a", 1.0)
    assert store.ready_groups("agent") == []
    await store.close_group("g1")
    assert store.ready_groups("agent") == []  # b has no reward yet
    await store.set_reward("b", 0.0, {"steps": 3})
    ready = store.ready_groups("agent")
    assert [g["id"] for g in ready] == ["g1"] and ready[0]["n_sessions"] == 2
    assert store.get_group("g1")["ready"] is True


async def test_expected_sessions_makes_group_ready_without_close(store):
    await store.record_call(call(1, "a"))
    await store.close_group("g1", expected_sessions=2)
    await store.set_reward("a", 1.0)
    assert store.ready_groups("agent") == []
    await store.record_call(call(2, "b"))
    await store.set_reward("b", 0.5)
    assert [g["id"] for g in store.ready_groups("agent")] == ["g1"]


async def test_val_groups_are_never_ready_for_training(store):
    await store.record_call(call(1, "a", split="val"))
    await store.set_reward("a", 1.0)
    await store.close_group("g1")
    assert store.ready_groups("agent") == []
    assert len(store.ready_groups("agent", split="val")) == 1


async def test_reward_and_close_on_unknown_ids_are_not_found(store):
    with pytest.raises(NotFound, match="session 'nope' not found"):
        await store.set_reward("nope", 1.0)
    with pytest.raises(NotFound, match="group 'nope' not found"):
        await store.close_group("nope")
    # A failing op in a batch does not take its neighbours down with it.
    results = await asyncio.gather(store.set_reward("nope", 1.0), store.record_call(call(9, "ok")),
                                   return_exceptions=True)
    assert isinstance(results[0], NotFound) and results[1] is None
    assert store.get_session("ok")["n_calls"] == 1


async def test_step_row_and_trained_mark_are_one_transaction(store):
    for i, session in enumerate(["a", "b"]):
        await store.record_call(call(i, session))
        await store.set_reward(session, float(i))
    await store.close_group("g1")
    store.insert_step("agent", 1, "/ckpt/0001", {"loss": 0.1}, ["g1"])
    assert store.get_group("g1")["trained_step"] == 1
    assert store.ready_groups("agent") == []
    # Training the same group again fails and leaves no step row behind.
    with pytest.raises(Conflict):
        store.insert_step("agent", 2, "/ckpt/0002", {}, ["g1"])
    assert [s["step"] for s in store.steps("agent")] == [1]
    assert store.latest_step("agent") == 1


async def test_committed_rows_survive_reopening(tmp_path):
    first = Store(tmp_path / "db.sqlite")
    await first.start()
    await first.record_call(call(1, "a"))
    await first.close()
    second = Store(tmp_path / "db.sqlite")
    assert second.get_session("a")["calls"][0]["id"] == "req1"
    await second.start()
    await second.close()


async def test_triggers_are_consumed_once(store):
    await store.request_trigger("agent")
    assert store.consume_triggers("agent") is True
    assert store.consume_triggers("agent") is False


def test_in_memory_store_for_tests():
    memory = Store(memory=True)
    memory.record_call_sync(call(1, "a"))
    assert memory.get_session("a")["n_calls"] == 1
