"""Responses, Anthropic Messages and legacy completions through the `openai` engine, in
front of a chat-only loopback upstream, driven by the official clients over a real socket.
Each call row keeps the protocol, the client's request and response, and the chat form."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest

from tests.helpers_upstream import openai_gateway

KEY = "sk-gw-0a4e1c7d9b2f"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "weather for a city", "input_schema": WEATHER["parameters"]}


@pytest.fixture(scope="module")
def gateway(upstream, tmp_path_factory):
    with openai_gateway(upstream.url, tmp_path_factory.mktemp("state"), api_key=KEY) as (server, services):
        yield server, services


@pytest.fixture
def oai(gateway):
    return openai.OpenAI(base_url=gateway[0].url + "/v1", api_key=KEY, max_retries=0)


def calls(gateway, session_id):
    return gateway[1].store.session_calls(session_id)


def last_upstream_body(upstream):
    return [r for r in upstream.requests if r.path.endswith("/chat/completions")][-1].body


# ------------------------------------------------------------------ Responses


def test_responses_create_and_retrieve(gateway, oai, upstream):
    response = oai.responses.create(
        model="fake-model",
        input="hello there",
        instructions="be brief",
        max_output_tokens=20,
        temperature=0.5,
        extra_headers={"X-Session-Id": "resp-1"},
    )
    assert response.status == "completed"
    assert response.output_text == "hello there"
    assert response.id.startswith("resp_")
    sent = last_upstream_body(upstream)
    assert sent["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    assert sent["max_tokens"] == 20 and sent["temperature"] == 0.5
    [row] = calls(gateway, "resp-1")
    assert row["protocol"] == "responses"
    assert row["wire_request"]["input"] == "hello there"
    assert row["wire_response"]["output"][0]["content"][0]["text"] == "hello there"
    assert row["request"]["messages"][-1] == {"role": "user", "content": "hello there"}  # the chat form
    again = oai.responses.retrieve(response.id)
    assert again.id == response.id and again.output_text == "hello there"


def test_responses_function_tool_and_previous_response_id(gateway, oai, upstream):
    first = oai.responses.create(
        model="fake-model",
        input="[[tool_call]] weather in Paris?",
        tools=[WEATHER],
        instructions="use tools",
        extra_headers={"X-Session-Id": "resp-tool"},
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"x": 1}
    assert last_upstream_body(upstream)["tools"][0]["function"]["name"] == "get_weather"
    # No session header: continuing by id stays in the first response's session.
    second = oai.responses.create(
        model="fake-model",
        previous_response_id=first.id,
        tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    assert second.previous_response_id == first.id
    messages = last_upstream_body(upstream)["messages"]
    # instructions are not carried over from the previous response (OpenAI's documented behaviour)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["tool_calls"][0]["id"] == call.call_id
    assert messages[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}
    rows = calls(gateway, "resp-tool")
    assert [r["protocol"] for r in rows] == ["responses", "responses"]


def test_responses_stream_event_sequence(gateway, oai):
    with oai.responses.stream(
        model="fake-model",
        input="[[tool_call]] go",
        tools=[WEATHER],
        extra_headers={"X-Session-Id": "resp-stream-tool"},
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_item.added" in kinds and "response.function_call_arguments.delta" in kinds
    assert kinds.index("response.function_call_arguments.done") < kinds.index("response.output_item.done")
    assert kinds[-1] == "response.completed"
    assert final.output[0].type == "function_call" and final.output[0].arguments == '{"x": 1}'
    events = list(
        oai.responses.create(
            model="fake-model", input="one two three", stream=True, extra_headers={"X-Session-Id": "resp-stream"}
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "one two three"
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    [row] = calls(gateway, "resp-stream")
    assert row["stream"] and row["wire_response"]["output"][0]["content"][0]["text"] == "one two three"
    assert events[-1].response.usage.output_tokens == row["response"]["usage"]["completion_tokens"]


def test_responses_errors_are_openai_shaped(gateway, oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.responses.retrieve("resp_nope")
    assert "not found" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="fake-model", input="x", previous_response_id="resp_missing")
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model="fake-model", input="x", tools=[{"type": "web_search"}])
    assert "only 'function' tools" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model="fake-model", input=[{"type": "image_generation_call", "id": "x"}])
    assert info.value.body["type"] == "invalid_request_error"


# ------------------------------------------------------------------ completions


def test_completions_create(gateway, oai, upstream):
    out = oai.completions.create(
        model="fake-model", prompt="say this", max_tokens=5, extra_headers={"X-Session-Id": "cmpl-1"}
    )
    assert out.object == "text_completion" and out.choices[0].text == "say this"
    assert last_upstream_body(upstream)["messages"] == [{"role": "user", "content": "say this"}]
    assert last_upstream_body(upstream)["max_tokens"] == 5
    both = oai.completions.create(model="fake-model", prompt=["a b", "c"], extra_headers={"X-Session-Id": "cmpl-2"})
    assert [(c.index, c.text) for c in both.choices] == [(0, "a b"), (1, "c")]
    assert [r["protocol"] for r in calls(gateway, "cmpl-2")] == ["completions", "completions"]
    chunks = list(oai.completions.create(model="fake-model", prompt="x y z", stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "x y z"
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="fake-model", prompt="x", echo=True)
    assert "'echo' is not supported" in info.value.body["message"]


# ------------------------------------------------------------------ Anthropic Messages


def test_anthropic_messages_tool_round_trip(gateway, upstream):
    client = anthropic.Anthropic(
        base_url=gateway[0].url, api_key=KEY, max_retries=0, default_headers={"X-Session-Id": "anth-1"}
    )
    first = client.messages.create(
        model="fake-model",
        max_tokens=50,
        system="you help",
        tools=[ANTHROPIC_WEATHER],
        messages=[{"role": "user", "content": "[[tool_call]] Paris"}],
    )
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"x": 1}
    sent = last_upstream_body(upstream)
    assert sent["messages"][0] == {"role": "system", "content": "you help"}
    assert sent["tools"][0]["function"]["parameters"] == ANTHROPIC_WEATHER["input_schema"]
    history = [
        {"role": "user", "content": "[[tool_call]] Paris"},
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
    ]
    with client.messages.stream(
        model="fake-model", max_tokens=50, tools=[ANTHROPIC_WEATHER], messages=history
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    sent = last_upstream_body(upstream)["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "tool"]
    assert sent[2] == {"role": "tool", "tool_call_id": use.id, "content": "sunny"}
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.stop_reason == "end_turn" and final.content[0].text == "[[tool_call]] Paris"
    rows = calls(gateway, "anth-1")
    assert [r["protocol"] for r in rows] == ["messages", "messages"]
    assert rows[1]["wire_response"]["content"][0]["text"] == "[[tool_call]] Paris"


def test_anthropic_stream_tool_input_json_delta(gateway):
    client = anthropic.Anthropic(base_url=gateway[0].url, api_key=KEY, max_retries=0)
    with client.messages.stream(
        model="fake-model",
        max_tokens=50,
        tools=[ANTHROPIC_WEATHER],
        messages=[{"role": "user", "content": "[[tool_call]] go"}],
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert deltas and all(e.delta.type == "input_json_delta" for e in deltas)
    assert final.content[0].type == "tool_use" and final.content[0].input == {"x": 1}
    assert final.stop_reason == "tool_use"


def test_anthropic_errors_and_x_api_key(gateway):
    bad = anthropic.Anthropic(base_url=gateway[0].url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        bad.messages.create(model="fake-model", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "authentication_error"
    good = anthropic.Anthropic(base_url=gateway[0].url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as info:
        good.messages.create(model="fake-model", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert (
        info.value.body["error"]["type"] == "invalid_request_error"
        and "max_tokens" in info.value.body["error"]["message"]
    )
    # x-api-key works on OpenAI routes too; a wrong one there gets OpenAI's shape
    r = httpx.get(gateway[0].url + "/v1/models", headers={"x-api-key": KEY})
    assert r.status_code == 200
    r = httpx.get(gateway[0].url + "/v1/models", headers={"x-api-key": "nope"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


# ------------------------------------------------------------------ sessions in the URL


def test_sessions_in_base_url(gateway):
    url = gateway[0].url
    oai = openai.OpenAI(base_url=f"{url}/groups/g-url/sessions/s-url/v1", api_key=KEY, max_retries=0)
    oai.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}])
    oai.responses.create(model="fake-model", input="hi")
    client = anthropic.Anthropic(base_url=f"{url}/groups/g-url/sessions/s-url", api_key=KEY, max_retries=0)
    client.messages.create(model="fake-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    rows = calls(gateway, "s-url")
    assert [r["protocol"] for r in rows] == ["chat", "responses", "messages"]
    assert {r["group_id"] for r in rows} == {"g-url"}
    # headers win over the URL
    oai.completions.create(model="fake-model", prompt="p", extra_headers={"X-Session-Id": "s-header"})
    assert len(calls(gateway, "s-header")) == 1 and len(calls(gateway, "s-url")) == 3
    r = httpx.post(
        f"{url}/sessions/bad%20id/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": "fake-model", "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 400 and "session_id" in r.json()["error"]["message"]


def test_openapi_lists_new_routes_with_schemas(gateway):
    spec = httpx.get(gateway[0].url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    for path, schema in (
        ("/v1/responses", "ResponsesRequest"),
        ("/v1/messages", "MessagesRequest"),
        ("/v1/completions", "CompletionRequest"),
    ):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith(schema) and schema in spec["components"]["schemas"]
    assert "get" in spec["paths"]["/v1/responses/{response_id}"]


# ------------------------------------------------------------------ the Agents SDK


def test_openai_agents_sdk_default_responses_model(gateway, upstream):
    agents = pytest.importorskip("agents")
    client = openai.AsyncOpenAI(base_url=gateway[0].url + "/sessions/agent-sdk/v1", api_key=KEY, max_retries=0)
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather for a city."""
        seen.append(city)
        return "sunny"

    agents.set_tracing_disabled(True)
    agent = agents.Agent(
        name="weather",
        instructions="use the tool",
        model=agents.OpenAIResponsesModel(model="fake-model", openai_client=client),
        tools=[get_weather],
    )
    result = asyncio.run(agents.Runner.run(agent, "[[tool_call]] weather?"))
    assert result.final_output == "[[tool_call]] weather?"
    rows = calls(gateway, "agent-sdk")
    assert [r["protocol"] for r in rows] == ["responses", "responses"]
    assert rows[1]["request"]["messages"][-1]["role"] == "tool"


def test_client_that_leaves_a_non_stream_call_is_recorded_as_499(gateway):
    import time

    impatient = openai.OpenAI(base_url=gateway[0].url + "/v1", api_key=KEY, max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.responses.create(model="fake-model", input="[[delay=3]] slow", extra_headers={"X-Session-Id": "left"})
    deadline = time.monotonic() + 30
    while not calls(gateway, "left") and time.monotonic() < deadline:
        time.sleep(0.05)
    [row] = calls(gateway, "left")
    assert row["http_status"] == 499 and row["status"] == "error" and row["protocol"] == "responses"


def test_mid_stream_failures_in_each_protocols_shape(gateway, oai):
    events = list(oai.responses.create(model="fake-model", input="[[stream_error]] a b", stream=True))
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    assert "mid-stream" in events[-2].message and events[-1].response.status == "failed"
    claude = anthropic.Anthropic(base_url=gateway[0].url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as info:
        with claude.messages.stream(
            model="fake-model", max_tokens=5, messages=[{"role": "user", "content": "[[stream_error]] a"}]
        ) as stream:
            list(stream)
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "api_error"
    with pytest.raises(anthropic.RateLimitError) as info:  # an upstream 429 keeps its status, in Anthropic's shape
        claude.messages.create(
            model="fake-model", max_tokens=5, messages=[{"role": "user", "content": "[[status=429]]"}]
        )
    assert info.value.body["error"]["type"] == "rate_limit_error"
