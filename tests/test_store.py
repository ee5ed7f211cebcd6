"""The store: group commit, readiness, the step transaction, compact arrays."""

import asyncio

import pytest

from gateway.errors import Conflict, NotFound
from gateway.store import CallRecord, pack_floats, pack_ids, unpack_floats, unpack_ids
from gateway.store.sqlite import SQLiteStore
from trainer.data import build_batch, load_groups


def call(i: int, session: str, group: str | None = "g1", **extra) -> CallRecord:
    fields = dict(
        id=f"req{i}",
        session_id=session,
        group_id=group,
        split="train",
        model="agent",
        served="agent@0",
        step=0,
        engine="local",
        stream=False,
        status="ok",
        request={"messages": [{"role": "user", "content": str(i)}]},
        response={"choices": []},
        latency_ms=1.0,
        prompt_ids=[1, 2, 3],
        completion_ids=[[4, 5], [6]],
        behaviour_logprobs=[[-0.5, -0.25], [-1.0]],
    )
    fields.update(extra)
    return CallRecord(**fields)


@pytest.fixture
async def store(tmp_path):
    s = SQLiteStore(tmp_path / "rlproxy.db")
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
    assert recorded["behaviour_logprobs"] == [[-0.5, -0.25], [-1.0]]


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
    results = await asyncio.gather(
        store.set_reward("nope", 1.0), store.record_call(call(9, "ok")), return_exceptions=True
    )
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


async def test_a_claimed_group_takes_no_reward_nor_judgement_and_a_failed_step_gives_it_back(store):
    for i, session in enumerate(["a", "b"]):
        await store.record_call(call(i, session))
        await store.set_reward(session, float(i))
    await store.close_group("g1")
    assert store.claim_for_step(["g1"], 3) == ["g1"]
    group = store.get_group("g1")
    assert group["claimed_step"] == 3 and group["attempts"] == 1
    with pytest.raises(Conflict, match="being trained"):
        await store.set_reward("a", 0.5)
    with pytest.raises(Conflict, match="RULER's scores were not stored"):
        await store.record_judgement("g1", "judge", [{"trajectory_id": "a", "score": 0.2}], close=True)
    store.release_step(["g1"], "RuntimeError: boom")  # a failed step: the attempt stays counted
    group = store.get_group("g1")
    assert group["claimed_step"] is None and group["attempts"] == 1 and group["last_error"] == "RuntimeError: boom"
    await store.set_reward("a", 0.5)  # open again
    store.claim_for_step(["g1"], 3)
    store.release_step(["g1"])  # not the group's fault (a discard, the engine away): no attempt
    assert store.get_group("g1")["attempts"] == 1
    store.mark_skipped(["g1"], "no reward spread")  # set aside: a reward would change nothing either
    with pytest.raises(Conflict, match=r"set aside by the trainer \(no reward spread\)"):
        await store.set_reward("b", 0.0)


async def test_committed_rows_survive_reopening(tmp_path):
    first = SQLiteStore(tmp_path / "db.sqlite")
    await first.start()
    await first.record_call(call(1, "a"))
    await first.close()
    second = SQLiteStore(tmp_path / "db.sqlite")
    assert second.get_session("a")["calls"][0]["id"] == "req1"
    await second.start()
    await second.close()


async def test_triggers_are_consumed_once(store):
    await store.request_trigger("agent")
    assert store.consume_triggers("agent") is True
    assert store.consume_triggers("agent") is False


def test_in_memory_store_for_tests():
    memory = SQLiteStore(memory=True)
    memory.record_call_sync(call(1, "a"))
    assert memory.get_session("a")["n_calls"] == 1


# ---------------------------------------------------------------- discarded sessions (failed rollouts)


async def _group_with_a_failed_rollout(store) -> None:
    """g1: a and b finished with rewards 1 and 0; c made two calls, then its rollout failed."""
    await store.record_call(call(1, "a"))
    await store.record_call(call(2, "b"))
    await store.record_call(call(3, "c"))
    await store.record_call(call(4, "c", prompt_ids=[1, 2, 3, 4, 5, 7]))
    await store.set_reward("a", 1.0)
    await store.set_reward("b", 0.0)
    await store.close_group("g1")


async def test_a_discarded_session_lets_its_group_become_ready(store):
    await _group_with_a_failed_rollout(store)
    assert store.ready_groups("agent") == []  # c has no reward: the group waits for it
    session = await store.discard_session("c", "rollout raised ValueError: lost the thread")
    assert session["discarded"] is True and session["discard_reason"] == "rollout raised ValueError: lost the thread"
    assert [c["id"] for c in session["calls"]] == ["req3", "req4"]  # nothing is lost

    ready = store.ready_groups("agent")
    assert [g["id"] for g in ready] == ["g1"]
    assert (ready[0]["n_sessions"], ready[0]["n_rewarded"], ready[0]["n_discarded"]) == (2, 2, 1)
    group = store.get_group("g1")
    assert group["ready"] is True and (group["n_sessions"], group["n_rewarded"], group["n_discarded"]) == (2, 2, 1)
    assert [s["id"] for s in group["sessions"]] == ["a", "b"]
    assert [s["id"] for s in group["discarded_sessions"]] == ["c"]
    assert store.get_session("a")["discarded"] is False


async def test_the_trainer_never_sees_a_discarded_session(store):
    await _group_with_a_failed_rollout(store)
    await store.discard_session("c")
    groups, calls = load_groups(store, ["g1"])
    assert set(calls) == {"a", "b"}
    batch = build_batch(groups, calls)
    assert batch.group_ids == ["g1"] and batch.rewards == [1.0, 0.0]
    assert {s.trajectory_id for s in batch.samples} == {"a", "b"}
    # A group dict that still lists it among its sessions (hand-made, older layout) is filtered too.
    group = store.get_group("g1")
    mixed = {**group, "sessions": group["sessions"] + group["discarded_sessions"]}
    batch = build_batch([mixed], {**calls, "c": store.session_calls("c")})
    assert {s.trajectory_id for s in batch.samples} == {"a", "b"} and batch.rewards == [1.0, 0.0]


async def test_discarded_sessions_count_towards_expected_sessions(store):
    # expected_sessions says how many rollouts will arrive; a failed one has arrived.
    await store.record_call(call(1, "a"))
    await store.close_group("g1", expected_sessions=3)
    await store.record_call(call(2, "b"))
    await store.record_call(call(3, "c"))
    await store.set_reward("a", 1.0)
    await store.set_reward("b", 0.5)
    assert store.ready_groups("agent") == []
    await store.discard_session("c")
    assert [g["id"] for g in store.ready_groups("agent")] == ["g1"]
    assert store.get_group("g1")["ready"] is True


async def test_a_group_whose_every_session_is_discarded_is_never_ready(store):
    await store.record_call(call(1, "a"))
    await store.close_group("g1")
    await store.discard_session("a", "tool crashed")
    await store.discard_session("a")  # again: harmless, keeps the first reason
    assert store.get_session("a")["discard_reason"] == "tool crashed"
    assert store.ready_groups("agent") == []
    group = store.get_group("g1")
    assert group["ready"] is False and group["n_sessions"] == 0 and group["n_discarded"] == 1


async def test_discarding_unknown_or_trained_sessions_fails(store):
    with pytest.raises(NotFound, match="session 'nope' not found"):
        await store.discard_session("nope")
    for i, session in enumerate(["a", "b"]):
        await store.record_call(call(i, session))
        await store.set_reward(session, float(i))
    await store.close_group("g1")
    store.insert_step("agent", 1, "/ckpt/0001", {}, ["g1"])
    with pytest.raises(Conflict, match="group 'g1' was already trained"):
        await store.discard_session("a", "too late")
    assert store.get_session("a")["discarded"] is False
    assert [s["id"] for s in store.get_group("g1")["sessions"]] == ["a", "b"]


async def test_an_older_database_gets_the_discard_columns(tmp_path):
    import sqlite3

    path = tmp_path / "old.db"
    old = sqlite3.connect(path)
    old.executescript(
        "CREATE TABLE sessions (id TEXT PRIMARY KEY, group_id TEXT, split TEXT NOT NULL, model TEXT NOT NULL,"
        " n_calls INTEGER NOT NULL DEFAULT 0, reward REAL, metrics TEXT, rewarded_at REAL,"
        " created_at REAL NOT NULL, updated_at REAL NOT NULL);"
        "INSERT INTO sessions (id, group_id, split, model, n_calls, created_at, updated_at)"
        " VALUES ('old', 'g1', 'train', 'agent', 1, 0, 0);"
        "CREATE TABLE groups (id TEXT PRIMARY KEY, model TEXT NOT NULL, split TEXT NOT NULL,"
        " closed INTEGER NOT NULL DEFAULT 0, expected_sessions INTEGER, trained_step INTEGER, skipped TEXT,"
        " ruler_status TEXT, ruler_error TEXT, created_at REAL NOT NULL, updated_at REAL NOT NULL);"
        "INSERT INTO groups (id, model, split, created_at, updated_at) VALUES ('g1', 'agent', 'train', 0, 0);"
    )
    old.close()
    upgraded = SQLiteStore(path)
    assert upgraded.get_session("old")["discarded"] is False
    assert upgraded.get_group("g1")["n_sessions"] == 1
    await upgraded.start()
    await upgraded.discard_session("old", "from before the upgrade")
    await upgraded.close()
    reopened = SQLiteStore(path)  # the columns are there now: nothing to add, nothing lost
    assert reopened.get_session("old")["discard_reason"] == "from before the upgrade"
    assert reopened.get_group("g1")["n_discarded"] == 1
    await reopened.start()
    await reopened.close()


async def test_a_call_alone_is_committed_on_the_loop_but_never_waits_there_for_a_lock(tmp_path):
    """`record_call(alone=True)` commits on the event loop when it can (no hand-off to the
    writer thread); while another process holds the write lock, the write waits in the
    writer thread instead, and the loop goes on serving."""
    import sqlite3
    import threading

    store = SQLiteStore(tmp_path / "rlproxy.db", busy_timeout=60.0)
    await store.start()
    trainer = sqlite3.connect(tmp_path / "rlproxy.db", isolation_level=None, check_same_thread=False)
    released = threading.Lock()

    def release() -> None:
        with released:
            if trainer.in_transaction:
                trainer.execute("COMMIT")

    # A safety net, so a loop blocked in the write cannot hang the test: the lock is let go
    # from another thread after 5 s, and then the write completes before the loop runs again.
    net = threading.Timer(5.0, release)
    try:
        await store.record_call(call(1, "s1"), alone=True)
        assert store.counts()["calls"] == 1
        trainer.execute("BEGIN IMMEDIATE")  # the trainer's write transaction holds the lock
        net.start()
        writing = asyncio.create_task(store.record_call(call(2, "s2"), alone=True))
        await asyncio.sleep(0.2)  # the loop runs on: the write waits for the lock elsewhere
        assert not writing.done(), "the write waited for the lock on the event loop"
        release()  # from the loop: only possible because the loop is not blocked
        await writing  # committed once the lock was free, not failed as "locked"
        assert store.counts()["calls"] == 2
    finally:
        net.cancel()
        release()
        trainer.close()
        await store.close()


async def test_the_wal_is_checkpointed_when_every_commit_is_made_on_the_loop(tmp_path):
    """The store's connection never checkpoints in a commit (that would fsync on the event
    loop); the writer thread does, every CHECKPOINT_EVERY commits, so the WAL stays bounded."""
    from gateway.store.sqlite import CHECKPOINT_EVERY

    store = SQLiteStore(tmp_path / "rlproxy.db")
    await store.start()
    wal = tmp_path / "rlproxy.db-wal"
    try:
        sizes = []
        for round_ in range(4):
            for i in range(CHECKPOINT_EVERY):
                await store.record_call(call(round_ * CHECKPOINT_EVERY + i, f"s{i % 7}"), alone=True)
            await store.record_call(call(10_000 + round_, "queued"))  # queued behind the checkpoint
            sizes.append(wal.stat().st_size)
        assert store.checkpoints >= 3
        assert store.counts()["calls"] == 4 * (CHECKPOINT_EVERY + 1)
        # Checkpointed, the WAL is written from its start again: it stops growing.
        assert sizes[-1] <= sizes[0] * 1.5, sizes
    finally:
        await store.close()


def test_a_round_with_a_failing_op_commits_the_others_in_one_transaction(tmp_path):
    """Group commit runs a round without savepoints; when an op fails, the round runs again
    with one savepoint per op, so only that op is rolled back."""
    from gateway.errors import Conflict
    from gateway.store import rows as store_rows

    store = SQLiteStore(tmp_path / "rlproxy.db")
    try:
        ops = [
            lambda conn: store_rows.insert_call(conn, call(1, "s1")),
            lambda conn: store_rows.insert_call(conn, call(2, "s1", split="val")),  # a train session
            lambda conn: store_rows.insert_call(conn, call(3, "s2")),
        ]
        outcomes = store._apply_batch(ops)
        assert [ok for ok, _ in outcomes] == [True, False, True]
        assert isinstance(outcomes[1][1], Conflict)
        assert store.commits == 1
        assert [c["id"] for c in store.session_calls("s1")] == ["req1"]
        assert [c["id"] for c in store.session_calls("s2")] == ["req3"]
    finally:
        asyncio.run(store.close())


def test_the_serving_poll_reads_a_handful_of_step_rows_however_many_steps_there_are(store):
    """The adapter registry polls the steps every second, for weeks: it reads the newest ones and
    those not superseded (the serving step, candidates, those turned down), not every step ever."""
    for step in range(10):
        store.insert_step("agent", step, f"/m/{step:04d}", {"loss": 0.5}, [])
    store.insert_step("agent", 10, "/m/0010", {}, [], state="candidate", parent=9)
    store.decide_step("agent", 10, "rejected", {"by": "test"})
    store.insert_step("agent", 11, "/m/0011", {}, [], state="candidate", parent=9)
    rows = store.recent_steps("agent", 1)
    assert [(row["step"], row["state"]) for row in rows] == [(9, "promoted"), (10, "rejected"), (11, "candidate")]
    assert rows[0]["metrics"] == {"loss": 0.5} and rows[1]["decision"]["by"] == "test"
    assert [row["step"] for row in store.recent_steps("agent", 4)] == [8, 9, 10, 11]
    assert store.recent_steps("other", 3) == []
