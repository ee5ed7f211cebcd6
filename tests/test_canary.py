"""`--promote canary` on a real gateway (the tiny model): a sticky share of sessions tries the
candidate, the rewards the harness posts decide. The harness reads `X-Model-Step` and rewards by
the step that answered: steps up to `GOOD` earn 1.0 (SHOUT's rule: every answer right), later
steps lose a fixed 0.5. The trainer is played by `Publisher` (a PEFT checkpoint, then the row)."""

from __future__ import annotations

import time

import httpx
import pytest

from gateway.app import create_app
from gateway.promotion.canary import share_of
from gateway.settings import Settings
from tests.helpers import ThreadServer
from tests.test_hotswap import save_adapter
from tests.test_promotion import Publisher

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*tie_word_embeddings"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing"),
]

GOOD = 1  # steps up to here are good
SHARE = 0.3


def canary_settings(tmp_path, **overrides) -> Settings:
    values = dict(
        engine="local",
        state_dir=tmp_path,
        poll_interval=0.05,
        default_max_tokens=2,
        promote="canary",
        canary_share=SHARE,
        canary_min_sessions=6,
        canary_margin=0.1,
        watch_sessions=12,
    )
    return Settings(**{**values, **overrides})


def session(client: httpx.Client, sid: str, reward_of) -> list[str]:
    """Two calls of one session, then its reward; returns the steps that answered."""
    steps = []
    for _ in range(2):
        response = client.post(
            "/v1/chat/completions",
            headers={"X-Session-Id": sid, "X-Task-Id": "shout"},
            json={"model": "agent", "messages": [{"role": "user", "content": "Hi."}]},
        )
        assert response.status_code == 200, response.text
        steps.append(response.headers["x-model-step"])
    reward = client.post(f"/v1/sessions/{sid}/reward", json={"reward": reward_of(int(steps[0]))})
    assert reward.status_code == 200, reward.text
    return steps


def by_step(step: int) -> float:
    return 1.0 if step <= GOOD else 0.5


def until_decided(client, step: int, reward_of, prefix: str, seen: list) -> dict:
    """Sessions until step `step` is decided (a hang guard bounds it, not a speed requirement)."""
    for i in range(400):
        state = {r["step"]: r for r in client.get("/v1/training/steps").json()["data"]}[step]
        if state["state"] != "candidate":
            return state
        sid = f"{prefix}-{i}"
        seen.append((sid, session(client, sid, reward_of)))
    raise AssertionError(f"step {step} still undecided after 400 sessions")


def test_canary_promotes_the_good_step_and_rejects_the_first_bad_one(tmp_path):
    settings = canary_settings(tmp_path)
    publisher = Publisher(settings)
    publisher.publish(0, state="promoted")
    publisher.publish(1)
    seen: list[tuple[str, list[str]]] = []
    with ThreadServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        one = until_decided(client, 1, by_step, "a", seen)
        assert one["state"] == "promoted" and one["decision"]["by"] == "policy"
        assert one["decision"]["policy"] == "canary" and one["decision"]["candidate_sessions"] >= 6
        publisher.publish(2)  # worse by 0.5
        two = until_decided(client, 2, by_step, "b", seen)
        assert two["state"] == "rejected" and two["decision"]["reason"] == "the incumbent is better"
        assert two["decision"]["difference"] == pytest.approx(-0.5) and two["parent"] == 1
        health = client.get("/healthz").json()
        assert health["serving_step"] == 1 and health["candidate_step"] is None
        metrics = client.get("/metrics").text
        assert 'rlproxy_promotion_decisions_total{decision="promoted"} 1.0' in metrics
        assert 'rlproxy_promotion_decisions_total{decision="rejected"} 1.0' in metrics
        assert "rlproxy_serving_step 1.0" in metrics
        after = session(client, "after", by_step)
    assert after == ["1", "1"], "a rejected step never serves beyond its canary"
    for sid, steps in seen:
        assert steps[0] == steps[1], f"session {sid} saw two steps: {steps}"
    on_candidate = [sid for sid, steps in seen if steps[0] == ("1" if sid.startswith("a") else "2")]
    below = {sid for sid, _ in seen if share_of(f"session:{sid}") < SHARE}
    # The candidate answered only sessions its share hashes to, and all of them but (per candidate)
    # the one that started while its decision landed. Step 1 was promoted: the session that started
    # while that decision landed may have been answered by it as the new incumbent, whatever its hash.
    last_on_step_one = [sid for sid, _ in seen if sid.startswith("a")][-1]
    assert set(on_candidate) - below <= {last_on_step_one}
    assert len(below - set(on_candidate)) <= 2
    # These session ids hash to 20% below the share: the incumbent kept at least 1 - share of the sessions.
    assert len(on_candidate) / len(seen) <= SHARE, f"{len(on_candidate)} of {len(seen)} on the candidate"


def test_without_canary_the_bad_step_serves_everyone(tmp_path):
    settings = canary_settings(tmp_path, promote="always")
    publisher = Publisher(settings)
    for step in range(3):
        publisher.publish(step, state="promoted")
    with ThreadServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        served = [session(client, f"c-{i}", by_step) for i in range(6)]
    assert served == [["2", "2"]] * 6  # the control: the bad step reaches every user


def test_a_promoted_step_that_drops_is_rolled_back(tmp_path):
    settings = canary_settings(tmp_path)
    publisher = Publisher(settings)
    publisher.publish(0, state="promoted")
    publisher.publish(1)
    promoted_at: list[float] = []

    def drops_once_promoted(step: int) -> float:  # good during its canary, worse by 0.5 after
        return 0.5 if step == 1 and promoted_at else 1.0

    with ThreadServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        assert until_decided(client, 1, drops_once_promoted, "a", [])["state"] == "promoted"
        promoted_at.append(time.time())
        for i in range(60):
            rows = {r["step"]: r for r in client.get("/v1/training/steps").json()["data"]}
            if rows[1]["state"] == "rolled_back":
                break
            session(client, f"w-{i}", drops_once_promoted)
        assert rows[1]["state"] == "rolled_back" and rows[0]["state"] == "promoted"
        assert rows[1]["decision"]["reason"] == "dropped against step 0, which it replaced"
        # The store records the decision a moment before this gateway's registry follows it (the
        # same poll): a hang guard waits for the swap back, which must then hold for new sessions.
        for i in range(100):
            if session(client, f"swap-{i}", drops_once_promoted)[0] == "0":
                break
            time.sleep(0.05)
        assert [session(client, f"back-{i}", drops_once_promoted) for i in range(3)] == [["0", "0"]] * 3


def promotions(metrics: str) -> float:
    """The promotions this gateway decided, from its /metrics."""
    line = 'rlproxy_promotion_decisions_total{decision="promoted"} '
    return sum(float(row[len(line) :]) for row in metrics.splitlines() if row.startswith(line))


def test_two_replicas_on_postgresql_route_a_session_alike_and_decide_once(tmp_path, postgres_db):
    from gateway.store.postgres import PostgresStore

    settings = [canary_settings(tmp_path / name, store=postgres_db, canary_share=0.5) for name in ("a", "b")]
    publisher = Publisher(settings[0])
    publisher.store = PostgresStore(postgres_db)  # the files travel in the database: replica b fetches them
    publisher.publish(0, state="promoted")
    publisher.publish(1)
    with (
        ThreadServer(create_app(settings[0])) as a,
        ThreadServer(create_app(settings[1])) as b,
        httpx.Client(base_url=a.url, timeout=60) as http_a,
        httpx.Client(base_url=b.url, timeout=60) as http_b,
    ):
        for client in (http_a, http_b):  # both replicas have loaded the candidate
            for _ in range(400):
                if client.get("/healthz").json().get("candidate_step") == 1 and "agent@1" in {
                    m["id"] for m in client.get("/v1/models").json()["data"]
                }:
                    break
                time.sleep(0.05)
        alike = []
        for i in range(12):  # no reward yet, so no decision: each replica routes by the hash alone
            steps = []
            for client in (http_a, http_b, http_a):
                response = client.post(
                    "/v1/chat/completions",
                    headers={"X-Session-Id": f"r-{i}"},
                    json={"model": "agent", "messages": [{"role": "user", "content": "Hi."}]},
                )
                steps.append(response.headers["x-model-step"])
            alike.append(steps)
        assert all(len(set(steps)) == 1 for steps in alike), alike
        assert {steps[0] for steps in alike} == {"0", "1"}  # both sides answered some sessions
        for i in range(400):
            rows = {r["step"]: r for r in http_b.get("/v1/training/steps").json()["data"]}
            if rows[1]["state"] != "candidate":
                break
            session((http_a, http_b)[i % 2], f"d-{i}", by_step)
        assert rows[1]["state"] == "promoted"
        counts = [promotions(client.get("/metrics").text) for client in (http_a, http_b)]
        assert sum(counts) == 1, counts  # one decision, made once in the store; the other replica follows it
        assert {r["step"]: r["state"] for r in http_a.get("/v1/training/steps").json()["data"]}[1] == "promoted"
    publisher.store.close_sync()


def test_a_candidate_still_undecided_after_max_wait_is_rejected(tmp_path):
    settings = canary_settings(tmp_path, canary_max_wait=0.5)
    publisher = Publisher(settings)
    publisher.publish(0, state="promoted")
    publisher.publish(1)
    with ThreadServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(400):  # a hang guard: no session comes, so only the wait can decide
            row = {r["step"]: r for r in client.get("/v1/training/steps").json()["data"]}[1]
            if row["state"] != "candidate":
                break
            time.sleep(0.05)
        assert row["state"] == "rejected" and row["decision"]["candidate_sessions"] == 0
        assert row["decision"]["reason"] == "undecided after --canary-max-wait 0.5 s"
        assert session(client, "s", by_step) == ["0", "0"]


def test_a_candidate_whose_adapter_does_not_load_is_shown_and_rejected_after_max_wait(tmp_path):
    settings = canary_settings(tmp_path, canary_max_wait=3)
    publisher = Publisher(settings)
    publisher.publish(0, state="promoted")
    with ThreadServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        broken = settings.checkpoints_dir() / "0001"  # the trainer's files, damaged on their way
        broken.mkdir()
        (broken / "adapter_config.json").write_text("{not json")
        publisher.store.insert_step("agent", 1, str(broken.resolve()), {"loss": 0.0}, [], state="candidate")
        shown = []
        for _ in range(400):  # a hang guard: the load fails every look, only the wait can decide
            row = {r["step"]: r for r in client.get("/v1/training/steps").json()["data"]}[1]
            if row["state"] != "candidate":
                break
            shown.append(client.get("/healthz").json().get("candidate_load_error"))
            time.sleep(0.05)
        assert row["state"] == "rejected", "the trainer waits on a candidate: one that cannot load must not stall it"
        assert row["decision"]["reason"].startswith("undecided after --canary-max-wait 3 s: its adapter did not load")
        assert any(error and "agent@1" in error for error in shown), "/healthz says why the candidate serves no one"
        assert session(client, "s", by_step) == ["0", "0"]
        assert "candidate_load_error" not in client.get("/healthz").json()


def test_a_restart_long_after_the_watch_does_not_judge_the_step_by_everything_since(tmp_path):
    manual = canary_settings(tmp_path, promote="manual")  # no canary running: the history is written as it is
    publisher = Publisher(manual)
    publisher.publish(0, state="promoted")
    publisher.publish(1)
    with ThreadServer(create_app(manual)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        for i in range(12):  # step 0's sessions during step 1's canary
            assert session(client, f"canary-{i}", lambda step: 1.0) == ["0", "0"]
        since = {r["step"]: r for r in client.get("/v1/training/steps").json()["data"]}[1]["created_at"]
        record = {"by": "policy", "policy": "canary", "reason": "non-inferior", "candidate_since": since}
        publisher.store.decide_step("agent", 1, "promoted", record)  # as the canary records its promotion
        for i in range(100):  # a hang guard: the gateway follows the store at its next poll
            if session(client, f"swap-{i}", lambda step: 1.0)[0] == "1":
                break
            time.sleep(0.05)
        for i in range(12):  # its watch (--watch-sessions 12): as good as step 0
            assert session(client, f"watch-{i}", lambda step: 1.0) == ["1", "1"]
        for i in range(30):  # weeks later the users' tasks got harder: nothing to do with step 1
            session(client, f"later-{i}", lambda step: 0.5)
    app = create_app(canary_settings(tmp_path))  # a restart (a deploy): the canary's watch is in memory
    canary = app.state.services.registry.canary
    with ThreadServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(400):  # a hang guard: until the canary has looked at the serving step
            if 1 in canary._watched:
                break
            time.sleep(0.05)
        rows = {r["step"]: r for r in client.get("/v1/training/steps").json()["data"]}
        assert rows[1]["state"] == "promoted", rows[1]["decision"]
        assert session(client, "after", lambda step: 1.0) == ["1", "1"]


def test_healthz_says_what_an_undecided_canary_waits_for(tmp_path):
    settings = canary_settings(tmp_path)
    publisher = Publisher(settings)
    publisher.publish(0, state="promoted")
    publisher.publish(1)
    with ThreadServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        for i in range(8):  # sessions without a reward (or judged by RULER): the rule has nothing to count
            client.post(
                "/v1/chat/completions",
                headers={"X-Session-Id": f"n-{i}"},
                json={"model": "agent", "messages": [{"role": "user", "content": "Hi."}]},
            )
        for _ in range(400):  # a hang guard: until the canary has looked
            canary = client.get("/healthz").json().get("canary")
            if canary is not None:
                break
            time.sleep(0.05)
        created = {r["step"]: r for r in client.get("/v1/training/steps").json()["data"]}[1]["created_at"]
        assert canary["step"] == 1 and canary["candidate_sessions"] == canary["incumbent_sessions"] == 0
        assert canary["look"] == 0 and canary["sessions_for_next_look"] == 6  # --canary-min-sessions
        assert canary["max_wait_ends_at"] == pytest.approx(created + settings.canary_max_wait)


def test_a_candidate_trained_from_a_step_since_rolled_back_is_rejected_at_once(tmp_path):
    settings = canary_settings(tmp_path)
    publisher = Publisher(settings)
    publisher.publish(0, state="promoted")
    publisher.publish(1, state="promoted")
    publisher.store.decide_step("agent", 1, "rolled_back", {"by": "policy", "policy": "canary"})
    path = settings.checkpoints_dir() / "0002"  # trained from step 1, recorded a moment after its rollback
    save_adapter(publisher.base_dir, path, seed=2)
    publisher.store.insert_step("agent", 2, str(path.resolve()), {}, [], state="candidate", parent=1)
    with ThreadServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(400):  # a hang guard: no session is needed for this decision
            row = {r["step"]: r for r in client.get("/v1/training/steps").json()["data"]}[2]
            if row["state"] != "candidate":
                break
            time.sleep(0.05)
        assert row["state"] == "rejected" and row["decision"]["reason"] == "trained from step 1, which was rolled_back"
        assert session(client, "s", by_step) == ["0", "0"]


def test_a_watch_shorter_than_the_first_look_is_refused(tmp_path):
    from pydantic import ValidationError

    from gateway.promotion import rule

    # The watch tests at multiples of --canary-min-sessions: 50 sessions never reach the first look (100),
    # so however far a promoted step dropped, it would never be rolled back.
    assert rule.compare({"k": [0.0] * 50}, {"k": [1.0] * 900}, 0.0, 100).look == 0
    with pytest.raises(ValidationError, match="--watch-sessions 50 is below --canary-min-sessions 100"):
        Settings(state_dir=tmp_path, promote="canary", watch_sessions=50)
    assert Settings(state_dir=tmp_path, promote="canary", watch_sessions=0).watch_sessions == 0  # no watch, asked for
    assert Settings(state_dir=tmp_path, promote="manual", watch_sessions=50).watch_sessions == 50  # no canary


def test_a_session_keeps_the_step_it_started_on_across_a_decision_and_a_restart(tmp_path):
    """The step a session started on comes from the store's record of its first call where a
    gateway has not seen the session yet: a decision and a restart (or a second replica) between
    two of its calls do not mix two policies in one trajectory. New sessions get the new step."""
    settings = canary_settings(tmp_path, canary_min_sessions=1000, watch_sessions=0)
    publisher = Publisher(settings)
    publisher.publish(0, state="promoted")
    publisher.publish(1)
    sid = next(f"kept-{i}" for i in range(100) if share_of(f"session:kept-{i}") >= SHARE)  # the incumbent's

    def ask(client: httpx.Client, session_id: str) -> str:
        response = client.post(
            "/v1/chat/completions",
            headers={"X-Session-Id": session_id},
            json={"model": "agent", "messages": [{"role": "user", "content": "Hi."}]},
        )
        assert response.status_code == 200, response.text
        return response.headers["x-model-step"]

    with ThreadServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        assert ask(client, sid) == "0"
        decided = client.post("/v1/training/steps/1/promote", json={"model": "agent", "reason": "looks good"})
        assert decided.status_code == 200, decided.text
        assert ask(client, sid) == "0"  # this gateway remembers
    with ThreadServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        assert client.get("/healthz").json()["step"] == 1
        assert ask(client, sid) == "0"  # the restarted one reads it from the store
        assert ask(client, "new-after-restart") == "1"
