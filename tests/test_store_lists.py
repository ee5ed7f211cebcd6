"""Paged, filtered lists and the reward curve, checked against sums done by hand here."""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time

import pytest

from gateway.errors import InvalidRequest
from gateway.store import CallRecord, LiveRule
from gateway.store import rows as store_rows
from gateway.store.lists import ListFilter
from gateway.store.sqlite import SQLiteStore


def call(session, group, split, step, t, i=0):
    return CallRecord(
        id=f"{session}-{i}",
        session_id=session,
        group_id=group,
        split=split,
        model="agent",
        served=None,
        step=step,
        engine="local",
        stream=False,
        status="ok",
        request={"messages": []},
        response=None,
        latency_ms=1.0,
        created_at=t,
    )


@pytest.fixture(params=["sqlite", "postgres"])
def store(request):
    """The same rows in either backend: the dashboard's SQL must run on both."""
    if request.param == "sqlite":
        store = SQLiteStore(memory=True)
    else:
        from gateway.store.postgres import PostgresStore

        store = PostgresStore(request.getfixturevalue("postgres_db"))
    # 3 groups x 4 sessions; every session created at the same second within a group (ties on created_at).
    rewards = {}

    def op(conn):
        for g, (split, step) in enumerate((("train", 0), ("val", 0), ("train", 1))):
            for s in range(4):
                sid = f"g{g}-s{s}"
                store_rows.insert_call(conn, call(sid, f"g{g}", split, step, 1000.0 + g))
                store_rows.insert_call(
                    conn, call(sid, f"g{g}", split, step + 1, 1000.5 + g, 1)
                )  # later call, later step
                rewards[sid] = 0.25 * s + 0.1 * g
                store_rows.set_reward(conn, sid, rewards[sid], {})

    store._run_sync(op)
    store.rewards = rewards
    yield store
    asyncio.run(store.close())


def test_keyset_pages_walk_every_session_once_despite_ties(store):
    seen, cursor = [], None
    while True:
        page = store.list_sessions(ListFilter(limit=5, cursor=cursor))
        seen += [s["id"] for s in page["data"]]
        if not page["has_more"]:
            assert page["next_cursor"] is None
            break
        cursor = page["next_cursor"]
    assert sorted(seen) == sorted(store.rewards) and len(seen) == 12
    assert seen[:4] == ["g2-s3", "g2-s2", "g2-s1", "g2-s0"]  # newest first, then id descending


def test_filters(store):
    val = store.list_sessions(ListFilter(limit=50, split="val"))["data"]
    assert sorted(s["id"] for s in val) == ["g1-s0", "g1-s1", "g1-s2", "g1-s3"]
    high = store.list_sessions(ListFilter(limit=50, min_reward=0.5, max_reward=0.8))["data"]
    assert sorted(s["id"] for s in high) == sorted(k for k, r in store.rewards.items() if 0.5 <= r <= 0.8)
    timed = store.list_sessions(ListFilter(limit=50, since=1001.0, until=1002.0))["data"]
    assert {s["group_id"] for s in timed} == {"g1"}
    assert store.list_sessions(ListFilter(limit=50, group_id="g2"))["data"][0]["step"] == 1  # first call's step
    groups = store.list_groups(ListFilter(limit=50, min_reward=0.5))["data"]
    means = {
        g: statistics.mean(r for k, r in store.rewards.items() if k.startswith(g + "-")) for g in ("g0", "g1", "g2")
    }
    assert sorted(g["id"] for g in groups) == sorted(g for g, m in means.items() if m >= 0.5)
    for g in groups:
        assert g["reward_mean"] == pytest.approx(means[g["id"]]) and g["n_sessions"] == 4


def test_reward_curve_by_hand(store):
    curve = {(r["split"], r["step"]): r for r in store.reward_curve("agent")}
    assert set(curve) == {("train", 0), ("val", 0), ("train", 1)}
    train0 = [r for k, r in store.rewards.items() if k.startswith("g0-")]
    assert curve[("train", 0)]["n"] == 4
    assert curve[("train", 0)]["mean"] == pytest.approx(statistics.mean(train0))
    assert curve[("train", 0)]["std"] == pytest.approx(statistics.pstdev(train0))
    assert curve[("train", 0)]["max"] == pytest.approx(max(train0))


def test_bad_input_says_what_to_fix(store):
    with pytest.raises(InvalidRequest, match="next_cursor"):
        store.list_sessions(ListFilter(cursor="not-a-cursor"))
    with pytest.raises(InvalidRequest, match="limit"):
        store.list_groups(ListFilter(limit=0))
    with pytest.raises(InvalidRequest, match="finite"):
        store.list_sessions(ListFilter(min_reward=float("nan")))


def test_origin_filter_and_live_traffic_counts(store):
    """Live groups formed by rewards, a shadow group, and a reward too stale to train, beside the
    three harness groups: the origin filter picks each kind, the counts add them up."""
    store.insert_step("agent", 5, "/ckpt/5", {}, ["g0"])  # the newest step is now 5; g0 trained
    for sid, step in (("live-a", 5), ("live-b", 5), ("live-old", 0)):
        store.record_call_sync(dataclasses.replace(call(sid, None, "train", step, 2000.0), task_key="billing"))
    rule = LiveRule(group_size=2, max_staleness=2)
    old = asyncio.run(store.set_reward("live-old", 1.0, None, rule))
    assert old["trainable"] is False and old["reason"].startswith("stale")
    joined = [asyncio.run(store.set_reward(sid, 0.5, None, rule)) for sid in ("live-a", "live-b")]
    live_id = joined[0]["group_id"]
    assert joined[1]["group_id"] == live_id and store.get_group(live_id)["closed"]
    shadows = [
        dataclasses.replace(call(f"shadow-{i}", "shadow-g", "train", 5, 2001.0), task_key="billing") for i in range(3)
    ]
    shadows = [dataclasses.replace(c, shadow_of="live-a-0") for c in shadows]
    assert asyncio.run(store.record_shadow_group(shadows, origin="shadow")) == "shadow-g"
    store.insert_step("agent", 6, "/ckpt/6", {}, [live_id])

    def ids(**kw):
        return sorted(g["id"] for g in store.list_groups(ListFilter(limit=50, **kw))["data"])

    assert ids(origin="harness") == ["g0", "g1", "g2"]
    assert ids(origin="live") == [live_id]
    assert ids(origin="shadow") == ["shadow-g"]
    assert ids(origin="harness", state="trained") == ["g0"]
    assert ids(origin="shadow", state="pending") == ["shadow-g"]
    [live] = store.list_groups(ListFilter(origin="live"))["data"]
    assert live["origin"] == "live" and live["task_key"] == "billing" and live["n_sessions"] == 2
    [shadow] = store.list_groups(ListFilter(origin="shadow"))["data"]
    assert shadow["task_key"] == "billing" and shadow["n_sessions"] == 3
    assert store.get_session("shadow-1")["shadow_of"] == "live-a-0"
    with pytest.raises(InvalidRequest, match="origin") as info:
        store.list_groups(ListFilter(origin="upstream"))
    assert info.value.param == "origin"

    counts = store.counts()
    assert counts["groups"] == 5 and counts["sessions"] == 12 + 3 + 3
    assert {k: v for k, v in counts.items() if k.startswith(("groups_", "sessions_"))} == {
        "groups_harness": 3,
        "groups_harness_trained": 1,
        "groups_live": 1,
        "groups_live_trained": 1,
        "groups_shadow": 1,
        "groups_shadow_trained": 0,
        "sessions_stale": 1,
    }


@pytest.fixture(params=["sqlite", "postgres"])
def empty_store(request):
    if request.param == "sqlite":
        return SQLiteStore(memory=True)
    from gateway.store.postgres import PostgresStore

    return PostgresStore(request.getfixturevalue("postgres_db"))


def test_calls_per_minute_counts_each_minute(empty_store):
    # On PostgreSQL too: its CAST(float AS INTEGER) rounds where SQLite's truncates, which put
    # a call late in a minute into the next one (and one late in this minute in none).
    store = empty_store
    store._run_sync(
        lambda conn: [
            store_rows.insert_call(conn, call(f"s{i}", None, "train", 0, t, i))
            for i, t in enumerate((600.0, 610.0, 659.0, 660.0, 780.0))
        ]
    )
    minutes = store.calls_per_minute(now=800.0, minutes=4)
    assert minutes == [
        {"minute": 600, "calls": 3},
        {"minute": 660, "calls": 1},
        {"minute": 720, "calls": 0},
        {"minute": 780, "calls": 1},
    ]
    asyncio.run(store.close())


def test_calls_per_minute_counts_a_shadowed_call_once(empty_store):
    # --shadow-samples 3: the live call, then its shadow group (a copy of it and 3 samples).
    store = empty_store
    live = dataclasses.replace(call("client", None, "train", 0, 610.0), id="req_0123456789abcdef0000", step=None)
    shadows = [
        dataclasses.replace(
            live,
            id=store_rows.shadow_call_id(live.id, i),
            session_id=f"shadow-{live.id}-{i}",
            group_id=f"shadow-{live.id}",
            shadow_of=live.id,
            created_at=620.0,
        )
        for i in range(4)
    ]
    store._run_sync(lambda conn: [store_rows.insert_call(conn, c) for c in (live, *shadows)])
    assert store.calls_per_minute(now=620.0, minutes=1) == [{"minute": 600, "calls": 1}]
    asyncio.run(store.close())


def test_dashboard_poll_reads_the_sessions_written_since_the_last_one_with_the_same_curve(store):
    # The curve grouped every rewarded session by its first call's step at each poll (every 5 s
    # per open dashboard): 330 ms at 100,000 sessions on SQLite, more each session rewarded.
    from gateway.routes.lists import _dashboard_reads

    def long_ago(conn):  # the last of them an hour ago, the others long before
        conn.execute("UPDATE sessions SET updated_at = CASE WHEN id = 'g2-s3' THEN ? ELSE 1000.0 END", (now - 3600,))

    now = time.time()
    store._run_sync(long_ago)
    queries = []
    query = store._query

    def recording(sql, params=()):
        rows = query(sql, params)
        queries.append((sql, len(rows)))
        return rows

    store._query = recording

    def poll():
        queries.clear()
        return _dashboard_reads(store, "agent")[3]

    def same(curve):
        expected = store.reward_curve("agent")
        assert [(r["split"], r["step"], r["n"]) for r in curve] == [(r["split"], r["step"], r["n"]) for r in expected]
        for got, want in zip(curve, expected, strict=True):
            assert list(got) == list(want)
            for key in ("mean", "std", "min", "max"):
                assert got[key] == pytest.approx(want[key])

    same(poll())

    def write(conn):
        store_rows.insert_call(conn, call("new", "g3", "train", 2, now))  # a new step's session
        store_rows.set_reward(conn, "new", 0.75, {})
        store_rows.set_reward(conn, "g0-s1", 0.9, {})  # a reward changed
        store_rows.insert_call(conn, call("g2-s0", "g2", "train", None, now, 2))  # the base model answered: step 0

    store._run_sync(write)
    asyncio.run(store.discard_session("g1-s2"))
    curve = poll()
    read = list(queries)
    same(curve)
    assert {(r["split"], r["step"]) for r in curve} == {("train", 0), ("val", 0), ("train", 1), ("train", 2)}
    assert not [sql for sql, _ in read if "GROUP BY split, step" in sql]
    per_session = [(sql, n) for sql, n in read if "c.session_id = s.id" in sql]
    # The 4 sessions written since, and the one near the newest seen before: not all 13.
    assert [n for _, n in per_session] == [5]
