"""Two vLLM replicas behind one gateway, against the fake vLLM (tests/fake_vllm.py): which replica
answered each call is read from the replicas' own request logs (the gateway's request id, which
vLLM logs a call under), never from the gateway's word.

The real CPU vLLM pair is tests/test_replicas_real.py; what only GPUs show (a replica per GPU,
sleep and wake of several replicas) is tested here against two fake vLLM processes, which refuse
what vLLM refuses: an adapter loaded into a sleeping engine, a chat while asleep."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.app import create_app
from gateway.colocate import gpu_for_training
from gateway.engines.vllm.adapters import VLLMAdapters
from gateway.engines.vllm.build import build_vllm
from gateway.engines.vllm.replicas import VLLMReplicas
from gateway.engines.vllm.routing import rendezvous
from gateway.errors import EngineUnavailable
from gateway.settings import Settings
from gateway.store.sqlite import SQLiteStore
from tests.fake_vllm import FakeState, create_fake_vllm, prompt_ids_for
from tests.helpers import ThreadServer
from tests.helpers_vllm import BASE, FAKE_LAUNCHER, fake_state, make_adapter, vllm_settings, wait_until

SESSIONS = [f"session-{i}" for i in range(9)]  # odd: turns in rotation would not land on one replica by chance


class Fakes:
    """Two in-thread fake vLLMs, set up as rlproxy sets up vLLM; one can be stopped and started again
    on its port."""

    def __init__(self):
        self.states = [FakeState(base_model=BASE, logprobs_mode="processed_logprobs", generation_config="vllm")]
        self.states.append(FakeState(base_model=BASE, logprobs_mode="processed_logprobs", generation_config="vllm"))
        self.servers = [ThreadServer(create_fake_vllm(state)).__enter__() for state in self.states]
        self.urls = [server.url for server in self.servers]

    def stop(self, index: int) -> None:
        self.servers[index].__exit__(None, None, None)

    def start(self, index: int) -> None:
        if not self.servers[index].thread.is_alive():
            server = ThreadServer(create_fake_vllm(self.states[index]), port=self.servers[index].port)
            self.servers[index] = server.__enter__()

    def reset(self) -> None:
        for index, state in enumerate(self.states):
            self.start(index)
            state.loaded.clear()
            state.max_lora_rank, state.crash_after_chunks = 16, None

    def answered_by(self, request_ids: list[str]) -> dict[str, int]:
        """Which replica's log holds each call; a call in two logs fails the test."""
        wanted, seen = set(request_ids), {}
        for index, state in enumerate(self.states):
            for event in state.snapshot()["events"]:
                if event["kind"] == "chat" and event["request_id"] in wanted:
                    assert seen.setdefault(event["request_id"], index) == index, f"{event['request_id']} sent twice"
        return seen

    def close(self) -> None:
        for server in self.servers:
            server.__exit__(None, None, None)


class Gateway:
    """A real gateway (create_app under uvicorn) over the replicas at `urls`."""

    def __init__(self, url: str, services, store: SQLiteStore, engine: VLLMReplicas):
        self.url, self.services, self.settings, self.store, self.engine = (
            url,
            services,
            services.settings,
            store,
            engine,
        )
        self.http = httpx.Client(base_url=url, timeout=60)

    def chat(self, session: str, *, stream: bool = False) -> tuple[str, str]:
        """One call of `session`, which must succeed; (its request id, the text)."""
        if not stream:
            reply = self.http.post("/v1/chat/completions", json=_body(session), headers={"X-Session-Id": session})
            assert reply.status_code == 200, reply.text
            return reply.headers["x-request-id"], reply.json()["choices"][0]["message"]["content"]
        request_id, events = self.stream(session)
        assert events[-1] == "[DONE]" and not any("error" in event for event in events[:-1]), events
        chunks = [json.loads(event) for event in events[:-1]]
        return request_id, "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])

    def stream(self, session: str) -> tuple[str, list[str]]:
        body = {**_body(session), "stream": True}
        with self.http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": session}) as reply:
            assert reply.status_code == 200, reply.read()
            events = [line[len("data: ") :] for line in reply.iter_lines() if line.startswith("data: ")]
        return reply.headers["x-request-id"], events

    def health(self) -> dict:
        return self.http.get("/healthz").json()

    def train_step(self, step: int) -> None:
        """What the trainer leaves: a checkpoint (LoRA rank 16) and its step row; the gateway polls for it."""
        path = make_adapter(self.settings.checkpoints_dir(), f"{step:04d}")
        self.store.insert_step("agent", step, str(path), {}, [])


def _body(session: str) -> dict:
    return {"model": "agent", "messages": [{"role": "user", "content": f"hello from {session}"}], "max_tokens": 4}


@contextlib.contextmanager
def gateway(settings: Settings, *, health_interval: float, **build) -> Iterator[Gateway]:
    engine = build_vllm(settings, **build)
    assert isinstance(engine, VLLMReplicas)
    for replica in engine.replicas:
        replica.engine.supervisor.health_interval = health_interval
    store = SQLiteStore(settings.db_path)
    app = create_app(settings, engine=engine, store=store)
    with ThreadServer(app) as server:
        gw = Gateway(server.url, app.state.services, store, engine)
        try:
            yield gw
        finally:
            gw.http.close()


@pytest.fixture(scope="module")
def fakes() -> Iterator[Fakes]:
    pair = Fakes()
    try:
        yield pair
    finally:
        pair.close()


@pytest.fixture
def attached(fakes, tmp_path) -> Iterator[Gateway]:
    fakes.reset()
    # Health checks an hour apart: only the calls themselves find a replica gone.
    with gateway(vllm_settings(tmp_path, vllm_url=fakes.urls), health_interval=3600) as gw:
        yield gw
    fakes.reset()


def _homes(gw: Gateway, fakes: Fakes) -> dict[str, int]:
    """Each session's replica, from one call of each while both serve."""
    calls = {session: gw.chat(session)[0] for session in SESSIONS}
    where = fakes.answered_by(list(calls.values()))
    return {session: where[request_id] for session, request_id in calls.items()}


# ---------------------------------------------------------------------------- routing


def test_every_call_of_a_session_lands_on_one_replica(attached, fakes):
    calls: dict[str, list[str]] = {session: [] for session in SESSIONS}
    for turn in range(4):  # sessions interleaved, as concurrent agents' turns arrive
        for session in SESSIONS:
            calls[session].append(attached.chat(session, stream=turn % 2 == 1)[0])
    where = fakes.answered_by([rid for ids in calls.values() for rid in ids])
    replicas = {session: {where[rid] for rid in ids} for session, ids in calls.items()}
    assert all(len(answered) == 1 for answered in replicas.values()), replicas
    assert {next(iter(answered)) for answered in replicas.values()} == {0, 1}  # and the sessions spread


# ---------------------------------------------------------------------------- a replica down


@pytest.mark.parametrize("first", ["complete", "stream"])
def test_a_replica_that_is_down_has_its_sessions_answered_by_the_other(attached, fakes, first):
    homes = _homes(attached, fakes)
    moving = [session for session, home in homes.items() if home == 1]
    assert moving and len(moving) < len(SESSIONS)
    fakes.stop(1)
    # The first call finds replica 1 gone (refused before any byte came back) and is sent on; the
    # gateway knows it down from then on. Streamed or not, no call fails.
    calls = []
    for turn in range(2):
        for session in SESSIONS:
            calls.append(attached.chat(session, stream=(turn == 0) == (first == "stream"))[0])
    where = fakes.answered_by(calls)
    assert [where[rid] for rid in calls] == [0] * len(calls)

    health = httpx.get(attached.url + "/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok"  # replica 0 serves
    down = health.json()["replicas"][1]
    assert down["state"] == "down" and fakes.urls[1] in down["reason"], down
    assert health.json()["replicas"][0]["state"] == "ready"
    metrics = httpx.get(attached.url + "/metrics").text
    assert 'rlproxy_vllm_replica_up{replica="1"} 0.0' in metrics
    assert 'rlproxy_vllm_replica_up{replica="0"} 1.0' in metrics


def test_a_call_a_replica_had_started_answering_is_not_sent_again(attached, fakes):
    for state in fakes.states:
        state.crash_after_chunks = 2  # whichever replica takes it drops the stream after two chunks
    request_id, events = attached.stream("session-0")
    (error,) = [json.loads(event)["error"] for event in events if event != "[DONE]" and "error" in json.loads(event)]
    assert error["type"] == "engine_unavailable"  # a 503
    assert "went away while answering, after its answer had begun" in error["message"]
    assert len(fakes.answered_by([request_id])) == 1  # one replica's log only: never replayed on the other


# ---------------------------------------------------------------------------- one step everywhere


def test_a_replica_that_fails_a_step_leaves_rotation_for_it_until_it_loads_it(attached, fakes):
    homes = _homes(attached, fakes)
    fakes.states[1].max_lora_rank = 8  # replica 1 refuses the rank-16 adapter, as vLLM does (500)
    attached.train_step(1)

    health = wait_until(lambda: (h := attached.health())["step"] == 1 and h, what="step 1 serving as agent")
    zero, one = health["replicas"]
    assert zero["step"] == 1 and one["step"] is None
    assert "LoRA rank 16 is greater than max_lora_rank 8" in one["failed_adapters"]["agent@1"]
    assert "agent@1" in fakes.states[0].loaded and "agent@1" not in fakes.states[1].loaded

    calls = [attached.chat(session, stream=i % 2 == 1) for i, session in enumerate(SESSIONS)]
    assert all(text.startswith("[agent@1]") for _, text in calls)
    assert set(fakes.answered_by([rid for rid, _ in calls]).values()) == {0}  # replica 1's sessions too

    fakes.states[1].max_lora_rank = 16  # fixed: the retry loop loads it and replica 1 is back for agent@1
    wait_until(lambda: not attached.health()["replicas"][1]["failed_adapters"], what="replica 1 to load agent@1")
    assert fakes.states[1].loaded["agent@1"].endswith("0001")
    back = {session: attached.chat(session) for session in SESSIONS}
    where = fakes.answered_by([rid for rid, _ in back.values()])
    assert {session: where[rid] for session, (rid, _) in back.items()} == homes  # every session home again
    assert all(text.startswith("[agent@1]") for _, text in back.values())


def _on(replica: int) -> str:
    """A session whose home is `replica` (rendezvous over the pair's names)."""
    return next(s for s in (f"home-{i}" for i in range(100)) if rendezvous(s, ["replica-0", "replica-1"])[0] == replica)


def test_a_step_first_pinned_by_name_is_loaded_on_every_replica_before_it_serves(attached, fakes):
    attached.train_step(1)
    wait_until(lambda: [r["step"] for r in attached.health()["replicas"]] == [1, 1], what="step 1 on both")
    path = make_adapter(attached.settings.checkpoints_dir(), "0002")
    attached.store.insert_step("agent", 2, str(path), {}, [], state="candidate")  # not NAME's: none loads it
    reply = attached.http.post(
        "/v1/chat/completions", json={**_body("x"), "model": "agent@2"}, headers={"X-Session-Id": _on(0)}
    )
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"].startswith("[agent@2]")
    assert "agent@2" in fakes.states[0].loaded and "agent@2" not in fakes.states[1].loaded  # where its call went
    assert [r["adapters"] for r in attached.health()["replicas"]] == [["agent@1", "agent@2"], ["agent@1"]]

    promoted = attached.http.post("/v1/training/steps/2/promote", json={"model": "agent"})
    assert promoted.status_code == 200, promoted.text
    assert "agent@2" in fakes.states[1].loaded  # loaded there before NAME moved, not at a call's 404
    assert [r["step"] for r in attached.health()["replicas"]] == [2, 2]
    before = len([e for e in fakes.states[1].snapshot()["events"] if e["kind"] == "chat"])
    _, text = attached.chat(_on(1))
    assert text.startswith("[agent@2]")
    chats = [e for e in fakes.states[1].snapshot()["events"] if e["kind"] == "chat"][before:]
    assert [e["model"] for e in chats] == ["agent@2"]  # answered at once: no 404 and reload first


def test_a_replica_that_cannot_load_a_step_on_a_call_sends_the_call_to_the_other(attached, fakes):
    attached.train_step(1)
    wait_until(lambda: [r["step"] for r in attached.health()["replicas"]] == [1, 1], what="step 1 on both")
    fakes.states[1].loaded.clear()  # replica 1 restarted behind the gateway's back,
    fakes.states[1].max_lora_rank = 8  # now refusing the rank-16 adapter
    for stream in (False, True):
        # as before replica 1 first failed it (after that it is out of rotation for agent@1)
        attached.engine.replicas[1].engine.adapters.failed.clear()
        request_id, text = attached.chat(_on(1), stream=stream)
        assert text.startswith("[agent@1]")
        # replica 1 answered 404 and could not load it, so nothing had been answered: sent on to replica 0
        answered = [
            {e["request_id"] for e in state.snapshot()["events"] if e["kind"] == "chat"} for state in fakes.states
        ]
        assert request_id in answered[0] and request_id in answered[1]
    failed = attached.health()["replicas"][1]["failed_adapters"]
    assert "LoRA rank 16 is greater than max_lora_rank 8" in failed["agent@1"]


async def test_a_step_named_while_a_replica_reloads_is_loaded_before_it_is_ready(tmp_path):
    # A replica that came back re-loads its adapters (`reload_all`) before it is ready; a step named
    # meanwhile is recorded, not loaded (the replica is not ready): the reload must take it too.
    first, second = make_adapter(tmp_path, "0001"), make_adapter(tmp_path, "0002")

    class Client:
        url = "http://vllm"
        posted: list[str] = []

        async def post(self, route: str, body: dict) -> tuple[int, bytes]:
            self.posted.append(body["lora_name"])
            if body["lora_name"] == "agent@1":
                await adapters.load("agent@2", second, ready=False, asleep=False)
            return 200, b"{}"

    adapters = VLLMAdapters(Client())  # type: ignore[arg-type]
    adapters.paths["agent@1"] = first
    await adapters.reload_all(asleep=False)
    assert Client.posted == ["agent@1", "agent@2"] and adapters.holds() == {"agent@1", "agent@2"}


# ---------------------------------------------------------------------------- sleep and wake (GPU stand-in)


def test_colocated_training_sleeps_and_wakes_every_replica_and_loads_the_step_on_both(tmp_path):
    settings = vllm_settings(
        tmp_path, vllm_replicas=2, vllm_devices="0;1", gpu_mode="colocated", vllm_arg=["--gpu-memory-utilization=0.4"]
    )
    with gateway(settings, health_interval=0.2, launcher=FAKE_LAUNCHER, startup_timeout=60) as gw:
        urls = [replica.engine.url for replica in gw.engine.replicas]
        started = [fake_state(url) for url in urls]
        assert [s["env"]["CUDA_VISIBLE_DEVICES"] for s in started] == ["0", "1"]  # a GPU each
        assert all("--enable-sleep-mode" in s["argv"] and s["env"]["VLLM_SERVER_DEV_MODE"] == "1" for s in started)
        assert len({s["pid"] for s in started}) == 2

        held: list[tuple[str, str]] = []
        trainer_store = SQLiteStore(settings.db_path)  # the trainer's own connection, as in its own process
        with gpu_for_training(trainer_store, "agent", timeout=60) as lease:
            assert all(fake_state(url)["asleep"] for url in urls)  # the lease covers both
            assert [r["state"] for r in gw.health()["replicas"]] == ["asleep", "asleep"]
            caller = threading.Thread(target=lambda: held.append(gw.chat("held-session")))
            caller.start()
            wait_until(lambda: gw.services.gate.held == 1, what="the call held at the gate while training")
            gw.train_step(1)
            wait_until(lambda: gw.health()["step"] == 1, what="the new step named while asleep")
            assert not held
            lease.step = 1
        caller.join(timeout=60)

        assert held and held[0][1].startswith("[agent@1]")
        for url in urls:
            state = fake_state(url)
            assert state["chats_while_asleep"] == 0
            assert [e["kind"] for e in state["events"] if e["kind"] != "chat"] == ["sleep", "wake_up", "load"]
            assert [e["name"] for e in state["events"] if e["kind"] == "load"] == ["agent@1"]
        calls = [gw.chat(session) for session in SESSIONS]
        assert all(text.startswith("[agent@1]") for _, text in calls)
        logs = [{e.get("request_id") for e in fake_state(url)["events"]} for url in urls]
        assert all(sum(rid in log for log in logs) == 1 for rid, _ in calls)
        assert all(any(rid in log for rid, _ in calls) for log in logs)  # both serve again
        asyncio.run(trainer_store.close())
    assert not any(replica.engine.process.running for replica in gw.engine.replicas)
    assert [Path(p).name for p in sorted(str(p) for p in (tmp_path / "state").glob("vllm*.log"))] == [
        "vllm-1.log",
        "vllm.log",
    ]


def test_replicas_that_cannot_all_sleep_wake_again_and_serve_while_the_trainer_waits(fakes, tmp_path):
    # The lease covers every replica: with one down, the trainer cannot have its GPU. Those that
    # slept must wake again, or they would stay asleep in rotation and every call to them fail.
    fakes.reset()
    settings = vllm_settings(tmp_path, vllm_url=fakes.urls, gpu_mode="colocated")
    try:
        with gateway(settings, health_interval=0.2) as gw:
            fakes.stop(1)
            wait_until(lambda: gw.health()["replicas"][1]["state"] == "down", what="replica 1 seen down")
            trainer_store = SQLiteStore(settings.db_path)
            with pytest.raises(EngineUnavailable, match="did not lend the GPU"):
                with gpu_for_training(trainer_store, "agent", timeout=3):
                    pass
            asyncio.run(trainer_store.close())
            wait_until(lambda: not fakes.states[0].asleep, what="replica 0 awake again")
            kinds = [e["kind"] for e in fakes.states[0].snapshot()["events"] if e["kind"] in ("sleep", "wake_up")]
            assert kinds and kinds[0] == "sleep" and kinds[-1] == "wake_up"  # it did sleep, and woke each time
            assert gw.health()["replicas"][0]["state"] == "ready"
            calls = [gw.chat(session) for session in SESSIONS]  # replica 1's sessions too, on replica 0
            assert set(fakes.answered_by([rid for rid, _ in calls]).values()) == {0}
            assert fakes.states[0].chats_while_asleep == 0
    finally:
        fakes.reset()


def test_count_tokens_is_answered_while_a_replica_is_down(attached, fakes):
    """Anthropic's count_tokens asks any replica's /tokenize (each renders alike): one gone, the other counts."""
    fakes.stop(1)
    messages = [{"role": "user", "content": "count me"}]
    for _ in range(3):  # whichever replica the set tries first
        answer = attached.http.post("/v1/messages/count_tokens", json={"model": "agent", "messages": messages})
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"input_tokens": len(prompt_ids_for(messages))}
