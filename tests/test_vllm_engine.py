"""The vllm engine against tests/fake_vllm.py, for what the real vLLM (tests/test_vllm_real.py,
its CPU build) cannot show or cannot be made to do on cue: sleep mode and GPU memory shares,
a chunk that carries token ids and no text, a crash after exactly N streamed chunks, a vLLM
started without rlproxy's flags, routes that are missing, a vLLM that cannot start. Every
message the fake answers with is the one the real server gave (tests/test_vllm_real.py checks
those on the real one)."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import torch

from gateway.app import create_app
from gateway.colocate import activate_step
from gateway.engines.base import EngineRequest
from gateway.engines.vllm.build import vllm_engine
from gateway.engines.vllm.engine import VLLMEngine
from gateway.engines.vllm.probes import check_logprobs_mode
from gateway.engines.vllm.server import max_lora_rank_for, vllm_command, vllm_environment, vllm_gpu_for
from gateway.engines.vllm.wire import ClientAsk, StreamSplitter, sampling_in_force, split_completion, vllm_body
from gateway.errors import ConfigError, EngineUnavailable, UpstreamError
from gateway.models.registry import resolve_base_model
from gateway.store import Store
from gateway.store.sqlite import SQLiteStore
from tests.fake_vllm import FAKE_LOGITS, prompt_ids_for
from tests.helpers import DropReusedProxy, ThreadServer
from tests.helpers_vllm import (
    BASE,
    FAKE_LAUNCHER,
    attached_engine,
    fake_state,
    fake_vllm_on_path,
    fake_vllm_process,
    fake_vllm_thread,
    free_port,
    make_adapter,
    script_fake,
    vllm_settings,
    wait_until,
)

MESSAGES = [{"role": "user", "content": "say hello"}]


class AppLoop:
    """Runs coroutines on the gateway's own event loop (where the engine's HTTP session lives)."""

    def __init__(self, app):
        self.loop = None

        @app.get("/_test/loop")
        async def _grab():
            self.loop = asyncio.get_running_loop()
            return {}

    def attach(self, url: str) -> AppLoop:
        httpx.get(url + "/_test/loop").raise_for_status()
        return self

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


class Gateway:
    def __init__(self, engine: VLLMEngine, settings, store: Store):
        self.engine, self.settings, self.store = engine, settings, store
        self.app = create_app(settings, engine=engine, store=store)
        self.services = self.app.state.services
        self.loop = AppLoop(self.app)
        self.server = ThreadServer(self.app)

    def __enter__(self) -> Gateway:
        self.server.__enter__()
        self.loop.attach(self.server.url)
        self.client = openai.OpenAI(base_url=self.server.url + "/v1", api_key="x", max_retries=0, timeout=60)
        return self

    def __exit__(self, *exc) -> None:
        self.server.__exit__(*exc)

    def train_step(self, step: int) -> Path:
        """What the trainer leaves behind (checkpoint + step row), then the gateway's hot-swap."""
        path = make_adapter(self.settings.checkpoints_dir(), f"{step:04d}")
        self.store.insert_step("agent", step, str(path), {}, [])
        self.loop.run(activate_step(self.services.registry, "agent", step))
        return path

    def calls(self, session: str) -> list[dict]:
        return self.store.session_calls(session)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-gw")
    # set up as rlproxy starts vLLM: processed logprobs, no generation-config defaults
    with fake_vllm_thread(logprobs_mode="processed_logprobs", generation_config="vllm") as (fake_server, fake):
        settings = vllm_settings(tmp, vllm_url=fake_server.url + "/v1")
        with Gateway(attached_engine(fake_server.url), settings, SQLiteStore(settings.db_path)) as gw:
            gw.fake, gw.fake_url, gw.tmp = fake, fake_server.url, tmp
            yield gw


@pytest.fixture(autouse=True)
def _reset_script(request):
    yield
    if "gateway" in request.fixturenames:
        gw = request.getfixturevalue("gateway")
        gw.fake.parser_holds, gw.fake.token_delay, gw.fake.crash_after_chunks = False, 0.0, None


def reference_mu(n: int, temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0, presence_penalty=0.0):
    """Independent of the fake's code: the processed distribution over FAKE_LOGITS computed with
    torch as vLLM's sampler does (penalties on raw logits - candidate 0 was seen -, temperature,
    top-k, top-p keeping the smallest head of mass >= p), and the logprob of each sampled token
    (candidate 0, or 1 at odd positions where it survives)."""
    logits = torch.tensor(FAKE_LOGITS, dtype=torch.float64)
    logits[0] = logits[0] / repetition_penalty - presence_penalty
    logits = logits / temperature
    if top_k > 0:
        logits[logits < torch.topk(logits, top_k).values[-1]] = -math.inf
    if top_p < 1:
        probs, order = torch.sort(torch.softmax(logits, -1), descending=True)
        before = torch.cumsum(probs, -1) - probs  # mass of the tokens ranked above
        logits[order[(before >= top_p) & (torch.arange(len(probs)) > 0)]] = -math.inf
    lp = torch.log_softmax(logits, -1).tolist()
    return [lp[1] if i % 2 and lp[1] != -math.inf else lp[0] for i in range(n)]


# ---------------------------------------------------------------------------- pure pieces


def test_vllm_serve_command_and_environment():
    cmd = vllm_command(
        BASE,
        port=8011,
        max_loras=3,
        lora_rank=20,
        sleep_mode=True,
        extra_args=["--gpu-memory-utilization=0.6", "--max-model-len=8192"],
    )
    assert cmd == [
        "vllm",
        "serve",
        BASE,
        "--host",
        "127.0.0.1",
        "--port",
        "8011",
        "--enable-lora",
        "--max-lora-rank",
        "32",
        "--max-loras",
        "3",
        "--generation-config",
        "vllm",
        "--logprobs-mode",
        "processed_logprobs",
        "--scheduling-policy",
        "priority",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--enable-sleep-mode",
        "--gpu-memory-utilization=0.6",
        "--max-model-len=8192",
    ]
    # vLLM's own tool parser, unless --vllm-arg names another
    mistral = vllm_command(
        BASE, port=1, max_loras=1, lora_rank=8, sleep_mode=False, extra_args=["--tool-call-parser", "mistral"]
    )
    assert "hermes" not in mistral and mistral[-2:] == ["--tool-call-parser", "mistral"]
    # ...and vLLM runs that parser only with auto tool choice on (else tool calls come back as text)
    assert "--enable-auto-tool-choice" in mistral
    for parser in (["--tool-call-parser=mistral"], ["--tool-call-parser", "mistral", "--enable-auto-tool-choice"]):
        cmd = vllm_command(BASE, port=1, max_loras=1, lora_rank=8, sleep_mode=False, extra_args=parser)
        assert cmd.count("--enable-auto-tool-choice") == 1 and "hermes" not in cmd, cmd
    # first come, first served for everything, if the user says so (shadows then share alike)
    fcfs = vllm_command(
        BASE, port=1, max_loras=1, lora_rank=8, sleep_mode=False, extra_args=["--scheduling-policy=fcfs"]
    )
    assert [a for a in fcfs if "scheduling-policy" in a] == ["--scheduling-policy=fcfs"]
    # --vllm-python: vLLM's server module in that environment, the same flags after it
    module = vllm_command(
        "/models/tiny",
        port=1,
        max_loras=1,
        lora_rank=8,
        sleep_mode=False,
        python="/venv/bin/python",
        served_name="rlproxy/tiny-qwen2",
    )
    assert module[:8] == [
        "/venv/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/models/tiny",
        "--served-model-name",
        "rlproxy/tiny-qwen2",
        "--host",
    ]
    # our share only where the user gave none; never a --quantization (no bitsandbytes in vLLM 0.28+)
    shared = vllm_command(BASE, port=1, max_loras=1, lora_rank=16, sleep_mode=True, memory_share=0.713)
    assert shared[-2:] == ["--gpu-memory-utilization", "0.71"] and "--quantization" not in shared
    assert "--gpu-memory-utilization" not in vllm_command(
        BASE, port=1, max_loras=1, lora_rank=16, sleep_mode=False, memory_share=0.7
    )
    assert "--enable-sleep-mode" not in vllm_command(BASE, port=1, max_loras=1, lora_rank=16, sleep_mode=False)
    assert [max_lora_rank_for(r) for r in (1, 2, 8, 16, 17, 64, 300)] == [1, 8, 8, 16, 32, 64, 320]
    with pytest.raises(ConfigError, match="512"):
        max_lora_rank_for(600)
    colocated = vllm_environment(sleep_mode=True, base={})
    assert colocated == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_SERVER_DEV_MODE": "1"}
    # the CPU build: a KV cache of 1 GiB unless the user set one
    assert vllm_environment(sleep_mode=False, base={}, cpu=True)["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert (
        vllm_environment(sleep_mode=False, base={"VLLM_CPU_KVCACHE_SPACE": "4"}, cpu=True)["VLLM_CPU_KVCACHE_SPACE"]
        == "4"
    )
    assert "VLLM_SERVER_DEV_MODE" not in vllm_environment(sleep_mode=False, base={})
    # the trainer's device decides vLLM's GPU, unless the user already chose one
    assert vllm_gpu_for("cuda:1", "colocated") == "1" and vllm_gpu_for("cuda:1", "dedicated") == "0"
    assert vllm_gpu_for("cuda", "dedicated") == "1" and vllm_gpu_for("cpu", "dedicated") is None
    assert (
        vllm_environment(sleep_mode=False, cuda_visible_devices="1", base={"CUDA_VISIBLE_DEVICES": "3"})[
            "CUDA_VISIBLE_DEVICES"
        ]
        == "3"
    )


def test_from_settings(tmp_path):
    # a built-in model: vLLM serves its built directory under the built-in name
    built_in = vllm_engine(vllm_settings(tmp_path, base_model="rlproxy/tiny-qwen2", vllm_port=8124))
    command = built_in.process.command
    assert command[command.index("serve") + 1] == resolve_base_model("rlproxy/tiny-qwen2", tmp_path / "state")
    assert command[command.index("--served-model-name") + 1] == "rlproxy/tiny-qwen2"
    attached = vllm_engine(vllm_settings(tmp_path, vllm_url="http://127.0.0.1:9/v1"))
    assert not attached.managed and attached.url == "http://127.0.0.1:9"
    managed = vllm_engine(
        vllm_settings(tmp_path, vllm_port=8123, vllm_arg=["--enforce-eager"], gpu_mode="colocated", device="cuda:0")
    )
    assert managed.managed and managed.url == "http://127.0.0.1:8123"
    assert managed.process.command[-4:] == [
        "--enable-sleep-mode",
        "--gpu-memory-utilization",
        "0.50",
        "--enforce-eager",
    ]  # no nvidia-smi here: the fallback share
    assert managed.process.env["VLLM_SERVER_DEV_MODE"] == "1"
    assert managed.process.log_path == tmp_path / "state" / "vllm.log"
    assert managed.kind == "vllm" and managed.supports_adapters and managed.base_model_id == BASE


def test_request_body_asks_for_token_ids_and_logprobs():
    body = {"model": "agent", "messages": MESSAGES, "temperature": 0.7}
    sent = vllm_body(body, "agent@3", ClientAsk.of(body))
    assert sent == {
        **body,
        "model": "agent@3",
        "return_token_ids": True,
        "logprobs": True,
        "top_logprobs": 0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
    }  # every field explicit: no generation-config default applies
    asked = {**body, "logprobs": True, "top_logprobs": 3}
    assert vllm_body(asked, BASE, ClientAsk.of(asked))["top_logprobs"] == 3
    # a shadow sample goes behind live calls (vLLM handles lower priorities first; live: its default 0)
    shadow = vllm_body(body, "agent@3", ClientAsk.of(body), background=True)
    assert shadow == {**sent, "priority": 10} and "priority" not in sent


def test_near_zero_temperatures_are_sent_and_recorded_as_vllm_samples_them():
    # vLLM raises (0, 1e-2) to 1e-2 before deciding greedy (< 1e-5): 1e-6 would sample at 1e-2
    # while rlproxy recorded 1e-6. Below 1e-5 rlproxy sends greedy (0); up to 1e-2, vLLM's floor.
    for asked, in_force in ((0, 0.0), (1e-6, 0.0), (9.9e-6, 0.0), (1e-3, 1e-2), (0.5, 0.5)):
        body = {"model": "agent", "messages": MESSAGES, "temperature": asked}
        assert sampling_in_force(body)["temperature"] == in_force, asked
        assert vllm_body(body, "agent@3", ClientAsk.of(body))["temperature"] == in_force, asked
    data = {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi"},
                "token_ids": [1],
                "logprobs": {"content": [{"token": "hi", "logprob": -0.5, "top_logprobs": []}]},
            }
        ],
        "prompt_token_ids": [7],
    }
    greedy = sampling_in_force({"messages": MESSAGES, "temperature": 1e-6})
    _, tokens = split_completion(data, ClientAsk(False, 0, False), greedy)
    assert tokens.choices[0].logprobs is None  # greedy: no mu recorded


@pytest.mark.parametrize(
    "message",
    [
        "This model's maximum context length is 2048 tokens. However, your prompt contains at least 2050 input "
        "tokens, which exceeds this limit even without any output tokens.",  # vLLM 0.32's serving layer
        "The decoder prompt (length 2050) is longer than the maximum model length of 2048. Make sure that "
        "`max_model_len` is no smaller than the number of text tokens.",  # its input processor (older, multimodal)
    ],
)
def test_a_prompt_past_vllms_context_is_the_clients_context_length_exceeded_in_either_phrasing(message):
    from gateway.engines.vllm.wire import status_error

    payload = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": None}}).encode()
    error = status_error(400, payload, "agent@1")
    assert (error.status_code, error.code, error.param) == (400, "context_length_exceeded", "messages")
    assert message in error.message


def test_misaligned_logprobs_are_dropped_not_recorded():
    data = {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi"},
                "token_ids": [1, 2],
                "logprobs": {"content": [{"token": "hi", "logprob": -0.5, "top_logprobs": []}]},
            }
        ],
        "prompt_token_ids": [7],
    }
    response, tokens = split_completion(data, ClientAsk(False, 0, False))
    assert tokens.choices[0].completion_ids == [1, 2] and tokens.choices[0].logprobs is None
    assert response["choices"][0]["logprobs"] is None and "prompt_token_ids" not in response
    # a chunk carrying only token ids (a parser held its text back) is not forwarded
    splitter = StreamSplitter(ClientAsk(False, 0, False))
    assert splitter.feed({"choices": [{"index": 0, "delta": {}, "logprobs": None, "token_ids": [5]}]}) is None


# ---------------------------------------------------------------------------- through the gateway


@pytest.mark.parametrize("stream", [False, True])
def test_a_keep_alive_connection_vllm_closed_is_not_the_next_calls_failure(tmp_path, stream):
    """vLLM (uvicorn) closes each idle connection just as the next request comes on it: that
    request never reached it, so it goes once more on a new connection, streamed or not, and
    so do the POSTs to vLLM's own API."""
    with (
        fake_vllm_thread(logprobs_mode="processed_logprobs", generation_config="vllm") as (fake_server, _),
        DropReusedProxy(fake_server.port) as vllm,
    ):
        settings = vllm_settings(tmp_path, vllm_url=vllm.url + "/v1")
        with Gateway(attached_engine(vllm.url), settings, SQLiteStore(settings.db_path)) as gw:
            for _ in range(3):
                reply = gw.client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=3, stream=stream)
                text = "".join(c.choices[0].delta.content or "" for c in reply if c.choices) if stream else None
                assert (text if stream else reply.choices[0].message.content) == f"[{BASE}] hello from"
            claude = anthropic.Anthropic(base_url=gw.server.url, api_key="x", max_retries=0)
            for _ in range(3):  # a POST to vLLM's own API (/tokenize; adapters and sleep go so too)
                assert claude.messages.count_tokens(model=BASE, messages=MESSAGES).input_tokens > 0
    assert vllm.dropped >= 4  # the stale connections were really met


def test_stream_records_tokens_from_chunks(gateway):
    gateway.fake.parser_holds = True  # the first token's chunk carries ids only
    chunks = list(
        gateway.client.chat.completions.create(
            model=BASE, messages=MESSAGES, max_tokens=5, stream=True, extra_headers={"X-Session-Id": "s-stream"}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == f"[{BASE}] hello from the fake"
    for chunk in chunks:
        dumped = chunk.model_dump()
        assert "prompt_token_ids" not in (chunk.model_extra or {})
        for choice in dumped["choices"]:
            assert choice["logprobs"] is None and "token_ids" not in choice
            assert choice["delta"] or choice["finish_reason"]  # no empty chunks reach the client
    (call,) = gateway.calls("s-stream")
    assert call["prompt_ids"] == prompt_ids_for(MESSAGES)
    assert call["completion_ids"] == [[5000, 5010, 5020, 5030, 5040]]
    assert call["behaviour_logprobs"] == [pytest.approx(reference_mu(5))]
    assert call["response"]["choices"][0]["message"]["content"] == text


async def test_a_misconfigured_vllm_is_caught(caplog):
    """The fake as vLLM starts by default (raw logprobs, generation-config defaults): an engine
    that left a field to vLLM would record T 0.7 / top_p 0.8 mu, and attaching warns."""
    with fake_vllm_thread() as (server, fake):
        engine = attached_engine(server.url)
        await engine.start()
        try:
            assert "returns raw logprobs" in caplog.text
            assert await check_logprobs_mode(engine.client, BASE) is False
            done = await engine.complete(
                EngineRequest(
                    body={"model": BASE, "messages": MESSAGES, "max_tokens": 4, "temperature": 0.5},
                    adapter=None,
                    request_id="r",
                )
            )
            assert fake.sampling[-1]["top_p"] == 1.0 and fake.sampling[-1]["top_k"] == -1  # not 0.8 / 20
            assert done.tokens.choices[0].logprobs != pytest.approx(reference_mu(4, temperature=0.5))  # raw
        finally:
            await engine.close()
    with fake_vllm_thread(logprobs_mode="processed_logprobs") as (server, fake):
        engine = attached_engine(server.url)
        await engine.start()
        try:
            assert await check_logprobs_mode(engine.client, BASE) is True
        finally:
            await engine.close()


# A top token this confident has a raw logprob of -1.3e-4: a probe that took "about 0" for
# "processed" (one token at top_k = 1) was fooled by it.
CONFIDENT_LOGITS = (12.0, 2.6, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0)


@pytest.mark.parametrize(
    ("mode", "logits", "verdict"),
    [
        ("raw_logprobs", CONFIDENT_LOGITS, False),
        ("processed_logprobs", CONFIDENT_LOGITS, True),
        ("raw_logprobs", None, False),
        ("processed_logprobs", None, True),
        ("raw_logits", None, False),
        ("processed_logits", None, False),
    ],
)
async def test_the_logprobs_mode_probe_is_not_fooled_by_a_confident_top_token(caplog, mode, logits, verdict):
    """The probe compares the top tokens' logprobs at T = 1 and T = 1/2: processed logprobs (of
    logits / T) double the gaps between them, raw ones keep them, however sure the model is."""
    with fake_vllm_thread(logprobs_mode=mode, generation_config="vllm", logits=logits) as (server, fake):
        engine = attached_engine(server.url)
        engine.client.open()
        try:
            if logits is not None and mode == "raw_logprobs":
                # what the old probe saw: the sampled top token's raw logprob is within 1e-3 of 0
                assert -1e-3 < math.log(1 / sum(math.exp(x - logits[0]) for x in logits)) < 0
            assert await check_logprobs_mode(engine.client, BASE) is verdict
        finally:
            await engine.close()
        temperatures = [s["temperature"] for s in fake.sampling]
        assert temperatures == [1.0, 0.5] and all(s["top_k"] == -1 and s["top_p"] == 1.0 for s in fake.sampling)
    assert ("returns raw logprobs" in caplog.text) == (mode == "raw_logprobs")
    assert ("returns logits, not logprobs" in caplog.text) == mode.endswith("_logits")


async def test_the_logprobs_mode_probe_says_when_it_cannot_tell(caplog):
    """Top tokens all alike (no gap to scale) or no logprobs in the answer: None, and it says so."""
    caplog.set_level("INFO", logger="rlproxy.engines.vllm")
    with fake_vllm_thread(logprobs_mode="raw_logprobs", logits=(1.0,) * 8) as (server, _):
        engine = attached_engine(server.url)
        engine.client.open()
        try:
            assert await check_logprobs_mode(engine.client, "no-such-model") is None  # a 404
            assert await check_logprobs_mode(engine.client, BASE) is None  # no gap
        finally:
            await engine.close()
    assert "no top logprobs in its answer" in caplog.text and "within 0.0000 of each other" in caplog.text
    assert "returns raw logprobs" not in caplog.text


# ---------------------------------------------------------------------------- sleep endpoints


async def test_sleep_wake_and_is_sleeping(tmp_path):
    with fake_vllm_thread() as (server, fake):
        engine = attached_engine(server.url)
        await engine.start()
        try:
            assert await engine.is_sleeping() is False
            await engine.sleep()
            assert await engine.is_sleeping() is True and fake.asleep
            # an adapter asked for while asleep is loaded on wake_up, not before
            path = make_adapter(tmp_path, "agent@2")
            await engine.load_adapter("agent@2", path)
            assert "agent@2" not in fake.loaded
            # nor does a recovery (a health blip while asleep) load into the sleeping server
            engine.supervisor.mark_down("a blip")
            await engine.supervisor.recover()
            assert "agent@2" not in fake.loaded
            # the stand-in refuses it as vLLM must (LoRA slots unmapped at level 1)
            async with httpx.AsyncClient() as client:
                refused = await client.post(
                    server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(path)}
                )
            assert refused.status_code == 500 and "sleeping" in refused.text
            await engine.wake_up()
            assert await engine.is_sleeping() is False
            assert "agent@2" in fake.loaded
            assert [e["kind"] for e in fake.events if e["kind"] != "chat"] == [
                "sleep",
                "load_refused_asleep",
                "wake_up",
                "load",
            ]
            assert [e for e in fake.events if e["kind"] == "sleep"][0]["level"] == 1
        finally:
            await engine.close()


async def test_sleep_without_dev_mode_says_how_to_enable_it():
    with fake_vllm_thread(dev_mode=False) as (server, _):
        engine = attached_engine(server.url)
        await engine.start()
        try:
            with pytest.raises(UpstreamError, match="VLLM_SERVER_DEV_MODE=1"):
                await engine.sleep()
        finally:
            await engine.close()


async def test_attaching_to_nothing_is_a_clear_error():
    engine = attached_engine(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(EngineUnavailable, match="no vLLM answers"):
        await engine.start()
    await engine.close()


# ---------------------------------------------------------------------------- crashes


def _expect_503(call):
    try:
        call()
    except openai.APIStatusError as exc:
        assert exc.status_code == 503, exc
        assert exc.body["type"] == "engine_unavailable"
        return exc.body["message"]
    return None


def _answers(client, model: str) -> str | None:
    try:
        return client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2).choices[0].message.content
    except (openai.APIStatusError, openai.APIConnectionError):
        return None


def test_managed_vllm_crash_mid_request_then_restart(tmp_path):
    settings = vllm_settings(tmp_path, vllm_arg=["--gpu-memory-utilization=0.5"])
    engine = vllm_engine(settings, launcher=FAKE_LAUNCHER, startup_timeout=60)
    engine.supervisor.health_interval = 0.1
    with Gateway(engine, settings, SQLiteStore(settings.db_path)) as gw:
        first = fake_state(engine.url)
        assert first["argv"][:2] == ["serve", BASE]
        assert "--enable-lora" in first["argv"] and "--gpu-memory-utilization=0.5" in first["argv"]
        assert first["env"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
        gw.train_step(1)

        # vLLM dies after two chunks of a stream: the client gets a clear error in the stream
        script_fake(engine.url, crash_after_chunks=2)
        with pytest.raises(openai.APIError) as info:
            list(
                gw.client.chat.completions.create(
                    model="agent",
                    messages=MESSAGES,
                    stream=True,
                    max_tokens=5,
                    extra_headers={"X-Session-Id": "s-crash"},
                )
            )
        assert "went away" in str(info.value)
        (call,) = gw.calls("s-crash")
        assert call["status"] == "error" and call["http_status"] == 503 and "restarting" in call["error"]

        # meanwhile: 503 engine_unavailable (or already an answer, if the restart won the race)
        message = _expect_503(lambda: gw.client.chat.completions.create(model="agent", messages=MESSAGES))
        assert message is None or "retry" in message

        # back: a new process, with the adapter loaded again before any request is let through
        text = wait_until(lambda: _answers(gw.client, "agent"), what="vLLM restarted")
        assert text.startswith("[agent@1]")
        second = fake_state(engine.url)
        assert second["pid"] != first["pid"] and "agent@1" in second["loaded"]

        # a crash before any byte of a non-stream answer: 503 too, and back again
        script_fake(engine.url, crash_after_chunks=0)
        message = _expect_503(lambda: gw.client.chat.completions.create(model="agent", messages=MESSAGES))
        assert "went away before answering" in message
        wait_until(lambda: _answers(gw.client, "agent"), what="vLLM restarted again")
    assert not engine.process.running  # the gateway stopped vLLM on the way out
    assert "rlproxy starts: " in (tmp_path / "state" / "vllm.log").read_text()


def test_the_managed_vllm_log_is_kept_under_its_bound_at_start_and_while_serving(tmp_path):
    """vLLM writes a line a request, the health probes' included, to STATE/vllm.log, and every start
    appended to it: a gateway that runs for weeks grew it without end. Past `MAX_BYTES` it moves
    to vllm.log.1 and starts again, at a start and while vLLM serves."""
    from gateway.engines.vllm.logfile import MAX_BYTES

    settings = vllm_settings(tmp_path)
    log_path = tmp_path / "state" / "vllm.log"
    log_path.parent.mkdir(parents=True)
    log_path.write_bytes(b"a line of an old run\n" * (MAX_BYTES // 20))
    engine = vllm_engine(settings, launcher=FAKE_LAUNCHER, startup_timeout=60)
    engine.supervisor.health_interval = 0.1
    with Gateway(engine, settings, SQLiteStore(settings.db_path)) as gw:
        old = tmp_path / "state" / "vllm.log.1"
        assert old.read_bytes().startswith(b"a line of an old run")
        assert log_path.stat().st_size < 2**20 and "rlproxy starts: " in log_path.read_text()

        with open(log_path, "ab") as log:  # as vLLM writes it: appended, for a long while
            log.write(b"a request\n" * (MAX_BYTES // 10 + 1))
        wait_until(lambda: log_path.stat().st_size < MAX_BYTES, what="the log trimmed while serving")
        assert old.read_bytes().endswith(b"a request\n")
        assert _answers(gw.client, "agent") is not None


def test_attached_vllm_that_restarts_is_reconnected(tmp_path):
    port = free_port()
    settings = vllm_settings(tmp_path, vllm_url=f"http://127.0.0.1:{port}")
    with fake_vllm_process(port) as url:
        engine = attached_engine(url)
        with Gateway(engine, settings, SQLiteStore(settings.db_path)) as gw:
            gw.train_step(1)
            assert _answers(gw.client, "agent").startswith("[agent@1]")
            script_fake(url, crash_after_chunks=0)
            message = _expect_503(lambda: gw.client.chat.completions.create(model="agent", messages=MESSAGES))
            assert "went away" in message
            wait_until(
                lambda: (
                    _expect_503(lambda: gw.client.chat.completions.create(model="agent", messages=MESSAGES)) is not None
                ),
                what="503 while vLLM is gone",
            )
            health = httpx.get(str(gw.client.base_url).removesuffix("/v1/") + "/healthz")
            assert health.status_code == 503 and health.json()["status"] == "degraded"
            assert health.json()["reason"].startswith("the vllm engine cannot serve")
            with fake_vllm_process(port) as again:  # whoever runs vLLM brings it back
                text = wait_until(lambda: _answers(gw.client, "agent"), what="reconnect")
                assert text.startswith("[agent@1]")
                assert "agent@1" in fake_state(again)["loaded"]
                health = httpx.get(str(gw.client.base_url).removesuffix("/v1/") + "/healthz")
                assert health.status_code == 200 and health.json()["status"] == "ok"


async def test_managed_vllm_that_cannot_start_says_why(tmp_path):
    settings = vllm_settings(tmp_path)
    dies = [sys.executable, "-c", "print('torch.OutOfMemoryError: CUDA out of memory'); raise SystemExit(3)"]
    engine = vllm_engine(settings, launcher=dies, startup_timeout=60)
    with pytest.raises(EngineUnavailable) as info:
        await engine.start()
    assert "exited with code 3" in info.value.message and "CUDA out of memory" in info.value.message
    await engine.close()
    missing = vllm_engine(settings, launcher=["vllm-not-installed-here"])
    with pytest.raises(ConfigError, match=r"rlproxy\[gpu\]"):
        await missing.start()
    await missing.close()


# ---------------------------------------------------------------------------- `vllm` on PATH


def _stand_ins(bin_dir: Path) -> str:
    """A `vllm` executable that is the fake server, and an `nvidia-smi` that reports an 80 GiB card."""
    path = fake_vllm_on_path(bin_dir)
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 81920\n")  # MiB, as --format=csv,noheader,nounits
    (bin_dir / "nvidia-smi").chmod(0o755)
    return path


@pytest.mark.parametrize(
    "mode, vllm_arg", [("colocated", []), ("dedicated", []), ("colocated", ["--gpu-memory-utilization=0.55"])]
)
async def test_managed_vllm_command_line_and_environment_through_path(tmp_path, monkeypatch, mode, vllm_arg):
    """Acceptance (issue 9): the managed vLLM as started through a stand-in `vllm` on PATH."""
    monkeypatch.setenv("PATH", _stand_ins(tmp_path / "bin"))
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    settings = vllm_settings(
        tmp_path,
        gpu_mode=mode,
        device="cuda:0",
        vllm_arg=vllm_arg,
        base_model="Qwen/Qwen2.5-7B-Instruct",
    )
    engine = vllm_engine(settings, startup_timeout=60)
    await engine.start()
    try:
        state = await asyncio.to_thread(fake_state, engine.url)
    finally:
        await engine.close()
    argv, env = state["argv"], state["env"]
    assert argv[:2] == ["serve", "Qwen/Qwen2.5-7B-Instruct"]
    assert argv[argv.index("--generation-config") + 1] == "vllm"
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    shares = [a for a in argv if a.startswith("--gpu-memory-utilization")]
    if mode == "dedicated":
        assert "--enable-sleep-mode" not in argv and not shares and env["VLLM_SERVER_DEV_MODE"] is None
        assert env["CUDA_VISIBLE_DEVICES"] == "1"
        return
    assert "--enable-sleep-mode" in argv and env["VLLM_SERVER_DEV_MODE"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "0"
    if vllm_arg:
        assert shares == ["--gpu-memory-utilization=0.55"]  # the user's share, and only it
    else:
        # 80 GiB card, 7B trainer in bf16: (80 - (13.04 + 2.5) - 1) / 80
        trainer_gib = 7e9 * 2 / 1024**3 + 2.5
        assert argv[argv.index("--gpu-memory-utilization") + 1] == f"{int((80 - trainer_gib - 1) / 80 * 100) / 100:.2f}"


def test_colocated_memory_share_from_card_and_model(tmp_path):
    from gateway.engines.vllm.memory import colocated_memory_share, params_from_model

    assert params_from_model("Qwen/Qwen2.5-7B-Instruct") == 7e9
    assert params_from_model("Qwen/Qwen2.5-0.5B-Instruct") == 0.5e9
    assert params_from_model("mistralai/Mixtral-8x7B-v0.1") == 56e9
    assert params_from_model("some/model") is None
    local = tmp_path / "m"
    local.mkdir()
    (local / "model.safetensors").write_bytes(b"\0" * 4000)
    assert params_from_model(str(local)) == 2000
    # by hand: 48 GiB card, 7B bf16 trainer = 13.04 + 2.5 GiB resident, 1 GiB margin -> 0.65
    assert colocated_memory_share(48, 7e9) == 0.65
    assert colocated_memory_share(141, 0.5e9) == 0.9  # capped
    with pytest.raises(ConfigError, match="dedicated"):
        colocated_memory_share(24, 7e9)  # vLLM's 7.4 GiB share cannot hold its 13 GiB of weights


async def test_adapter_routes_exist_with_the_env_var_alone(tmp_path):
    """As in vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING registers the routes; without --enable-lora a
    load is refused by the route (not a 404), and the error says what vLLM said."""
    with fake_vllm_thread(lora_enabled=False) as (server, _):
        engine = attached_engine(server.url)
        await engine.start()
        try:
            with pytest.raises(UpstreamError, match=r"\(400\).*--enable-lora"):
                await engine.load_adapter("agent@1", make_adapter(tmp_path, "agent@1"))
        finally:
            await engine.close()
    with fake_vllm_thread(lora_updating=False) as (server, _):
        engine = attached_engine(server.url)
        await engine.start()
        try:
            with pytest.raises(UpstreamError, match="no runtime LoRA routes.*VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
                await engine.load_adapter("agent@1", make_adapter(tmp_path, "agent@1"))
        finally:
            await engine.close()


def test_an_adapter_vllm_cannot_serve_is_refused_with_the_reason(tmp_path):
    from gateway.engines.vllm.adapters import refuse_unservable_targets

    path = make_adapter(tmp_path, "agent@1")
    config = json.loads((path / "adapter_config.json").read_text())
    refuse_unservable_targets("agent@1", path)  # no targets named: vLLM's own answer decides
    (path / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "v_proj"]}))
    refuse_unservable_targets("agent@1", path)
    (path / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "lm_head"]}))
    with pytest.raises(ConfigError, match="lm_head.*--engine vllm"):
        refuse_unservable_targets("agent@1", path)


def test_adapters_target_the_projections_only_so_vllm_serves_them():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.backends.peft import lora_targets

    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert lora_targets(model) == projections  # never lm_head: what vLLM serves, whatever the engine


def test_anthropic_count_tokens_is_vllms_tokenize(gateway):
    """vLLM renders and counts with the chat template it serves with: the count is its /tokenize's,
    the same the call itself then reports as its input tokens."""
    claude = anthropic.Anthropic(base_url=gateway.server.url, api_key="x", max_retries=0)
    asked = {"model": "agent", "messages": [{"role": "user", "content": "count me"}]}
    count = claude.messages.count_tokens(**asked).input_tokens
    assert count == len(prompt_ids_for(asked["messages"]))
    assert claude.messages.create(max_tokens=2, **asked).usage.input_tokens == count


def test_anthropic_stream_reports_input_tokens_at_message_start(gateway):
    """vLLM's usage in every chunk (continuous_usage_stats) tells the prompt's tokens with the first one."""
    claude = anthropic.Anthropic(base_url=gateway.server.url, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "count me"}]
    events = list(claude.messages.create(model="agent", max_tokens=3, messages=messages, stream=True))
    assert events[0].type == "message_start"
    assert events[0].message.usage.input_tokens == len(prompt_ids_for(messages))
    final = [event for event in events if event.type == "message_delta"][-1]
    assert (final.usage.input_tokens, final.usage.output_tokens) == (len(prompt_ids_for(messages)), 3)


def test_a_prompt_list_is_checked_against_vllms_context_before_any_prompt_is_answered(gateway):
    """vLLM refuses a prompt that fills its context (4,096 ids here, one per character): the second
    of a list, refused after the first was answered and recorded, left an answer the client never
    got in its session. /tokenize counts every prompt first."""
    answer = httpx.post(
        f"{gateway.server.url}/v1/completions",
        json={"model": "agent", "prompt": ["hi", "x" * 5000], "max_tokens": 2},
        headers={"X-Session-Id": "list-past-vllms-context"},
        timeout=30,
    )
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    assert error["message"].startswith("'prompt'[1]: this model's context is 4096 tokens")
    assert gateway.calls("list-past-vllms-context") == []
    fits = {"model": "agent", "prompt": ["hi", "x" * 4000], "max_tokens": 200}  # vLLM cuts the completion to fit
    assert httpx.post(f"{gateway.server.url}/v1/completions", json=fits, timeout=30).status_code == 200


def test_vllms_own_refusal_names_the_field_a_responses_or_completions_client_sent(gateway):
    """vLLM's 400 for a prompt past its context says 'messages'; a Responses client sent 'input'
    and a completions one 'prompt', as the local engine's refusal already names them."""
    url = gateway.server.url
    responses = httpx.post(f"{url}/v1/responses", json={"model": "agent", "input": "x" * 5000}, timeout=30)
    completions = httpx.post(f"{url}/v1/completions", json={"model": "agent", "prompt": "x" * 5000}, timeout=30)
    for answer, field in ((responses, "input"), (completions, "prompt")):
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert (error["param"], error["code"]) == (field, "context_length_exceeded")
        assert "vLLM rejected the request: This model's maximum context length is 4096" in error["message"]
