"""rlproxy in front of the real vLLM (its CPU build) serving the built-in model.

One `rlproxy serve --engine vllm --vllm-python ...` for the module, as a user starts it: the
gateway starts vLLM itself (managed), the trainer trains beside it (on CPU there is no GPU to
share, so the default `--gpu-mode colocated` is ignored), and every step's adapter is
hot-swapped into vLLM. A second gateway attaches to that same vLLM (`--vllm-url`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import stat
import threading
import time

import anthropic
import httpx
import openai
import psutil
import pytest

from gateway.engines.base import EngineRequest
from gateway.engines.vllm.client import VLLMClient
from gateway.engines.vllm.engine import VLLMEngine
from gateway.engines.vllm.probes import check_logprobs_mode
from gateway.errors import UpstreamError
from gateway.models.registry import resolve_base_model
from gateway.store.sqlite import SQLiteStore
from tests.helpers import gateway_process
from tests.helpers_judge import FakeJudge
from tests.helpers_real_vllm import (
    VLLM_VERSION,
    processed_logprobs,
    real_vllm,
    train_adapter_to_write,
    vllm_python,
)
from tests.helpers_vllm import vllm_http, wait_until

pytestmark = pytest.mark.timeout(900)

MESSAGES = [{"role": "user", "content": "Say something."}]


class Served:
    def __init__(self, url: str, state_dir, proc):
        # The managed vLLM's socket in the state dir (what --vllm-url unix:PATH attaches to)
        self.url, self.state_dir, self.vllm_url, self.proc = url, state_dir, f"unix:{state_dir / 'vllm.sock'}", proc
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        self.store = SQLiteStore(state_dir / "rlproxy.db")

    def chat(self, session: str, group: str | None = None, **kwargs):
        headers = {"X-Session-Id": session, **({"X-Group-Id": group} if group else {})}
        args = dict(model="agent", messages=MESSAGES, max_tokens=8, temperature=1.0)
        return self.client.chat.completions.with_raw_response.create(**{**args, **kwargs}, extra_headers=headers)

    def steps(self) -> list[dict]:
        return httpx.get(self.url + "/v1/training/steps", timeout=30).json()["data"]

    def train_group(self, group: str, rewards: list[float]) -> None:
        for i, reward in enumerate(rewards):
            self.chat(f"{group}-s{i}", group)
            httpx.post(
                f"{self.url}/v1/sessions/{group}-s{i}/reward", json={"reward": reward}, timeout=30
            ).raise_for_status()
        httpx.post(f"{self.url}/v1/groups/{group}/close", json={}, timeout=30).raise_for_status()

    def vllm_pids(self) -> list[int]:
        return [
            p.pid
            for p in psutil.Process(self.proc.pid).children(recursive=True)
            if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline())
        ]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    python = vllm_python()
    state = tmp_path_factory.mktemp("real-vllm")
    args = [
        "--engine",
        "vllm",
        "--vllm-python",
        python,
        "--state-dir",
        str(state),
        "--model-name",
        "agent",
        "--groups-per-step",
        "1",
        "--lora-rank",
        "8",
        "--learning-rate",
        "1e-3",
        "--poll-interval",
        "0.2",
    ]
    with gateway_process(args, startup_timeout=600) as (proc, url):
        yield Served(url, state, proc)


def test_the_gateway_starts_the_pinned_vllm_on_the_built_in_model(served):
    with vllm_http(served.vllm_url) as vllm:
        assert vllm.get("/version", timeout=10).json()["version"] == VLLM_VERSION
    command = [line for line in (served.state_dir / "vllm.log").read_text().splitlines() if "rlproxy starts:" in line][
        0
    ]
    assert "-m vllm.entrypoints.openai.api_server --model " in command
    assert "--served-model-name rlproxy/tiny-qwen2" in command
    assert "--tool-call-parser hermes" in command
    # On CPU there is no GPU to share: no sleep mode, whatever --gpu-mode says (colocated by default).
    assert "--enable-sleep-mode" not in command and "--dtype float32" in command
    assert "--scheduling-policy priority" in command  # shadow samples go behind live calls
    # On a socket in the private state dir, on no port: no other local user reaches it.
    socket = served.state_dir / "vllm.sock"
    assert f"--uds {socket}" in command and "--port" not in command
    assert stat.S_ISSOCK(socket.stat().st_mode) and stat.S_IMODE(served.state_dir.stat().st_mode) == 0o700
    (pid,) = served.vllm_pids()
    assert [c for c in psutil.Process(pid).net_connections("inet") if c.status == psutil.CONN_LISTEN] == []
    models = {m.id for m in served.client.models.list()}
    assert {"rlproxy/tiny-qwen2", "agent"} <= models


def probe_logprobs_mode(vllm_url: str) -> bool | None:
    """What the engine's start-up probe of an attached vLLM says about its --logprobs-mode."""

    async def probe() -> bool | None:
        client = VLLMClient(vllm_url, timeout=120)
        client.open()
        try:
            return await check_logprobs_mode(client, "rlproxy/tiny-qwen2")
        finally:
            await client.close()

    return asyncio.run(probe())


def test_the_logprobs_mode_probe_finds_processed_logprobs(served, caplog):
    """The vLLM the gateway started (--logprobs-mode processed_logprobs), probed as an attached one."""
    caplog.set_level("INFO", logger="rlproxy.engines.vllm")
    assert probe_logprobs_mode(served.vllm_url) is True
    assert "raw logprobs" not in caplog.text and "could not check" not in caplog.text


def test_the_logprobs_mode_probe_warns_about_a_raw_vllm(served, tmp_path, caplog):
    """A vLLM a user started to attach to without --logprobs-mode (raw_logprobs, vLLM's default):
    the probe says so and tells how to restart it."""
    caplog.set_level("INFO", logger="rlproxy.engines.vllm")
    model_dir = resolve_base_model("rlproxy/tiny-qwen2", served.state_dir)
    # Eager, as the vLLM rlproxy starts runs on CPU (with --enable-lora it compiles nothing):
    # without LoRA, vLLM's CPU build would spend ~45 s compiling the model with torch.compile
    # at start-up, which changes nothing of the logprobs mode the probe is about.
    log = tmp_path / "vllm-raw.log"
    with real_vllm(model_dir, log, logprobs_mode=None, extra_args=["--enforce-eager"]) as url:
        assert probe_logprobs_mode(url) is False
        port_flag = "--port " + url.rsplit(":", 1)[1]
        (server,) = [p for p in psutil.process_iter(["cmdline"]) if port_flag in " ".join(p.info["cmdline"] or [])]
        started = [server, *server.children(recursive=True)]  # its engine core too
    assert "returns raw logprobs" in caplog.text and "--logprobs-mode processed_logprobs" in caplog.text
    assert not psutil.wait_procs(started, timeout=10)[1]  # none left behind


def test_chat_records_token_ids_and_the_processed_logprobs(served):
    from transformers import AutoModelForCausalLM

    result = served.chat(
        "mu", model="rlproxy/tiny-qwen2", temperature=0.5, top_p=0.5, extra_body={"top_k": 20}, max_tokens=16
    )
    completion = result.parse()
    assert completion.choices[0].logprobs is None  # the client asked for none
    assert not hasattr(completion.choices[0], "token_ids") or completion.choices[0].token_ids is None
    (call,) = served.store.session_calls("mu")
    prompt, (ids,), (mu,) = call["prompt_ids"], call["completion_ids"], call["behaviour_logprobs"]
    assert prompt and len(ids) == len(mu) > 0
    model = AutoModelForCausalLM.from_pretrained(resolve_base_model("rlproxy/tiny-qwen2", served.state_dir)).eval()
    expected = processed_logprobs(model, prompt, ids, temperature=0.5, top_p=0.5, top_k=20)
    assert max(abs(a - b) for a, b in zip(mu, expected, strict=False)) < 1e-4, (mu, expected)


def test_streamed_chat_records_the_same_as_whole(served):
    chunks = list(
        served.client.chat.completions.create(
            model="agent", messages=MESSAGES, max_tokens=8, stream=True, extra_headers={"X-Session-Id": "stream"}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    (call,) = served.store.session_calls("stream")
    assert call["status"] == "ok" and call["stream"]
    assert len(call["completion_ids"][0]) == len(call["behaviour_logprobs"][0]) > 0
    assert call["response"]["choices"][0]["message"]["content"] == text


def test_penalties_are_in_the_recorded_logprobs(served):
    from transformers import AutoModelForCausalLM

    penalties = dict(presence_penalty=0.5, frequency_penalty=0.3)
    served.chat(
        "penalised",
        model="rlproxy/tiny-qwen2",
        temperature=0.8,
        max_tokens=24,
        extra_body={"top_k": 20, "repetition_penalty": 1.2},
        **penalties,
    )
    (call,) = served.store.session_calls("penalised")
    assert {
        k: call["sampling"][k]
        for k in ("presence_penalty", "frequency_penalty", "repetition_penalty", "top_k", "temperature")
    } == {**penalties, "repetition_penalty": 1.2, "top_k": 20, "temperature": 0.8}
    prompt, (ids,), (mu,) = call["prompt_ids"], call["completion_ids"], call["behaviour_logprobs"]
    model = AutoModelForCausalLM.from_pretrained(resolve_base_model("rlproxy/tiny-qwen2", served.state_dir)).eval()
    expected = processed_logprobs(model, prompt, ids, temperature=0.8, top_k=20, repetition_penalty=1.2, **penalties)
    assert max(abs(a - b) for a, b in zip(mu, expected, strict=False)) < 1e-4, (mu, expected)
    unpenalised = processed_logprobs(model, prompt, ids, temperature=0.8, top_k=20)
    assert max(abs(a - b) for a, b in zip(mu, unpenalised, strict=False)) > 1e-2  # the penalties did change mu


def test_the_client_gets_only_what_it_asked_for(served):
    result = served.chat("asked", model="rlproxy/tiny-qwen2", max_tokens=3, logprobs=True, top_logprobs=2, n=2)
    raw = result.http_response.json()
    assert "prompt_token_ids" not in raw and all("token_ids" not in choice for choice in raw["choices"])
    completion = result.parse()
    (call,) = served.store.session_calls("asked")
    assert len(completion.choices) == len(call["completion_ids"]) == 2
    for choice, ids, mu in zip(completion.choices, call["completion_ids"], call["behaviour_logprobs"], strict=False):
        entries = choice.logprobs.content
        assert [len(entry.top_logprobs) for entry in entries] == [2] * len(entries) and len(ids) == len(mu)
        # what vLLM told the client is what was recorded as mu, token for token
        assert [entry.logprob for entry in entries] == pytest.approx(mu[: len(entries)], abs=1e-6)
    # a client that asks for vLLM's token ids gets them, and they are the recorded ones
    raw = served.chat(
        "ids", model="rlproxy/tiny-qwen2", max_tokens=3, extra_body={"return_token_ids": True}
    ).http_response.json()
    (call,) = served.store.session_calls("ids")
    assert raw["prompt_token_ids"] == call["prompt_ids"] and raw["choices"][0]["token_ids"] == call["completion_ids"][0]


def test_streamed_logprobs_and_usage(served):
    chunks = list(
        served.client.chat.completions.create(
            model="rlproxy/tiny-qwen2",
            messages=MESSAGES,
            max_tokens=4,
            stream=True,
            logprobs=True,
            top_logprobs=1,
            stream_options={"include_usage": True},
            extra_headers={"X-Session-Id": "stream-lp"},
        )
    )
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert all(len(entry.top_logprobs) == 1 for entry in entries)
    assert all("token_ids" not in (choice.model_extra or {}) for c in chunks for choice in c.choices)
    (call,) = served.store.session_calls("stream-lp")
    assert chunks[-1].usage.completion_tokens == len(call["completion_ids"][0]) == len(entries)
    assert [entry.logprob for entry in entries] == pytest.approx(call["behaviour_logprobs"][0], abs=1e-6)


def test_greedy_calls_record_no_behaviour_logprobs(served):
    served.chat("greedy", model="rlproxy/tiny-qwen2", max_tokens=3, temperature=0)
    (call,) = served.store.session_calls("greedy")
    assert call["completion_ids"][0] and call["behaviour_logprobs"] in ([None], None)


def test_what_vllm_refuses_keeps_its_meaning(served, tmp_path):
    """vLLM's own refusals as the gateway passes them on: a prompt that overflows the context
    is the client's 400; an adapter vLLM cannot load says why and what to change; loading a
    loaded name or unloading an unloaded one is not an error (a re-load racing a restart)."""
    with pytest.raises(openai.BadRequestError) as refused:  # the gateway's own check, from vLLM's max_model_len
        served.chat("too-long", model="rlproxy/tiny-qwen2", max_tokens=4095)
    assert refused.value.code == "context_length_exceeded" and "context is 2048 tokens" in refused.value.message
    # vLLM's own: a prompt past the context (a completion past it is cut to what fits, no error)
    with pytest.raises(openai.BadRequestError) as refused:
        served.chat(
            "overflow",
            model="rlproxy/tiny-qwen2",
            max_tokens=4,
            messages=[{"role": "user", "content": "tic tac toe " * 1000}],
        )
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "messages"
    assert "maximum context length is 2048 tokens" in refused.value.message
    model_dir = resolve_base_model("rlproxy/tiny-qwen2", served.state_dir)
    wide, fitting = tmp_path / "wide", tmp_path / "fitting"  # rank 32 is over the --max-lora-rank 8 of --lora-rank 8
    train_adapter_to_write(model_dir, [1, 2], [3], wide, steps=0, rank=32)
    train_adapter_to_write(model_dir, [1, 2], [3], fitting, steps=0, rank=8)

    async def adapters():
        engine = VLLMEngine("rlproxy/tiny-qwen2", url=served.vllm_url)
        await engine.start()
        try:
            with pytest.raises(UpstreamError, match=r"\(404\).*No adapter found.*PEFT adapter directory"):
                await engine.load_adapter("agent@90", tmp_path / "nowhere")
            with pytest.raises(UpstreamError, match=r"\(500\).*LoRA rank 32 .*restart vLLM with a --max-lora-rank"):
                await engine.load_adapter("agent@91", wide)
            for _ in range(2):
                await engine.load_adapter("agent@92", fitting)
            for _ in range(2):
                await engine.unload_adapter("agent@92")
            # an adapter the engine loaded but vLLM lost, and that cannot be loaded again: vLLM's 404
            engine.adapters.paths["agent@93"] = tmp_path / "nowhere"
            with pytest.raises(UpstreamError, match="does not serve 'agent@93'.*does not exist"):
                await engine.complete(
                    EngineRequest(body={"model": "agent", "messages": MESSAGES}, adapter="agent@93", request_id="lost")
                )
        finally:
            await engine.close()

    asyncio.run(adapters())


def test_a_trained_step_is_hot_swapped_in_and_served_as_name_at_step(served):
    served.train_group("g1", [0.0, 0.3, 0.6, 1.0])
    step = wait_until(
        lambda: next((s for s in served.steps() if s["step"] == 1), None), timeout=300, interval=0.5, what="step 1"
    )
    # The trainer's pi_old (the base model: LoRA's B starts at zero) against vLLM's recorded mu.
    assert step["metrics"]["mismatch_logprob_abs"] < 1e-3, step["metrics"]
    wait_until(lambda: served.chat("after-1").headers.get("X-Model-Step") == "1", timeout=120, what="agent -> @1")
    result = served.chat("pinned", model="agent@1")
    assert result.headers["X-Model-Step"] == "1" and result.parse().model == "agent@1"
    (call,) = served.store.session_calls("pinned")
    assert call["served"] == "agent@1" and call["behaviour_logprobs"]


def test_hot_swap_under_concurrent_calls_fails_none(served):
    stop, outcomes = threading.Event(), []

    def keep_calling(i: int) -> None:
        n = 0
        while not stop.is_set():
            try:
                outcomes.append(served.chat(f"busy-{i}-{n}", max_tokens=2).headers.get("X-Model-Step"))
            except Exception as exc:  # noqa: BLE001 - every failure is the test's finding
                outcomes.append(exc)
            n += 1

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for i in range(8):
            pool.submit(keep_calling, i)
        served.train_group("g2", [1.0, 0.0, 0.5, 0.2])
        wait_until(lambda: any(s["step"] == 2 for s in served.steps()), timeout=300, interval=0.5, what="step 2")
        wait_until(lambda: "2" in outcomes[-16:], timeout=120, what="calls answered by step 2")
        stop.set()
    failures = [o for o in outcomes if isinstance(o, Exception)]
    assert not failures, failures[:3]
    assert {"1", "2"} <= set(outcomes)  # calls were answered on both sides of the swap


def test_responses_and_messages_routes_over_vllm(served):
    response = served.client.responses.create(
        model="agent", input="Say something.", max_output_tokens=8, extra_headers={"X-Session-Id": "responses"}
    )
    assert response.status in ("completed", "incomplete") and response.output
    messages = anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0).messages.create(
        model="agent",
        max_tokens=8,
        messages=[{"role": "user", "content": "Say something."}],
        extra_headers={"X-Session-Id": "messages"},
    )
    assert messages.type == "message" and messages.content
    for session in ("responses", "messages"):
        (call,) = served.store.session_calls(session)
        assert call["status"] == "ok" and call["completion_ids"][0] and call["behaviour_logprobs"][0]


def test_a_messages_prefill_is_continued_by_vllm(served):
    """The prefill flags the Messages translation sets (continue_final_message) are vLLM's own:
    the prompt vLLM rendered, as recorded, ends inside the assistant's message, not in a new turn."""
    from transformers import AutoTokenizer

    reply = anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0).messages.create(
        model="agent",
        max_tokens=6,
        messages=[{"role": "user", "content": "answer in JSON"}, {"role": "assistant", "content": '{"answer":'}],
        extra_headers={"X-Session-Id": "prefill"},
    )
    assert reply.type == "message"
    (call,) = served.store.session_calls("prefill")
    tokenizer = AutoTokenizer.from_pretrained(resolve_base_model("rlproxy/tiny-qwen2", served.state_dir))
    prompt = tokenizer.decode(call["prompt_ids"])
    assert prompt.endswith('answer in JSON<|im_end|>\n<|im_start|>assistant\n{"answer":'), prompt[-120:]


def test_anthropic_token_counts_over_vllm(served):
    """vLLM's /tokenize counts as the call itself does, and its usage in every chunk
    (continuous_usage_stats) gives message_start the prompt's tokens."""
    claude = anthropic.Anthropic(base_url=served.url, api_key="x", max_retries=0)
    asked = {"model": "agent", "system": "be brief", "messages": [{"role": "user", "content": "Say something."}]}
    whole = claude.messages.create(max_tokens=4, **asked)
    assert claude.messages.count_tokens(**asked).input_tokens == whole.usage.input_tokens > 0
    events = list(claude.messages.create(max_tokens=4, stream=True, **asked))
    assert events[0].type == "message_start" and events[0].message.usage.input_tokens == whole.usage.input_tokens
    final = [event for event in events if event.type == "message_delta"][-1]
    assert final.usage.input_tokens == whole.usage.input_tokens and final.usage.output_tokens >= 1


def test_attach_to_a_running_vllm(served, tmp_path):
    args = [
        "--engine",
        "vllm",
        "--vllm-url",
        served.vllm_url + "/v1",
        "--state-dir",
        str(tmp_path),
        "--model-name",
        "agent",
        "--trainer",
        "off",
    ]
    with gateway_process(args, startup_timeout=120) as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        completion = client.chat.completions.create(
            model="rlproxy/tiny-qwen2", messages=MESSAGES, max_tokens=4, extra_headers={"X-Session-Id": "attached"}
        )
        assert completion.choices[0].message.content is not None
        (call,) = SQLiteStore(tmp_path / "rlproxy.db").session_calls("attached")
        assert call["engine"] == "vllm" and call["completion_ids"][0] and call["behaviour_logprobs"][0]


def test_shadow_samples_through_the_real_vllm(served, tmp_path):
    """Issue 30: a live call's shadows come from vLLM (n=K, the seed removed, at a lower priority
    than live calls on this priority-scheduled vLLM), each recorded with its own token ids and
    vLLM's processed logprobs, judged with the live answer by RULER."""
    DONE = ("scored", "failed")
    with FakeJudge() as judge:
        args = ["--engine", "vllm", "--vllm-url", served.vllm_url + "/v1", "--state-dir", str(tmp_path)]
        args += ["--model-name", "agent", "--trainer", "off", "--shadow-samples", "3"]
        args += ["--shadow-judge-model", "openai/j", "--shadow-judge-api-base", judge.url]
        with gateway_process(args, startup_timeout=120) as (_, url):
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
            raw = client.chat.completions.with_raw_response.create(
                model="agent",
                messages=MESSAGES,
                max_tokens=6,
                temperature=1.0,
                seed=5,
                extra_headers={"X-Session-Id": "live-vllm"},
            )
            assert len(raw.parse().choices) == 1
            call_id = raw.headers["x-request-id"]
            group = wait_until(
                lambda: (lambda r: r.json() if r.status_code == 200 and r.json()["ruler_status"] in DONE else None)(
                    httpx.get(f"{url}/v1/groups/shadow-{call_id}", timeout=10)
                ),
                timeout=120,
                interval=0.2,
                what="the judged shadow group",
            )
    assert group["ruler_status"] == "scored" and group["origin"] == "shadow" and len(group["sessions"]) == 4
    store = SQLiteStore(tmp_path / "rlproxy.db")
    (live,) = store.session_calls("live-vllm")
    shadows = [store.session_calls(s["id"])[0] for s in group["sessions"][1:]]
    for shadow in shadows:
        assert shadow["engine"] == "vllm" and shadow["prompt_ids"] == live["prompt_ids"]
        assert len(shadow["behaviour_logprobs"][0]) == len(shadow["completion_ids"][0]) > 0
        assert shadow["sampling"]["seed"] is None and shadow["sampling"]["temperature"] == 1.0
    assert live["sampling"]["seed"] == 5


def test_vllm_killed_mid_call_gives_a_clear_error_then_serves_again(served):
    (pid,) = served.vllm_pids()
    errors = []

    def kill_soon():
        time.sleep(0.3)
        for child in psutil.Process(pid).children(recursive=True):
            child.kill()
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill_soon).start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # calls across the kill: a clear 502/503, never a hang or a 500
        try:
            served.chat("killed", max_tokens=64)
        except openai.APIStatusError as exc:
            errors.append(exc.status_code)
            break
        except openai.APIConnectionError as exc:  # a stream cut mid-answer
            errors.append(exc)
            break
    assert errors and errors[0] in (502, 503), errors
    health = httpx.get(served.url + "/healthz", timeout=10)
    assert health.status_code == 503 or health.json().get("status") == "ok"
    # The managed vLLM is restarted and the newest adapter loaded again, by itself.
    wait_until(lambda: _answers(served), timeout=600, interval=1.0, what="vLLM back")
    assert served.vllm_pids() != [pid]


def _answers(served) -> bool:
    try:
        return served.chat("back").headers.get("X-Model-Step") == "2"
    except openai.APIError:
        return False


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_calls_are_parsed_by_vllm_and_recorded(served, tmp_path):
    """An adapter that writes a <tool_call> (trained here), served by the real vLLM: its hermes
    parser turns the text into `tool_calls` with tool_choice "auto" (nothing forced)."""
    from transformers import AutoTokenizer

    model_dir = resolve_base_model("rlproxy/tiny-qwen2", served.state_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    prompt = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    state = tmp_path / "state"
    adapter = state / "models" / "caller" / "checkpoints" / "0001"  # where the gateway looks for steps
    train_adapter_to_write(model_dir, encode(prompt), encode(TOOL_CALL + "<|im_end|>"), adapter)
    store = SQLiteStore(state / "rlproxy.db")
    store.insert_step("caller", 1, str(adapter), {}, [])  # as if the trainer had made it
    args = [
        "--engine",
        "vllm",
        "--vllm-url",
        served.vllm_url,
        "--state-dir",
        str(state),
        "--model-name",
        "caller",
        "--trainer",
        "off",
    ]
    with gateway_process(args, startup_timeout=120) as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        completion = client.chat.completions.create(
            model="caller",
            messages=messages,
            tools=TOOLS,
            tool_choice="auto",
            temperature=0,
            max_tokens=40,
            extra_headers={"X-Session-Id": "tools"},
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        (row,) = store.session_calls("tools")
        assert row["served"] == "caller@1"
        assert row["response"]["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
        ids = row["completion_ids"][0]  # the stop token is recorded (the trainer trains it), the client never sees it
        assert tokenizer.decode(ids).startswith("<tool_call>") and ids[-1] == tokenizer.convert_tokens_to_ids(
            "<|im_end|>"
        )
