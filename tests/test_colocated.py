"""One GPU for vLLM and the trainer (--gpu-mode colocated), through the fake vLLM.

The whole sequence with clients sending requests throughout: the trainer asks for the GPU
through the store, the gateway holds new requests and drains in-flight ones, puts vLLM to
sleep, the trainer trains and records a step, the gateway wakes vLLM, loads the new adapter
and releases the held requests, which are answered by the new step. None fails, and none
reaches vLLM while it sleeps.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest

from gateway.app import create_app
from gateway.colocate import (
    GRANTED,
    HANDOVER_LOG,
    IDLE,
    REQUESTED,
    acquire_gpu_for_training,
    gpu_for_training,
    holder_alive,
    is_stale,
    needs_gpu_lease,
    sampled_step,
)
from gateway.errors import EngineUnavailable
from gateway.store.sqlite import SQLiteStore
from tests.helpers import ThreadServer, stop_process
from tests.helpers_vllm import attached_engine, fake_vllm_thread, make_adapter, vllm_settings, wait_until

MESSAGES = [{"role": "user", "content": "hi"}]


class Traffic:
    """Clients that keep calling the gateway (streams and plain calls) until stopped."""

    def __init__(self, url: str, workers: int = 4):
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        self.stop = threading.Event()
        self.answers: list[tuple[float, str, str | None]] = []  # (finished at, text, X-Model-Step)
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(workers)]

    def _run(self, worker: int) -> None:
        turn = 0
        while not self.stop.is_set():
            turn += 1
            try:
                if (worker + turn) % 2:
                    with self.client.chat.completions.with_streaming_response.create(
                        model="agent", messages=MESSAGES, max_tokens=4, stream=True
                    ) as response:
                        step = response.headers.get("X-Model-Step")
                        text = "".join(
                            chunk.choices[0].delta.content or "" for chunk in response.parse() if chunk.choices
                        )
                else:
                    raw = self.client.chat.completions.with_raw_response.create(
                        model="agent", messages=MESSAGES, max_tokens=4
                    )
                    step, text = raw.headers.get("X-Model-Step"), raw.parse().choices[0].message.content
                self.answers.append((time.monotonic(), text, step))
            except BaseException as exc:  # noqa: BLE001 - every failure is a test failure
                self.errors.append(exc)

    def __enter__(self) -> Traffic:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)


@pytest.fixture
def colocated(tmp_path):
    with fake_vllm_thread(token_delay=0.01) as (fake_server, fake):
        settings = vllm_settings(tmp_path, vllm_url=fake_server.url, gpu_mode="colocated")
        app = create_app(settings, engine=attached_engine(fake_server.url), store=SQLiteStore(settings.db_path))
        with ThreadServer(app) as gateway:
            trainer_store = SQLiteStore(settings.db_path)  # the trainer's own connection, as in its own process
            yield gateway, app.state.services, fake, trainer_store, tmp_path
            asyncio.run(trainer_store.close())


def test_hold_drain_sleep_train_wake_load_release_with_traffic(colocated):
    gateway, services, fake, store, tmp_path = colocated
    colocator = services.extras["colocator"]
    with Traffic(gateway.url) as traffic:
        wait_until(lambda: len(traffic.answers) >= 8, what="traffic before training")

        with gpu_for_training(store, "agent", timeout=60) as lease:
            # the GPU is ours: vLLM sleeps, nothing is in flight, new requests wait at the gate
            assert fake.asleep and store.gpu_lease("agent")["state"] == GRANTED
            assert [e for e in fake.events if e["kind"] == "sleep"][-1]["in_flight"] == 0
            wait_until(lambda: services.gate.held >= 2, what="requests held while training")
            answered_before = len(traffic.answers)
            path = make_adapter(services.settings.checkpoints_dir(), "0001")  # "training"
            store.insert_step("agent", 1, str(path), {"loss": 0.1}, [])
            time.sleep(0.2)  # more requests pile up at the gate
            assert len(traffic.answers) == answered_before  # nothing was answered while vLLM slept
            lease.step = 1
        released_at = time.monotonic()

        wait_until(lambda: any(step == "1" for _, _, step in traffic.answers), what="an answer from step 1")
        count = len(traffic.answers)
        wait_until(lambda: len(traffic.answers) >= count + 8, what="traffic after training")

    assert traffic.errors == []
    assert fake.chats_while_asleep == 0
    kinds = [e["kind"] for e in fake.events if e["kind"] != "chat"]
    assert kinds == ["sleep", "wake_up", "load"]
    assert [e["name"] for e in fake.events if e["kind"] == "load"] == ["agent@1"]
    sleep_i, wake_i = (next(i for i, e in enumerate(fake.events) if e["kind"] == k) for k in ("sleep", "wake_up"))
    assert not [e for e in fake.events[sleep_i:wake_i] if e["kind"] == "chat"]
    assert [what for what, _ in colocator.log] == ["hold", "drained", "sleep", "granted", "wake", "loaded", "release"]
    # held requests resolve their adapter only once the gate opens, after the load: every
    # answer after the release comes from the new step
    late = [(text, step) for at, text, step in traffic.answers if at > released_at]
    assert late and all(step == "1" and text.startswith("[agent@1]") for text, step in late)
    assert store.gpu_lease("agent")["state"] == IDLE
    assert services.registry.current == 1


def test_a_trainer_that_dies_holding_the_gpu_does_not_stop_serving(colocated):
    gateway, services, fake, store, _ = colocated
    trainer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from gateway.store.sqlite import SQLiteStore\n"
            "from gateway.colocate import acquire_gpu_for_training\n"
            f"acquire_gpu_for_training(SQLiteStore({str(store.path)!r}), 'agent', timeout=60)\n"
            "print('granted', flush=True)\n"
            "time.sleep(120)\n",
        ],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert trainer.stdout.readline().strip() == b"granted"
        assert fake.asleep and not services.gate.is_open
    finally:
        stop_process(trainer)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=60)
    # held until the gateway notices the trainer is gone, then answered
    answer = client.chat.completions.create(model="agent", messages=MESSAGES, max_tokens=2)
    assert answer.choices[0].message.content.startswith("[")
    assert not fake.asleep and store.gpu_lease("agent")["state"] == IDLE
    assert fake.chats_while_asleep == 0


def test_the_hand_over_log_keeps_the_last_ones_only(colocated):
    """A colocated gateway lends the GPU at every training step, for weeks: its record of the
    hand-overs keeps the last ten, not every one since it started."""
    _, services, _, store, _ = colocated
    colocator = services.extras["colocator"]
    for step in range(1, 13):
        with gpu_for_training(store, "agent", timeout=60):
            pass
        wait_until(lambda: store.gpu_lease("agent")["state"] == IDLE, what=f"hand-over {step} over")
    assert len(colocator.log) == HANDOVER_LOG
    assert [what for what, _ in colocator.log][-6:] == ["hold", "drained", "sleep", "granted", "wake", "release"]


def test_without_a_gateway_the_request_is_withdrawn(tmp_path):
    store = SQLiteStore(tmp_path / "db.sqlite")
    with pytest.raises(EngineUnavailable, match="did not lend the GPU"):
        acquire_gpu_for_training(store, "agent", timeout=0.3, poll_interval=0.05)
    assert store.gpu_lease("agent")["state"] == IDLE
    # a request left by a trainer that died is taken over (and withdrawn again on timeout)
    dead = f"{socket.gethostname()}:999999999"
    assert not holder_alive(dead) and holder_alive(f"elsewhere:{1}")
    store.move_gpu_lease("agent", REQUESTED, expect=(IDLE,), holder=dead)
    with pytest.raises(EngineUnavailable):
        acquire_gpu_for_training(store, "agent", timeout=0.3, poll_interval=0.05)
    assert store.gpu_lease("agent")["state"] == IDLE
    asyncio.run(store.close())


def test_dedicated_mode_never_pauses_and_skips_stale_groups(tmp_path):
    with fake_vllm_thread() as (fake_server, fake):
        settings = vllm_settings(tmp_path, vllm_url=fake_server.url, gpu_mode="dedicated")
        assert not needs_gpu_lease(settings) and needs_gpu_lease(settings.model_copy(update={"gpu_mode": "colocated"}))
        app = create_app(settings, engine=attached_engine(fake_server.url), store=SQLiteStore(settings.db_path))
        with ThreadServer(app) as gateway:
            assert "colocator" not in app.state.services.extras
            store = SQLiteStore(settings.db_path)
            with pytest.raises(EngineUnavailable):  # nobody lends the GPU: it is not shared
                acquire_gpu_for_training(store, "agent", timeout=0.3, poll_interval=0.05)
            client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
            assert client.chat.completions.create(model="agent", messages=MESSAGES).choices
            assert not any(e["kind"] == "sleep" for e in fake.events)
            asyncio.run(store.close())
    # the trainer producing step 5 from step 4 with --max-staleness 2
    assert not is_stale(group_step=2, current_step=4, max_staleness=2)
    assert is_stale(group_step=1, current_step=4, max_staleness=2)
    assert is_stale(group_step=None, current_step=3, max_staleness=2)  # base model = step 0
    assert not is_stale(group_step=None, current_step=0, max_staleness=0)
    calls = [{"step": 3}, {"step": None}, {"step": 4}]
    assert sampled_step(calls) == 0 and sampled_step(calls[::2]) == 3 and sampled_step([]) == 0


def test_trainer_waits_for_vllm_health_and_frees_its_cache_before_release(tmp_path, monkeypatch):
    """Issue 9.1: the colocated trainer loads nothing before vLLM answers /health, and empties
    its CUDA cache before the lease is released (vLLM wakes into that memory)."""
    import gateway.colocate as colocate

    with fake_vllm_thread() as (server, _):
        assert colocate.wait_for_vllm(server.url, timeout=30, interval=0.05)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    assert not colocate.wait_for_vllm(closed, timeout=0.3, interval=0.05)

    store = SQLiteStore(tmp_path / "db.sqlite")
    order: list[str] = []
    monkeypatch.setattr(
        colocate, "acquire_gpu_for_training", lambda *a, **k: colocate.TrainingLease(model="agent", holder="h")
    )
    monkeypatch.setattr(colocate, "free_trainer_cache", lambda: order.append("free"))
    monkeypatch.setattr(colocate, "release_gpu", lambda *a, **k: order.append("release"))
    with colocate.gpu_for_training(store, "agent"):
        order.append("train")
    assert order == ["train", "free", "release"]


def test_a_vllm_that_cannot_sleep_lends_at_once_and_the_trainer_trains(tmp_path):
    """A CPU vLLM (or one attached without dev mode) has no /sleep: colocated is ignored, the
    lease is granted without pausing serving, and the step is still loaded when released."""
    with fake_vllm_thread(dev_mode=False) as (fake_server, fake):
        settings = vllm_settings(tmp_path, vllm_url=fake_server.url, gpu_mode="colocated")
        app = create_app(settings, engine=attached_engine(fake_server.url), store=SQLiteStore(settings.db_path))
        with ThreadServer(app) as gateway:
            services, store = app.state.services, SQLiteStore(settings.db_path)
            assert services.engine.can_sleep is False
            with Traffic(gateway.url) as traffic:
                with gpu_for_training(store, "agent", timeout=30) as lease:
                    count = len(traffic.answers)
                    wait_until(lambda: len(traffic.answers) >= count + 4, what="answers while training")
                    path = make_adapter(services.settings.checkpoints_dir(), "0001")
                    store.insert_step("agent", 1, str(path), {"loss": 0.1}, [])
                    lease.step = 1
                wait_until(lambda: any(step == "1" for _, _, step in traffic.answers), what="an answer from step 1")
            assert traffic.errors == [] and services.gate.held == 0
            assert [e["kind"] for e in fake.events if e["kind"] != "chat"] == ["load"]
            wait_until(lambda: store.gpu_lease("agent")["state"] == IDLE, what="the lease back to idle")
            asyncio.run(store.close())
