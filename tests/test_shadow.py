"""Shadow samples (issue 30, Deliver 2), on the built-in model behind a real socket, with RULER
reaching a loopback judge through litellm: K more completions of a live call, sampled in the
background from the step that answered it, never returned to the client nor recorded in its
session, ranked by the judge with the live answer, and recorded as a group of their own."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from pydantic import ValidationError

from gateway.adapters import Target
from gateway.app import create_app
from gateway.settings import Settings
from gateway.shadow.calls import shadow_body, why_not_shadowed
from gateway.shadow.sampler import ShadowSampler
from gateway.store import CallRecord
from gateway.store.sqlite import SQLiteStore
from tests.helpers import ThreadServer
from tests.helpers_judge import FakeJudge, good_answer, shown_ids

K = 3
MESSAGES = [{"role": "system", "content": "Be loud."}, {"role": "user", "content": "Shout!"}]


@pytest.fixture(scope="module")
def judge():
    with FakeJudge() as fake:
        yield fake


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, judge):
    with ThreadServer(create_app(shadow_settings(tmp_path_factory.mktemp("state"), judge.url))) as server:
        yield server


def shadow_settings(state_dir, judge_url: str) -> Settings:
    """K shadow samples of each live call, judged by the fake judge at `judge_url`."""
    return Settings(
        state_dir=state_dir,
        trainer="off",
        default_max_tokens=6,
        shadow_samples=K,
        shadow_judge_model="openai/judge",
        shadow_judge_api_base=judge_url,
    )


def ask(server, session_id: str, **extra):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    headers = {"X-Session-Id": session_id, **extra.pop("headers", {})}
    raw = client.chat.completions.with_raw_response.create(
        model="agent", messages=MESSAGES, max_tokens=6, extra_headers=headers, **extra
    )
    return raw.headers["x-request-id"], raw.parse()


def judged_group(server, call_id: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = httpx.get(f"{server.url}/v1/groups/shadow-{call_id}")
        if response.status_code == 200 and response.json().get("ruler_status") in ("scored", "failed"):
            return response.json()
        time.sleep(0.1)
    raise AssertionError(f"no judged shadow group for {call_id}")


def test_shadows_are_a_judged_group_of_their_own_and_never_reach_the_client(gateway, judge):
    asked_before = len(judge.bodies)
    call_id, reply = ask(gateway, "live-1", temperature=1.0, seed=1234)
    assert len(reply.choices) == 1  # the client asked for one answer and got one
    group = judged_group(gateway, call_id)
    assert group["ruler_status"] == "scored" and group["origin"] == "shadow" and group["closed"]
    sessions = group["sessions"]
    assert [s["id"] for s in sessions] == [f"shadow-{call_id}-{i}" for i in range(K + 1)]
    assert all(s["shadow_of"] == call_id and s["reward"] is not None for s in sessions)
    # The judge ranked the live answer and its K shadows together, in one request (RULER numbers
    # the distinct trajectories: equal answers are shown once and share a score).
    assert len(judge.bodies) == asked_before + 1
    distinct = {s["reward"] for s in sessions}
    assert 2 <= len(shown_ids(judge.bodies[-1])) <= K + 1 and len(distinct) >= 2
    # The client's session holds its own call only, as the client saw it.
    live = httpx.get(f"{gateway.url}/v1/sessions/live-1").json()
    assert [c["id"] for c in live["calls"]] == [call_id] and live["group_id"] is None
    assert live["calls"][0]["response"]["choices"][0]["message"]["content"] == reply.choices[0].message.content
    copy, *shadows = (httpx.get(f"{gateway.url}/v1/sessions/{s['id']}").json()["calls"][0] for s in sessions)
    assert copy["completion_ids"] == live["calls"][0]["completion_ids"]
    assert copy["prompt_ids"] == live["calls"][0]["prompt_ids"]
    for shadow in shadows:  # the same context and sampling, one completion each, no seed
        assert shadow["prompt_ids"] == live["calls"][0]["prompt_ids"]
        assert len(shadow["completion_ids"]) == 1 and len(shadow["behaviour_logprobs"][0]) == len(
            shadow["completion_ids"][0]
        )
        assert shadow["sampling"]["seed"] is None and copy["sampling"]["seed"] == 1234
        assert shadow["sampling"]["temperature"] == copy["sampling"]["temperature"] == 1.0
        assert shadow["step"] == copy["step"] and shadow["served"] == copy["served"]
    # Seeded alike, the shadows would all be the live answer; unseeded, the tiny model at T=1
    # writes K + 1 different six-token replies (a repeat is possible but far below 1 in 10^6).
    assert len({tuple(c["completion_ids"][0]) for c in [copy, *shadows]}) >= 3
    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert 'rlproxy_shadow_calls_total{outcome="completed"}' in metrics
    tokens = next(line for line in metrics.splitlines() if line.startswith("rlproxy_shadow_tokens_total"))
    assert float(tokens.split()[-1]) >= K
    assert 'rlproxy_shadow_judge_calls_total{outcome="scored"}' in metrics
    # The dashboard's overview shows the same counts, and the shadow group by its origin.
    dashboard = httpx.get(f"{gateway.url}/v1/dashboard").json()
    # Judge ranks within one turn are not rewards on the task's scale: not on the reward curve.
    assert dashboard["reward_curve"] == []
    live = dashboard["live_traffic"]
    shown = live["shadow_samples"]
    assert shown["completed"] >= 1 and shown["tokens"] >= K and shown["judge_calls"] >= 1
    assert shown["tokens"] == float(tokens.split()[-1])
    assert live["groups"]["shadow"]["total"] >= 1


def test_greedy_harness_and_val_calls_are_not_shadowed(gateway):
    greedy, _ = ask(gateway, "greedy-1", temperature=0.0)
    harness, _ = ask(gateway, "harness-1", temperature=1.0, headers={"X-Group-Id": "g-harness"})
    val, _ = ask(gateway, "val-1", temperature=1.0, headers={"X-Split": "val"})
    control, _ = ask(gateway, "control-1", temperature=1.0)
    judged_group(gateway, control)  # shadows run in call order: theirs would have come first
    for call_id in (greedy, harness, val):
        assert httpx.get(f"{gateway.url}/v1/groups/shadow-{call_id}").status_code == 404


def test_two_live_sessions_shadows_stay_apart(gateway):
    first, _ = ask(gateway, "apart-1", temperature=1.0)
    second, _ = ask(gateway, "apart-2", temperature=1.0)
    one, two = judged_group(gateway, first), judged_group(gateway, second)
    assert {s["shadow_of"] for s in one["sessions"]} == {first}
    assert {s["shadow_of"] for s in two["sessions"]} == {second}
    for session_id, call_id in (("apart-1", first), ("apart-2", second)):
        calls = httpx.get(f"{gateway.url}/v1/sessions/{session_id}").json()["calls"]
        assert [c["id"] for c in calls] == [call_id]


def test_a_gateway_stopped_while_its_judge_thinks_judges_the_group_again_once_restarted(tmp_path):
    """A shadow group whose judgement the shutdown cuts short says so, not a "running" that
    nothing runs any more; nothing but its judge ever rewards it, so the next gateway to start
    on the store judges it again."""
    asked, release = threading.Event(), threading.Event()

    def slow_answer(body: dict) -> str:
        asked.set()
        release.wait(60)
        return good_answer(body)

    with FakeJudge(answers=[slow_answer]) as judge:
        settings = shadow_settings(tmp_path, judge.url)
        with ThreadServer(create_app(settings)) as server:
            call_id, _ = ask(server, "stopped-1", temperature=1.0)
            assert asked.wait(60)
            assert httpx.get(f"{server.url}/v1/groups/shadow-{call_id}").json()["ruler_status"] == "running"
        release.set()
        store = SQLiteStore(settings.db_path)  # between the two gateways: what the first one left
        stopped = store.get_group(f"shadow-{call_id}")
        asyncio.run(store.close())
        with ThreadServer(create_app(settings)) as server:
            group = judged_group(server, call_id)
    assert stopped["ruler_status"] == "failed" and stopped["failed"] is None
    assert stopped["ruler_error"].startswith("the gateway stopped before the judge answered")
    assert group["ruler_status"] == "scored" and group["failed"] is None
    assert group["n_rewarded"] == group["n_sessions"] == K + 1
    assert len(judge.bodies) == 2  # the cut-short judgement, and the one after the restart


def test_the_openai_engine_refuses_the_shadow_flags_at_start(tmp_path):
    with pytest.raises(ValidationError, match="cannot run with --engine openai"):
        Settings(engine="openai", upstream_url="http://127.0.0.1:9/v1", shadow_samples=2, shadow_judge_model="j")
    with pytest.raises(ValidationError, match="needs a judge"):
        Settings(shadow_samples=2)
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--engine", "openai", "--upstream-url", "http://127.0.0.1:9/v1"]
        + ["--shadow-samples", "2", "--shadow-judge-model", "openai/j", "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "cannot run with --engine openai" in result.stderr


# ------------------------------------------------------------------ the sampler alone


def live_call(**overrides) -> CallRecord:
    fields = {
        "id": "req-1",
        "session_id": "s-1",
        "group_id": None,
        "split": "train",
        "model": "agent",
        "served": "agent@3",
        "step": 3,
        "engine": "local",
        "stream": False,
        "status": "ok",
        "request": {"model": "agent", "messages": MESSAGES, "seed": 7, "n": 1, "stream": True, "temperature": 0.8},
        "response": {"choices": [{"index": 0, "message": {"role": "assistant", "content": "A"}}]},
        "latency_ms": 1.0,
        "prompt_ids": [1, 2],
        "completion_ids": [[3]],
        "behaviour_logprobs": [[-0.2]],
        "sampling": {"temperature": 0.8, "seed": 7},
    }
    return CallRecord(**{**fields, **overrides})


def test_which_calls_are_shadowed():
    assert why_not_shadowed(live_call()) is None
    assert why_not_shadowed(live_call(sampling={"temperature": 0.0})) == "greedy"
    assert why_not_shadowed(live_call(group_id="g")) == "not live"
    assert why_not_shadowed(live_call(split="val")) == "val"
    assert why_not_shadowed(live_call(engine="openai")) == "no policy of ours"
    assert why_not_shadowed(live_call(status="error")) == "not answered"
    assert why_not_shadowed(live_call(completion_ids=[[3], [4]])) == "not one sampled choice"
    body = shadow_body(live_call().request, "agent@3", 5)
    assert body == {"model": "agent@3", "messages": MESSAGES, "temperature": 0.8, "n": 5}


class _Gate:
    in_flight = 0
    is_open = True

    def passage(self):
        return _Nothing()

    async def closing(self):  # never: no colocated trainer here
        await asyncio.Event().wait()


class _Nothing:
    async def __aenter__(self):
        return None

    async def __aexit__(self, *exc):
        return None


class _Registry:
    """Resolves what the sampler asks for; the alias has moved on to step 4 meanwhile."""

    current = 4

    def __init__(self):
        self.asked: list[str] = []

    def use(self, requested: str):
        self.asked.append(requested)
        registry = self

        class _Use:
            async def __aenter__(self):
                return Target(model=requested, adapter=requested, step=int(requested.split("@")[1]))

            async def __aexit__(self, *exc):
                registry.asked.append("released")

        return _Use()


class _Engine:
    def __init__(self):
        self.requests = []

    async def complete(self, request):
        from gateway.engines.base import ChoiceTokens, Completion, TokenRecord

        self.requests.append(request)
        n = request.body["n"]
        return Completion(
            response={"choices": [{"index": i, "message": {"role": "assistant", "content": "B"}} for i in range(n)]},
            tokens=TokenRecord([1, 2], [ChoiceTokens([5, 6], [-0.1, -0.2]) for _ in range(n)], {"temperature": 0.8}),
        )


def test_the_sampler_asks_for_the_step_that_answered_and_respects_its_cap(tmp_path):
    from types import SimpleNamespace

    from gateway.metrics import Metrics

    recorded: list[list[CallRecord]] = []
    judged: list[str] = []

    class _Store:
        async def record_shadow_group(self, calls, owner=None):
            recorded.append(calls)
            return calls[0].group_id

    class _Ruler:
        async def score_group(self, group_id, judge_model, rubric, api_base):
            judged.append((group_id, judge_model, api_base))
            return []

    engine, registry = _Engine(), _Registry()
    services = SimpleNamespace(
        chat=SimpleNamespace(gate=_Gate(), registry=registry, engine=engine),
        store=_Store(),
        extras={"ruler": _Ruler()},
    )
    settings = Settings(state_dir=tmp_path, shadow_samples=2, shadow_max_in_flight=1, shadow_judge_model="openai/j")
    sampler = ShadowSampler(services, settings, Metrics(), seed=0)

    async def main():
        sampler(live_call())
        sampler(live_call(id="req-2"))  # one already in flight: the cap drops this one
        await asyncio.gather(*sampler.tasks)

    asyncio.run(main())
    assert registry.asked == ["agent@3", "released"]  # the pinned step, not the alias
    assert engine.requests[0].adapter == "agent@3" and "seed" not in engine.requests[0].body
    assert [len(calls) for calls in recorded] == [3] and judged == [("shadow-req-1", "openai/j", None)]
    assert sampler.counts["dropped"] == 1 and sampler.counts["completed"] == 1 and sampler.counts["tokens"] == 4
    assert sampler.in_flight == 0


class _Waiting(_Engine):
    """Answers once `answer` is set; counts the calls cancelled before that."""

    def __init__(self):
        super().__init__()
        self.started, self.answer, self.cancelled = asyncio.Event(), asyncio.Event(), 0

    async def complete(self, request):
        self.started.set()
        try:
            await self.answer.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return await super().complete(request)


class _Polled(_Registry):
    """The alias at `step`; each look the sampler takes at it is counted, and after `answer_after`
    looks the engine answers (a long answer: it outlasts many looks)."""

    def __init__(self, step: int, engine: _Waiting, answer_after: int):
        super().__init__()
        self.step, self.engine, self.answer_after, self.looks = step, engine, answer_after, 0

    @property
    def current(self) -> int:
        self.looks += 1
        if self.looks >= self.answer_after:
            self.engine.answer.set()
        return self.step


def test_a_shadow_is_dropped_only_once_its_step_is_stale_and_drops_are_shown_per_task_key(tmp_path, monkeypatch):
    """No clock gives a shadow up: one whose answer outlasts 20 looks at the alias is recorded;
    one whose step falls more than --max-staleness (2) behind the alias while it samples is
    dropped, its engine call cancelled, and the dashboard's counts say which task key lost it."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from gateway.metrics import Metrics

    monkeypatch.setattr("gateway.shadow.sampler.STALE_POLL_S", 0.01)
    recorded: list[str] = []

    class _Store:
        async def record_shadow_group(self, calls, owner=None):
            recorded.append(calls[0].group_id)
            return calls[0].group_id

    class _Ruler:
        async def score_group(self, *args):
            return []

    settings = Settings(state_dir=tmp_path, shadow_samples=2, max_staleness=2, shadow_judge_model="openai/j")
    metrics = Metrics()

    async def shadow(live: CallRecord, answer_after: int, moves_to: int | None) -> ShadowSampler:
        engine = _Waiting()
        registry = _Polled(3, engine, answer_after)
        services = SimpleNamespace(
            chat=SimpleNamespace(gate=_Gate(), registry=registry, engine=engine), store=_Store(), extras={}
        )
        services.extras["ruler"] = _Ruler()
        sampler = ShadowSampler(services, settings, metrics, seed=0)
        sampler(live)
        if moves_to is not None:
            await engine.started.wait()
            registry.step = moves_to  # the trainer published steps 4, 5, 6 meanwhile
        await asyncio.wait_for(asyncio.gather(*sampler.tasks), 60)  # a guard: the looks end it
        assert engine.cancelled == (moves_to is not None)
        return sampler

    async def main():
        long = await shadow(live_call(id="req-a", task_key="task-a"), answer_after=20, moves_to=None)
        stale = await shadow(live_call(id="req-b", task_key="task-b"), answer_after=10**9, moves_to=6)
        return long.summary(), stale.summary()

    long, stale = asyncio.run(main())
    assert recorded == ["shadow-req-a"]
    assert long["completed"] == 1 and long["dropped"] == 0
    assert long["by_task_key"] == {"task-a": {"calls": 1, "dropped": 0, "drop_share": 0.0}}
    assert stale["completed"] == 0 and stale["dropped"] == 1
    assert stale["by_task_key"] == {"task-b": {"calls": 1, "dropped": 1, "drop_share": 1.0}}
    assert 'rlproxy_shadow_calls_total{outcome="dropped_stale"} 1.0' in generate_latest(metrics.registry).decode()
