"""Shadow samples under --gpu-mode colocated: they never hold up the GPU's handover to the
trainer. The gateway drains live calls before vLLM sleeps, but a shadow sampling in vLLM is
background work it can always redo: it is called off at once, waits at the gate while the
trainer trains, and is sampled again once vLLM is awake (through the fake vLLM). The same for
the served model judging as `--shadow-judge-model self`: its call is asked again after the step."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai

from gateway.app import create_app
from gateway.colocate import GRANTED, acquire_gpu_for_training, release_gpu
from gateway.ruler.scoring import RESPONSE_FORMAT
from gateway.store.sqlite import SQLiteStore
from tests.fake_vllm import FakeState, create_fake_vllm
from tests.helpers import ThreadServer
from tests.helpers_judge import FakeJudge, good_answer
from tests.helpers_vllm import BASE, attached_engine, vllm_settings, wait_until


async def read_body(receive):
    """A request's whole body, and a `receive` that gives it again (then a disconnect) to the app behind."""
    chunks, more = [], True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    body = b"".join(chunks)
    replayed = iter([{"type": "http.request", "body": body, "more_body": False}])
    return body, lambda: asyncio.sleep(0, next(replayed, {"type": "http.disconnect"}))


async def held_until(released: threading.Event, receive) -> bool:
    """Hold a request until `released` (True), or until its client hangs up (False: vLLM aborts it)."""
    hung_up = asyncio.ensure_future(receive())  # the next message, once the body is read, is the disconnect
    while not released.is_set() and not hung_up.done():
        await asyncio.sleep(0.05)
    if hung_up.done():
        return False
    hung_up.cancel()
    return True


def holding_shadows(app, released: threading.Event, held: list):
    """`app` with every shadow request (vLLM `priority` set: background work) held until
    `released`, or until its client hangs up (vLLM then aborts it): a vLLM still generating long
    shadow samples. `held` lists each shadow request as it arrives."""

    async def holding(scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await app(scope, receive, send)
        body, replay = await read_body(receive)
        if json.loads(body).get("priority"):
            held.append(body)
            if not await held_until(released, receive):
                return None
        return await app(scope, replay, send)

    return holding


def _hand_over_while_held(vllm_url: str, settings, fake: FakeState, released: threading.Event, held: list):
    """One live call with shadows; while vLLM holds a request of them (`held`), the trainer asks
    for the GPU and must get it; then vLLM answers at once, the GPU is given back, and the shadow
    group must end judged. Returns the group and the dashboard's shadow summary."""
    app = create_app(settings, engine=attached_engine(vllm_url), store=SQLiteStore(settings.db_path))
    trainer_store = SQLiteStore(settings.db_path)  # the trainer's own connection, as in its own process
    try:
        with ThreadServer(app) as gateway:
            client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
            raw = client.chat.completions.with_raw_response.create(
                model="agent", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=1.0
            )
            call_id = raw.headers["x-request-id"]
            wait_until(lambda: held, what="a shadow's or the judge's request held in vLLM")

            # The trainer asks for the GPU while vLLM still works for the shadow group: it gets it.
            lease = acquire_gpu_for_training(trainer_store, "agent", timeout=30)
            assert fake.asleep and trainer_store.gpu_lease("agent")["state"] == GRANTED
            assert [e for e in fake.events if e["kind"] == "sleep"][-1]["in_flight"] == 0
            released.set()  # from now on vLLM answers at once
            release_gpu(trainer_store, "agent", None, lease.holder)

            # Awake again, what was called off is sent again and the group is recorded and judged.
            group = wait_until(
                lambda: (
                    (r := httpx.get(f"{gateway.url}/v1/groups/shadow-{call_id}")).status_code == 200
                    and r.json()["ruler_status"] == "scored"
                    and r.json()
                ),
                what="the shadow group judged",
            )
            summary = httpx.get(f"{gateway.url}/v1/dashboard").json()["live_traffic"]["shadow_samples"]
    finally:
        released.set()
        asyncio.run(trainer_store.close())
    return group, summary


def _colocated_shadows(tmp_path, vllm_url: str, judge_url: str):
    """A colocated gateway taking 2 shadow samples of each call, judged by `judge_url`."""
    return vllm_settings(
        tmp_path,
        vllm_url=vllm_url,
        gpu_mode="colocated",
        shadow_samples=2,
        shadow_judge_model="openai/judge",
        shadow_judge_api_base=judge_url,
    )


def test_a_shadow_sampling_in_vllm_does_not_hold_up_the_handover_and_is_sampled_again(tmp_path):
    fake, released, held = FakeState(base_model=BASE), threading.Event(), []
    with (
        FakeJudge() as judge,
        ThreadServer(holding_shadows(create_fake_vllm(fake), released, held)) as vllm,
    ):
        settings = _colocated_shadows(tmp_path, vllm.url, judge.url)
        group, summary = _hand_over_while_held(vllm.url, settings, fake, released, held)
    # Sent twice: called off for the trainer (vLLM never answered it), then sampled again.
    assert len(held) == 2 and len([e for e in fake.events if e["kind"] == "chat" and e["priority"]]) == 1
    assert fake.chats_while_asleep == 0
    assert group["n_sessions"] == 3 and group["n_rewarded"] == 3  # the live answer and its 2 shadows
    assert summary["completed"] == 1 and summary["failed"] == 0


def holding_judge(app, released: threading.Event, held: list):
    """`app` with every RULER judge request (its `response_format` is RULER's) held until
    `released`, or until its client hangs up: the served model thinking long as `self` judge.
    Once released, the judge answers well (the fake vLLM's own text is no judgement)."""

    async def holding(scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await app(scope, receive, send)
        body, replay = await read_body(receive)
        request = json.loads(body)
        if request.get("response_format") != RESPONSE_FORMAT:
            return await app(scope, replay, send)
        held.append(request)
        if not await held_until(released, receive):
            return None
        answered: list[dict] = []
        await app(scope, replay, lambda message: asyncio.sleep(0, answered.append(message)))
        reply = json.loads(b"".join(m.get("body", b"") for m in answered if m["type"] == "http.response.body"))
        reply["choices"][0]["message"]["content"] = good_answer(request)
        content = json.dumps(reply).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": content})

    return holding


def test_a_self_judge_thinking_in_vllm_does_not_hold_up_the_handover_and_is_asked_again(tmp_path):
    fake, released, held = FakeState(base_model=BASE), threading.Event(), []
    with ThreadServer(holding_judge(create_fake_vllm(fake), released, held)) as vllm:
        settings = vllm_settings(
            tmp_path, vllm_url=vllm.url, gpu_mode="colocated", shadow_samples=2, shadow_judge_model="self"
        )
        group, _ = _hand_over_while_held(vllm.url, settings, fake, released, held)
    assert len(held) == 2 and fake.chats_while_asleep == 0  # called off for the trainer, then asked again
    assert group["n_sessions"] == 3 and group["n_rewarded"] == 3


def _back_to_back_steps_while_held(vllm_url: str, settings, fake: FakeState, released: threading.Event, held: list):
    """One live call with shadows; while vLLM holds a request of them (`held`), the trainer takes the
    GPU (the request is called off) and gives it back; asked again and held again, the trainer asks
    for the GPU at once for its next step (ready groups waiting), and vLLM answers only then. Returns
    the shadow group once judged."""
    app = create_app(settings, engine=attached_engine(vllm_url), store=SQLiteStore(settings.db_path))
    trainer_store = SQLiteStore(settings.db_path)
    try:
        with ThreadServer(app) as gateway:
            client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
            raw = client.chat.completions.with_raw_response.create(
                model="agent", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=1.0
            )
            call_id = raw.headers["x-request-id"]
            wait_until(lambda: held, what="a shadow's or the judge's request held in vLLM")
            lease = acquire_gpu_for_training(trainer_store, "agent", timeout=30)  # step 1: called off
            release_gpu(trainer_store, "agent", None, lease.holder)
            wait_until(lambda: len(held) == 2, what="the request sent again once vLLM woke")

            next_step: list = []  # step 2, asked for at once
            trainer = threading.Thread(
                target=lambda: next_step.append(acquire_gpu_for_training(trainer_store, "agent", timeout=60))
            )
            trainer.start()
            wait_until(lambda: not app.state.services.gate.is_open, what="the handover for step 2 under way")
            released.set()  # vLLM answers now
            trainer.join()
            release_gpu(trainer_store, "agent", None, next_step[0].holder)
            return wait_until(
                lambda: (
                    (r := httpx.get(f"{gateway.url}/v1/groups/shadow-{call_id}")).status_code == 200
                    and r.json()["ruler_status"] == "scored"
                    and r.json()
                ),
                what="the shadow group judged",
            )
    finally:
        released.set()
        asyncio.run(trainer_store.close())


def _answered_before_the_last_sleep(fake: FakeState, priority: bool) -> bool:
    """Whether vLLM answered the request sent again (a shadow's: `priority`; else the judge's) before
    it went to sleep for step 2: the handover waited for it rather than calling it off again."""
    sleeps = [i for i, e in enumerate(fake.events) if e["kind"] == "sleep"]
    chats = [
        i
        for i, e in enumerate(fake.events)
        if e["kind"] == "chat" and (bool(e["priority"]) if priority else (e["request_id"] or "").startswith("ruler_"))
    ]
    return len(sleeps) == 2 and chats != [] and sleeps[0] < chats[0] < sleeps[1]


def test_back_to_back_steps_do_not_starve_a_self_judge(tmp_path):
    # A trainer with ready groups waiting takes the GPU again within a second of giving it back: a
    # judge that thinks longer was called off at every step, never answered (and never timed out).
    # Called off once, it is asked again and the next handover waits for it.
    fake, released, held = FakeState(base_model=BASE), threading.Event(), []
    with ThreadServer(holding_judge(create_fake_vllm(fake), released, held)) as vllm:
        settings = vllm_settings(
            tmp_path, vllm_url=vllm.url, gpu_mode="colocated", shadow_samples=2, shadow_judge_model="self"
        )
        group = _back_to_back_steps_while_held(vllm.url, settings, fake, released, held)
    assert len(held) == 2 and _answered_before_the_last_sleep(fake, priority=False)
    assert fake.chats_while_asleep == 0 and group["n_rewarded"] == 3


def test_back_to_back_steps_do_not_starve_shadow_sampling(tmp_path):
    fake, released, held = FakeState(base_model=BASE), threading.Event(), []
    with (
        FakeJudge() as judge,
        ThreadServer(holding_shadows(create_fake_vllm(fake), released, held)) as vllm,
    ):
        settings = _colocated_shadows(tmp_path, vllm.url, judge.url)
        group = _back_to_back_steps_while_held(vllm.url, settings, fake, released, held)
    assert len(held) == 2 and _answered_before_the_last_sleep(fake, priority=True)
    assert fake.chats_while_asleep == 0 and group["n_sessions"] == 3 and group["n_rewarded"] == 3
