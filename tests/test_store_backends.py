"""The store's conformance suite on both backends: every test of tests/test_store.py that takes
the `store` fixture runs here against SQLite and against a real PostgreSQL (pgserver, or
RLPROXY_TEST_POSTGRES), plus what only matters with several processes on one database."""

import asyncio
import threading
import time
from pathlib import Path
from unittest import mock

import pytest

import tests.test_store as suite
from gateway.errors import Conflict
from gateway.store import Store
from gateway.store.open import open_store
from gateway.store.postgres import PostgresStore
from gateway.store.sqlite import SQLiteStore
from tests.test_store import call

# Re-run the store suite's tests with the parametrised fixture below.
for _name in dir(suite):
    if _name.startswith("test_"):
        _test = getattr(suite, _name)
        import inspect

        if "store" in inspect.signature(_test).parameters:
            globals()[_name] = _test


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request, tmp_path):
    if request.param == "sqlite":
        s = SQLiteStore(tmp_path / "rlproxy.db")
    else:
        s = PostgresStore(request.getfixturevalue("postgres_db"))
    await s.start()
    yield s
    await s.close()


@pytest.fixture
def pg(postgres_db):
    return postgres_db


async def test_open_store_picks_the_backend_from_the_url(tmp_path, pg):
    sqlite = open_store(tmp_path / "x.db")
    assert type(sqlite) is SQLiteStore
    await sqlite.close()
    postgres = open_store(pg)
    assert isinstance(postgres, PostgresStore)
    await postgres.close()


def test_both_backends_implement_one_interface_and_neither_extends_the_other():
    assert issubclass(SQLiteStore, Store) and issubclass(PostgresStore, Store)
    assert not issubclass(PostgresStore, SQLiteStore)
    with pytest.raises(TypeError, match="abstract"):
        Store(busy_timeout=1.0)  # the interface alone stores nothing


async def test_calls_of_one_session_on_two_replicas_form_one_ordered_trajectory(pg):
    """Order comes from the database sequence, not from the replicas' clocks: replica b's
    clock runs an hour behind, and the session still reads in the order the calls committed."""
    a, b = PostgresStore(pg), PostgresStore(pg)
    await a.start()
    await b.start()
    try:
        for i in range(6):
            replica = a if i % 2 == 0 else b
            record = call(i, "s1")
            record.created_at -= 3600 if replica is b else 0
            await replica.record_call(record)
        for replica in (a, b):
            calls = replica.session_calls("s1")
            assert [c["id"] for c in calls] == [f"req{i}" for i in range(6)]
            assert replica.get_session("s1")["n_calls"] == 6
    finally:
        await a.close()
        await b.close()


async def test_two_replicas_writing_the_same_sessions_at_once_lose_nothing(pg):
    """Batches from two replicas touching the same sessions in opposite orders can deadlock
    in PostgreSQL; the batch chosen as victim is rerun, so every awaited call is stored."""
    a, b = PostgresStore(pg), PostgresStore(pg)
    await a.start()
    await b.start()
    try:
        sessions = [f"s{k}" for k in range(8)]
        writes = []
        for i in range(160):
            k = (i // 2) % 8
            session = sessions[k] if i % 2 == 0 else sessions[7 - k]
            group = f"g{int(session[1:]) % 3}"  # a session keeps its group; groups shared by sessions
            writes.append((a if i % 2 == 0 else b).record_call(call(i, session, group=group)))
        await asyncio.gather(*writes)
        assert a.counts()["calls"] == 160
        assert sum(a.get_session(s)["n_calls"] for s in sessions) == 160
    finally:
        await a.close()
        await b.close()


async def _ready_groups(store, n):
    for g in range(n):
        for k in range(2):
            await store.record_call(call(g * 10 + k, f"s{g}-{k}", group=f"g{g}"))
            await store.set_reward(f"s{g}-{k}", float(k))
        await store.close_group(f"g{g}")


async def test_two_trainers_never_take_the_same_group(pg):
    gateway = PostgresStore(pg)
    await gateway.start()
    await _ready_groups(gateway, 6)
    trainers = [PostgresStore(pg) for _ in range(2)]
    taken: dict[int, list[str]] = {}
    barrier = threading.Barrier(2)

    def claim(i):
        barrier.wait()
        taken[i] = [g["id"] for g in trainers[i].claim_groups("agent", f"trainer-{i}", limit=4)]

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not set(taken[0]) & set(taken[1])
    assert len(taken[0]) + len(taken[1]) == 6
    # A claim is the holder's until it trains or releases: asking again gives the same groups.
    assert {g["id"] for g in trainers[0].claim_groups("agent", "trainer-0")} == set(taken[0])
    trainers[0].release_claims("trainer-0")
    assert {g["id"] for g in trainers[1].claim_groups("agent", "trainer-1")} == {f"g{g}" for g in range(6)}
    for t in trainers:
        t.close_sync()
    await gateway.close()


async def test_a_trainer_whose_clock_runs_behind_keeps_its_claims(pg):
    """A claim lasts an hour, written and compared in the database's clock: trainer 0's host runs two
    hours behind, and its claims (expired by its own clock's stamp) are still not trainer 1's."""
    gateway = PostgresStore(pg)
    await gateway.start()
    await _ready_groups(gateway, 2)
    trainers = [PostgresStore(pg) for _ in range(2)]
    real = time.time
    with mock.patch("time.time", lambda: real() - 7200):
        taken = {g["id"] for g in trainers[0].claim_groups("agent", "trainer-0", ttl_s=3600.0)}
    assert taken == {"g0", "g1"}
    assert trainers[1].claim_groups("agent", "trainer-1", ttl_s=3600.0) == []
    for t in trainers:
        t.close_sync()
    await gateway.close()


async def test_two_trainers_racing_to_insert_a_step_for_one_group_one_wins(pg):
    gateway = PostgresStore(pg)
    await gateway.start()
    await _ready_groups(gateway, 1)
    trainers = [PostgresStore(pg) for _ in range(2)]
    outcomes = []
    barrier = threading.Barrier(2)

    def insert(i):
        barrier.wait()
        try:
            trainers[i].insert_step("agent", i + 1, f"/ck/{i}", {}, ["g0"])
            outcomes.append("ok")
        except Conflict:
            outcomes.append("conflict")

    threads = [threading.Thread(target=insert, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["conflict", "ok"]
    assert len(gateway.steps("agent")) == 1
    assert gateway.ready_groups("agent") == []
    for t in trainers:
        t.close_sync()
    await gateway.close()


async def test_two_trainers_racing_to_record_one_step_number_one_wins_and_its_files_are_served(pg, tmp_path):
    # The loser's duplicate step row was psycopg's UniqueViolation, which no caller catches (they catch
    # Conflict); and its files had already replaced the winner's file list under that step number.
    gateway = PostgresStore(pg)
    await gateway.start()
    await _ready_groups(gateway, 2)
    trainers = [PostgresStore(pg) for _ in range(2)]
    outcomes: dict[int, str] = {}
    barrier = threading.Barrier(2)

    def record(i):
        checkpoint = tmp_path / f"node{i}" / "0001"
        checkpoint.mkdir(parents=True)
        (checkpoint / "adapter_model.safetensors").write_bytes(f"weights of node {i}".encode())
        barrier.wait()
        try:
            trainers[i].insert_step("agent", 1, str(checkpoint), {}, [f"g{i}"])
            outcomes[i] = "ok"
        except Conflict as exc:
            outcomes[i] = str(exc)

    threads = [threading.Thread(target=record, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes.values()) == ["ok", "step 1 of model 'agent' is recorded already"]
    winner = next(i for i, outcome in outcomes.items() if outcome == "ok")
    served = gateway.fetch_step_files("agent", 1, "/elsewhere", tmp_path / "models")
    assert (Path(served) / "adapter_model.safetensors").read_bytes() == f"weights of node {winner}".encode()
    assert [g["id"] for g in gateway.ready_groups("agent")] == [f"g{1 - winner}"]  # the loser's group trains again
    for t in trainers:
        t.close_sync()
    await gateway.close()


async def test_a_failing_write_in_a_batch_fails_alone(store):
    """Group commit: a write that fails (a split conflict) is rolled back alone; the writes
    batched with it are committed and acknowledged."""
    await store.record_call(call(0, "s-train", group="g-mixed"))
    outcomes = await asyncio.gather(
        store.record_call(call(1, "s-a", group="g-a")),
        store.record_call(call(2, "s-train", group="g-mixed", split="val")),  # a train session: refused
        store.record_call(call(3, "s-b", group="g-b")),
        return_exceptions=True,
    )
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], Conflict)
    assert [c["id"] for c in store.session_calls("s-train")] == ["req0"]
    assert store.get_session("s-a")["n_calls"] == 1 and store.get_session("s-b")["n_calls"] == 1


async def test_ruler_judgements_close_the_group_and_keep_the_independent_reward(store):
    for k in range(2):
        await store.record_call(call(k, f"r{k}", group="gr"))
    await store.set_reward("r0", 0.5)
    await store.set_ruler_status("gr", "running")
    assert store.get_group("gr")["ruler_status"] == "running"
    await store.record_judgement(
        "gr",
        "judge",
        [{"trajectory_id": "r0", "score": 0.9, "explanation": "good"}, {"trajectory_id": "r1", "score": 0.1}],
    )
    group = store.get_group("gr")
    assert group["ruler_status"] == "scored" and group["closed"] and group["ready"]
    first = store.get_session("r0")
    assert first["reward"] == 0.9 and first["metrics"] == {"independent_reward": 0.5, "ruler_score": 0.9}
    assert [(j["session_id"], j["score"], j["explanation"]) for j in group["judgements"]] == [
        ("r0", 0.9, "good"),
        ("r1", 0.1, None),
    ]
    # Judged without closing: an open group stays open.
    await store.record_call(call(5, "r5", group="gopen"))
    await store.record_judgement("gopen", "judge", [{"trajectory_id": "r5", "score": 1.0}], close=False)
    assert not store.get_group("gopen")["closed"]


async def test_gpu_lease_is_compare_and_set(store):
    assert store.gpu_lease("agent")["state"] == "idle"
    assert store.move_gpu_lease("agent", "requested", expect=("idle",), holder="trainer")
    assert not store.move_gpu_lease("agent", "requested", expect=("idle",), holder="other")
    assert not store.move_gpu_lease("agent", "granted", expect=("requested",), expect_holder="other")
    assert store.move_gpu_lease("agent", "granted", expect=("requested",), expect_holder="trainer", step=3)
    lease = store.gpu_lease("agent")
    assert (lease["state"], lease["holder"], lease["step"]) == ("granted", "trainer", 3)


async def test_skipped_and_failed_groups_are_never_ready(store):
    await _ready_groups(store, 3)
    store.mark_skipped(["g0"], "no spread")
    store.mark_failed(["g1"], "kept failing")
    assert [g["id"] for g in store.ready_groups("agent")] == ["g2"]
    assert store.get_group("g0")["skipped"] == "no spread" and store.get_group("g1")["failed"] == "kept failing"
    first = await store.request_trigger("agent")
    second = await store.request_trigger("agent")
    assert second > first  # trigger ids come from the database, in order


async def test_the_store_refuses_a_call_whose_split_or_group_contradicts_its_session_or_group(store):
    """Checked in the call's own transaction (another replica's calls never went through
    this process's check), on both backends; a refused call leaves nothing behind."""
    from gateway.errors import Conflict, NotFound
    from tests.helpers import call_row

    def record(i, session, group, split):
        return call_row(f"split-{i}", session, group, split)

    await store.record_call(record(1, "sa", "g-train", "train"))
    await store.record_call(record(2, "sv", "g-val", "val"))
    with pytest.raises(Conflict, match="session 'sa' is a 'train' session"):
        await store.record_call(record(3, "sa", None, "val"))
    with pytest.raises(Conflict, match="group 'g-train' holds 'train' sessions"):
        await store.record_call(record(4, "sb", "g-train", "val"))
    # a call naming no group, in a session whose group is val: the session's split is val, so allowed
    await store.record_call(record(5, "sv", None, "val"))
    # a session that has no group yet, a call naming a group of the other split
    await store.record_call(record(6, "sn", None, "train"))
    with pytest.raises(Conflict, match="group 'g-val' holds 'val' sessions"):
        await store.record_call(record(7, "sn", "g-val", "train"))
    # a session keeps its first group: a call naming another is refused, and no empty group is left
    with pytest.raises(Conflict, match="session 'sa' is in group 'g-train'; this call says X-Group-Id 'g-other'"):
        await store.record_call(record(8, "sa", "g-other", "train"))
    with pytest.raises(NotFound):
        store.get_group("g-other")
    assert store.counts()["calls"] == 4
    assert [c["id"] for c in store.get_session("sa")["calls"]] == ["split-1"]
    assert [c["id"] for c in store.get_session("sn")["calls"]] == ["split-6"]
    assert [s["id"] for s in store.get_group("g-train")["sessions"]] == ["sa"]


async def test_a_session_read_while_its_next_call_lands_agrees_with_itself(store, monkeypatch):
    # The session row and its calls were two reads: a call committed in between (a gateway
    # recording while GET /v1/sessions/{id} or `rlproxy export` reads) gave n_calls 1 and 2 calls.
    from gateway.store import reads

    other = open_store(store.path)  # another gateway (or this one's writer) recording meanwhile
    other.record_call_sync(call(1, "s1", "g"))
    real = reads.session_row

    def and_then_a_call_lands(query, session_id):
        row = real(query, session_id)
        other.record_call_sync(call(2, "s1", "g"))
        return row

    monkeypatch.setattr(reads, "session_row", and_then_a_call_lands)
    session = store.get_session("s1")
    assert session["n_calls"] == len(session["calls"]) == 1
    monkeypatch.undo()
    session = store.get_session("s1")
    assert session["n_calls"] == 2 and [c["id"] for c in session["calls"]] == ["req1", "req2"]
    await other.close()
