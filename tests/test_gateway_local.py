"""The gateway on the built-in tiny model, driven by the official `openai` client over a
real socket; every call's recorded row is checked against what the client received."""

from __future__ import annotations

import json

import openai
import pytest
from transformers import AutoTokenizer

from gateway.app import create_app
from gateway.models.registry import resolve_base_model
from gateway.models.tiny import TINY_MODEL_ID
from gateway.settings import Settings
from gateway.store.sqlite import SQLiteStore
from tests.helpers import ThreadServer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    settings = Settings(state_dir=state, engine="local", trainer="off", default_max_tokens=12)
    with ThreadServer(create_app(settings)) as server:
        yield server, settings


@pytest.fixture(scope="module")
def tokenizer(gateway):
    _, settings = gateway
    return AutoTokenizer.from_pretrained(resolve_base_model(TINY_MODEL_ID, settings.state_dir))


@pytest.fixture
def client(gateway):
    return openai.OpenAI(base_url=gateway[0].url + "/v1", api_key="unused", max_retries=0)


def recorded(gateway, session_id: str) -> list[dict]:
    store = SQLiteStore(gateway[1].db_path)
    try:
        return store.session_calls(session_id)
    finally:
        store._conn.close()
        store._read_conn.close()
        store._loop_conn.close()


def check_tokens_match(call: dict, texts: list[str], tokenizer) -> None:
    """Recorded completion ids decode to what the client got; one logprob per token."""
    assert call["prompt_ids"], "prompt token ids recorded"
    assert len(call["completion_ids"]) == len(texts)
    for ids, logprobs, text in zip(call["completion_ids"], call["behaviour_logprobs"], texts, strict=False):
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        assert decoded.strip() == text.strip()
        assert len(logprobs) == len(ids) and all(lp <= 0 for lp in logprobs)
    # the sampling in force, every parameter explicit (no engine default left implicit)
    assert set(call["sampling"]) == {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "seed",
        "max_tokens",
    }
    assert all(call["sampling"][k] is not None for k in call["sampling"] if k != "seed")


def test_sync_call_is_recorded_with_tokens_that_decode_to_the_answer(gateway, client, tokenizer):
    raw = client.chat.completions.with_raw_response.create(
        model="agent",
        messages=[{"role": "user", "content": "Say hello"}],
        seed=1,
        extra_headers={"X-Session-Id": "local-sync", "X-Group-Id": "local-g"},
    )
    answer = raw.parse()
    assert raw.headers["x-session-id"] == "local-sync" and raw.headers["x-request-id"]
    (call,) = recorded(gateway, "local-sync")
    assert call["id"] == raw.headers["x-request-id"]
    assert (call["session_id"], call["group_id"], call["split"]) == ("local-sync", "local-g", "train")
    check_tokens_match(call, [answer.choices[0].message.content or ""], tokenizer)
    prompt = tokenizer.decode(call["prompt_ids"])
    assert "Say hello" in prompt and prompt.rstrip().endswith("assistant")


def test_n_choices_are_each_recorded(gateway, client, tokenizer):
    answer = client.chat.completions.create(
        model="agent",
        messages=[{"role": "user", "content": "Count"}],
        n=3,
        seed=7,
        temperature=1.0,
        extra_headers={"X-Session-Id": "local-n"},
    )
    assert len(answer.choices) == 3
    (call,) = recorded(gateway, "local-n")
    check_tokens_match(call, [c.message.content or "" for c in answer.choices], tokenizer)


def test_stream_is_recorded_like_the_text_the_client_assembled(gateway, client, tokenizer):
    stream = client.chat.completions.create(
        model="agent",
        messages=[{"role": "user", "content": "Stream please"}],
        stream=True,
        seed=3,
        extra_headers={"X-Session-Id": "local-stream", "X-Group-Id": "local-g"},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    (call,) = recorded(gateway, "local-stream")
    assert call["stream"] is True and call["status"] == "ok"
    assert call["response"]["choices"][0]["message"]["content"] in (text, text or None)
    check_tokens_match(call, [text], tokenizer)


async def test_async_client_and_logprobs(gateway, tokenizer):
    client = openai.AsyncOpenAI(base_url=gateway[0].url + "/v1", api_key="unused", max_retries=0)
    answer = await client.chat.completions.create(
        model="agent",
        messages=[{"role": "user", "content": "async"}],
        logprobs=True,
        top_logprobs=2,
        seed=5,
        extra_headers={"X-Session-Id": "local-async"},
    )
    content = answer.choices[0].logprobs.content
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    (call,) = recorded(gateway, "local-async")
    # The client's logprobs are the ones recorded for training.
    assert [round(e.logprob, 4) for e in content] == [round(lp, 4) for lp in call["behaviour_logprobs"][0]]
    await client.close()


def test_tools_and_tool_messages_render_into_the_recorded_prompt(gateway, client, tokenizer):
    messages = [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    answer = client.chat.completions.create(
        model="agent", messages=messages, tools=TOOLS, seed=2, extra_headers={"X-Session-Id": "local-tools"}
    )
    (call,) = recorded(gateway, "local-tools")
    prompt = tokenizer.decode(call["prompt_ids"])
    assert "get_weather" in prompt and "sunny, 21C" in prompt and "<tool_call>" in prompt
    assert call["request"]["tools"][0]["function"]["name"] == "get_weather"
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert message.content is not None or message.tool_calls


def test_models_lists_the_base_model(client):
    ids = [model.id for model in client.models.list()]
    assert TINY_MODEL_ID in ids
