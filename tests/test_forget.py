"""`rlproxy forget`: old traffic training no longer needs goes, with every row keyed by it; what a
group not yet done, a candidate step's canary or a pending shadow group still needs stays; steps stay.

Sessions are recorded, rewarded, trained and set aside through the store functions the gateway and
the trainer use; the cutoff is a moment taken between the old traffic and the new."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from gateway.cli import main
from gateway.forget import cutoff_from, seconds
from gateway.store import CallRecord, Store
from gateway.store.lists import ListFilter
from tests.helpers import call_row
from tests.helpers_upstream import openai_gateway


def call(call_id: str, session: str, group: str | None, split: str = "train", **extra) -> CallRecord:
    return call_row(
        call_id,
        session,
        group,
        split,
        model="agent",
        request={"messages": [{"role": "user", "content": call_id}]},
        response={"choices": [{"message": {"role": "assistant", "content": "ok"}}]},
        **extra,
    )


def rollouts(store: Store, group: str | None, sessions: list[str], rewards: list[float | None], split="train") -> None:
    for session, reward in zip(sessions, rewards, strict=True):
        store.record_call_sync(call(f"{session}-c1", session, group, split))
        store.record_call_sync(call(f"{session}-c2", session, group, split))
        if reward is not None:
            asyncio.run(store.set_reward(session, reward))
    if group is not None and all(r is not None for r in rewards):
        asyncio.run(store.close_group(group))


def train(store: Store, step: int, groups: list[str]) -> None:
    """What the trainer does with ready groups: claim them for a step, then record the step."""
    claimed = store.claim_for_step(groups, step)
    assert claimed == sorted(groups)
    sessions = [s["id"] for g in groups for s in store.get_group(g)["sessions"]]
    store.insert_step("agent", step, f"/ckpt/{step}", {"loss": 0.5 + step}, claimed, sessions, claimed=True)


def old_and_new_traffic(store: Store) -> float:
    """Record the scenario; returns the cutoff, a moment between the old traffic and the new."""
    rollouts(store, "trained", ["t1", "t2"], [1.0, 0.0])
    rollouts(store, "step2-old", ["o1", "o2"], [1.0, 0.0])
    rollouts(store, "step2-late", ["l1", "l2"], [1.0, 0.0])
    train(store, 1, ["trained"])
    train(store, 2, ["step2-old", "step2-late"])
    rollouts(store, "waiting", ["w1", "w2"], [1.0, None])  # a reward still to come
    rollouts(store, "ready", ["r1", "r2"], [1.0, 0.0])  # the trainer has not taken it yet
    rollouts(store, "claimed", ["k1", "k2"], [1.0, 0.0])
    rollouts(store, "skipping", ["s1", "s2"], [1.0, 0.0])
    assert store.claim_for_step(["claimed", "skipping"], 3) == ["claimed", "skipping"]  # a step training on them now
    store.mark_skipped(["skipping"], "no trainable sample")  # the step has yet to give it back
    rollouts(store, "judged-skipped", ["j1", "j2"], [None, None])
    scores = [{"trajectory_id": s, "score": v, "explanation": "x"} for s, v in (("j1", 1.0), ("j2", 1.0))]
    asyncio.run(store.record_judgement("judged-skipped", "judge", scores))
    store.mark_skipped(["judged-skipped"], "no spread")
    rollouts(store, "failed", ["f1", "f2"], [1.0, 0.0])
    store.mark_failed(["failed"], "training kept failing")
    rollouts(store, "val", ["v1", "v2"], [1.0, 0.0], split="val")  # never trained
    rollouts(store, "discarded", ["d1", "d2"], [1.0, None])  # d2 discarded: the group is ready, untrained
    asyncio.run(store.discard_session("d2", "rollout failed"))
    asyncio.run(store.close_group("discarded"))
    rollouts(store, None, ["loose", "loose-rewarded"], [None, 1.0])
    rollouts(store, None, ["thrown-away"], [None])
    asyncio.run(store.discard_session("thrown-away"))
    rollouts(store, None, ["shadowed"], [None])  # its call has a shadow group not judged yet
    shadow = call("shadow-shadowed-c1#0", "sh0", "shadow-shadowed-c1", shadow_of="shadowed-c1")
    assert asyncio.run(store.record_shadow_group([shadow])) == "shadow-shadowed-c1"
    store.insert_step("agent", 4, "/ckpt/4", {"loss": 0.1}, [], state="candidate")  # the canary compares ...
    rollouts(store, None, ["canary"], [1.0])  # ... the sessions started since it was recorded
    time.sleep(0.01)  # the cutoff strictly between the two: the clock's resolution, no assertion on time
    cutoff = time.time()
    time.sleep(0.01)
    store.record_call_sync(call("l1-late", "l1", "step2-late"))  # after training: kept, never trained
    rollouts(store, None, ["new"], [None])
    return cutoff


GONE = {"t1", "t2", "j1", "j2", "f1", "f2", "v1", "v2", "loose", "loose-rewarded", "thrown-away"}
STAYING = {
    "o1",
    "o2",
    "l1",
    "l2",
    "w1",
    "w2",
    "r1",
    "r2",
    "k1",
    "k2",
    "s1",
    "s2",
    "d1",
    "d2",
    "shadowed",
    "sh0",
    "canary",
    "new",
}


def session_ids(store: Store) -> set[str]:
    return {row["id"] for row in store._query("SELECT id FROM sessions")}


def test_forget_drops_what_training_no_longer_needs_on_either_backend(either_backend):
    store = either_backend
    cutoff = old_and_new_traffic(store)
    assert session_ids(store) == GONE | STAYING
    steps_before = store.steps("agent")
    extra = {"group_claims": 0} if store.backend == "postgres" else {}
    expected = {"sessions": 11, "calls": 22, "groups": 4, "judgements": 2, **extra}

    preview = store.forget(cutoff, dry_run=True, batch=2)  # batches of 2: the cursors and the steps across them
    assert preview.counts == expected and preview.kept_older == 16
    assert session_ids(store) == GONE | STAYING  # a dry run deletes nothing

    done = store.forget(cutoff, batch=2)
    assert done.counts == expected and done.kept_older == 16
    assert session_ids(store) == STAYING
    groups = {row["id"] for row in store._query("SELECT id FROM groups")}
    assert groups == {
        "step2-old",
        "step2-late",
        "waiting",
        "ready",
        "claimed",
        "skipping",
        "discarded",
        "shadow-shadowed-c1",
    }
    assert store._query("SELECT COUNT(*) AS n FROM calls WHERE session_id IN ('t1', 'loose')")[0]["n"] == 0
    assert store._query("SELECT COUNT(*) AS n FROM judgements")[0]["n"] == 0
    assert store.steps("agent") == steps_before  # steps and their metrics stay, trained groups' ids too
    assert store.forget(cutoff).counts == {table: 0 for table in expected}  # nothing left to forget

    # What stays still works: the lists, a ready group for the trainer, a reward to a group still waiting.
    listed = store.list_sessions(ListFilter(limit=100))
    assert {s["id"] for s in listed["data"]} == STAYING
    assert {g["id"] for g in store.list_groups(ListFilter(limit=100, state="trained"))["data"]} == {
        "step2-old",
        "step2-late",
    }
    assert {"ready", "discarded"} <= {g["id"] for g in store.ready_groups("agent")}
    asyncio.run(store.set_reward("w2", 0.5))
    assert store.get_group("waiting")["ready"] is False  # not closed: a harness closes it
    # A session id used again after it was forgotten starts afresh.
    store.record_call_sync(call("t1-again", "t1", None))
    assert store.get_session("t1")["n_calls"] == 1


def test_forget_of_one_model_leaves_the_others(either_backend):
    store = either_backend
    store.record_call_sync(call("a-1", "a", None))
    other = call("b-1", "b", None)
    other.model = "other"
    store.record_call_sync(other)
    time.sleep(0.01)
    cutoff = time.time()
    assert store.forget(cutoff, "other").counts["sessions"] == 1
    assert session_ids(store) == {"a"}


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["forget", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command_beside_a_running_gateway_then_its_lists_and_export(upstream, tmp_path, capsys, monkeypatch):
    from gateway.routes import reward_history

    monkeypatch.setattr(reward_history, "REREAD_EVERY", 0.0)  # the dashboard's whole reread, due at each poll
    state = tmp_path / "state"
    with openai_gateway(upstream.url, state) as (server, services):
        store = services.store
        with httpx.Client(base_url=server.url, timeout=30) as http:
            ask = {"model": "agent", "messages": [{"role": "user", "content": "hi"}]}
            for session in ("old-1", "old-2"):
                assert http.post("/v1/chat/completions", json=ask, headers={"X-Session-Id": session}).status_code == 200
            assert http.post("/v1/sessions/old-2/reward", json={"reward": 1.0}).status_code == 200
            before = http.get("/v1/dashboard").json()["reward_curve"]  # the dashboard keeps it between polls
            assert [(r["step"], r["n"], r["mean"]) for r in before] == [(0, 1, 1.0)]
            time.sleep(0.01)
            cutoff = time.time()
            time.sleep(0.01)
            assert http.post("/v1/chat/completions", json=ask, headers={"X-Session-Id": "new"}).status_code == 200

            code, out, err = run_cli(capsys, "--state-dir", str(state), "--before", repr(cutoff), "--dry-run")
            assert code == 0, err
            assert (
                "would forget (rows by table): sessions 2, calls 2, groups 0, judgements 0" in out and "dry run" in out
            )
            assert {s["id"] for s in http.get("/v1/sessions").json()["data"]} == {"old-1", "old-2", "new"}

            code, out, err = run_cli(capsys, "--state-dir", str(state), "--before", repr(cutoff))
            assert code == 0, err
            lines = out.splitlines()
            assert lines[0].startswith("cutoff: ") and lines[0].endswith("UTC (sessions last active before it)")
            assert lines[1] == "forgot (rows by table): sessions 2, calls 2, groups 0, judgements 0"
            assert "VACUUM" in out and str(state / "rlproxy.db") in out
            assert [s["id"] for s in http.get("/v1/sessions").json()["data"]] == ["new"]
            assert http.get("/v1/sessions/old-1").status_code == 404
            # The curve it kept counted old-2's reward: gone from the store, gone from the curve once it
            # is read whole again (every REREAD_EVERY s: no write tells a poll what was deleted).
            assert http.get("/v1/dashboard").json()["reward_curve"] == store.reward_curve("agent") == []
            # The gateway goes on recording, the forgotten session id too.
            assert http.post("/v1/chat/completions", json=ask, headers={"X-Session-Id": "old-1"}).status_code == 200
            assert http.get("/v1/groups").status_code == 200
        assert store.get_session("old-1")["n_calls"] == 1
    out_file = tmp_path / "export.jsonl"
    assert main(["export", "--state-dir", str(state), "--output", str(out_file)]) == 0
    assert sorted(json.loads(line)["id"] for line in out_file.read_text().splitlines()) == ["new", "old-1"]


def test_bad_input_is_refused_in_one_line(tmp_path, capsys):
    for argv, said in (
        (["--older-than", "30x"], "--older-than '30x' is not a duration: give a number and a unit"),
        (["--older-than=-3d"], "--older-than '-3d' is not a duration"),
        (["--before", "yesterday"], "--before 'yesterday' is not a time"),
        (["--before", "2999-01-01"], "--before 2999-01-01 is in the future"),
    ):
        code, out, err = run_cli(capsys, "--state-dir", str(tmp_path), *argv)
        assert code == 2 and out == "" and err.count("\n") == 1 and said in err, err
    code, out, err = run_cli(capsys, "--state-dir", str(tmp_path / "nowhere"), "--older-than", "30d")
    assert code == 2 and "no store at" in err and not (tmp_path / "nowhere").exists()


def test_durations_in_seconds():
    assert seconds("30d") == 30 * 24 * 60 * 60
    assert seconds("12h") == 43200 and seconds("90m") == 5400 and seconds("2w") == 1209600 and seconds("1.5s") == 1.5
    assert cutoff_from("1h", None, now=10_000.0) == 6400.0
    assert cutoff_from(None, "1970-01-01T01:00", now=10_000.0) == 3600.0


def test_a_reward_or_a_shadow_group_racing_forget_on_postgres_is_a_clean_answer(postgres_db):
    # Each read its session, then waited for its row's lock while forget deleted it: the row was gone
    # when the lock came, and `row[1]` of None was a TypeError (a 500), not the 404 a forgotten session gets.
    import threading

    from gateway.errors import NotFound
    from gateway.store.postgres import PostgresStore
    from gateway.store.retention import Plan, Progress, forget_batch

    store = PostgresStore(postgres_db)
    for session in ("rewarded", "shadowed"):
        store.record_call_sync(call(f"{session}-c1", session, None))
    time.sleep(0.01)
    cutoff = time.time()
    deleted, release = threading.Event(), threading.Event()

    def forgetting(conn):
        forget_batch(conn, Plan(cutoff), Progress())
        deleted.set()
        release.wait()  # not committed yet: the reward and the shadow group come meanwhile

    answers: dict[str, object] = {}

    def attempt(name, op):
        try:
            answers[name] = asyncio.run(op())
        except Exception as exc:  # noqa: BLE001 - the answer under test
            answers[name] = exc

    shadow = call("shadow-shadowed-c1#0", "sh0", "shadow-shadowed-c1", shadow_of="shadowed-c1")
    forget = threading.Thread(target=store._run_sync, args=(forgetting,))
    forget.start()
    deleted.wait()
    racers = [
        threading.Thread(target=attempt, args=("reward", lambda: store.set_reward("rewarded", 1.0))),
        threading.Thread(target=attempt, args=("shadow", lambda: store.record_shadow_group([shadow]))),
    ]
    for racer in racers:
        racer.start()
    waiting = "SELECT COUNT(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
    while any(r.is_alive() for r in racers) and store._query(waiting)[0]["n"] < 2:  # both wait for their row
        threading.Event().wait(0.01)
    release.set()
    forget.join()
    for racer in racers:
        racer.join()
    assert isinstance(answers["reward"], NotFound), answers
    assert answers["shadow"] is None  # recorded nothing, as for a live session discarded meanwhile
    assert session_ids(store) == set()
    asyncio.run(store.close())


def test_a_call_landing_while_forget_waits_for_its_group_is_kept_on_postgres(postgres_db, capsys):
    # Forget read the trained group as old, then waited for its lock held by a late call to one of its
    # sessions: deleting on what it read before would have taken the call acknowledged meanwhile with it.
    import threading

    from gateway.store.postgres import PostgresStore
    from gateway.store.rows import insert_call

    store = PostgresStore(postgres_db)
    rollouts(store, "trained", ["t1", "t2"], [1.0, 0.0])
    train(store, 1, ["trained"])
    rollouts(store, None, ["loose"], [None])
    time.sleep(0.01)
    cutoff = time.time()
    time.sleep(0.01)
    recorded, release = threading.Event(), threading.Event()

    def late_call(conn):
        insert_call(conn, call("t1-late", "t1", "trained"))
        recorded.set()
        release.wait()  # the group's row stays locked until forget waits for it

    calling = threading.Thread(target=store._run_sync, args=(late_call,))
    calling.start()
    recorded.wait()
    done = {}
    forgetting = threading.Thread(target=lambda: done.update(result=store.forget(cutoff)))
    forgetting.start()
    waiting = "SELECT COUNT(*) AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
    while forgetting.is_alive() and store._query(waiting)[0]["n"] == 0:
        threading.Event().wait(0.01)
    release.set()
    calling.join()
    forgetting.join()
    assert done["result"].counts["sessions"] == 1  # the loose one; the group's sessions are active again
    assert session_ids(store) == {"t1", "t2"}
    assert [c["id"] for c in store.session_calls("t1")] == ["t1-c1", "t1-c2", "t1-late"]
    asyncio.run(store.close())

    # The command on PostgreSQL: the backend's own table in the counts, and no word of the URL's password.
    assert main(["forget", "--store", postgres_db, "--older-than", "0s"]) == 0
    out = capsys.readouterr().out
    assert "forgot (rows by table): sessions 2, calls 5, groups 1, judgements 0, group_claims 0" in out
    assert "VACUUM" not in out and postgres_db not in out
