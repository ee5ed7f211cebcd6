"""`--upstream-protocol`: Responses, Messages and completions relayed as they are to an
upstream that speaks them (a loopback stand-in here), recorded with the chat form of the
answer for the trainer."""

from __future__ import annotations

import asyncio
import json
import time

import anthropic
import openai
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from gateway.routes import client_watch
from tests.helpers import ThreadServer
from tests.helpers_upstream import first_call, openai_gateway, send_and_leave

RESPONSE = {
    "id": "resp_upstream1",
    "object": "response",
    "created_at": 1,
    "status": "completed",
    "model": "m",
    "output": [
        {
            "type": "message",
            "id": "msg_u",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "native hi", "annotations": []}],
        },
        {
            "type": "function_call",
            "id": "fc_u",
            "call_id": "call_u",
            "name": "f",
            "arguments": '{"a": 1}',
            "status": "completed",
        },
    ],
    "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5},
}
MESSAGE_EVENTS = [
    {
        "type": "message_start",
        "message": {
            "id": "msg_up",
            "type": "message",
            "role": "assistant",
            "model": "m",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 4, "output_tokens": 0},
        },
    },
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "native "}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "anthropic"}},
    {"type": "content_block_stop", "index": 0},
    {
        "type": "content_block_start",
        "index": 1,
        "content_block": {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}},
    },
    {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": '{"b": '}},
    {"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "2}"}},
    {"type": "content_block_stop", "index": 1},
    {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use", "stop_sequence": None},
        "usage": {"output_tokens": 5},
    },
    {"type": "message_stop"},
]


def native_upstream() -> Starlette:
    seen: list[tuple[str, dict]] = []

    async def responses(request: Request):
        body = await request.json()
        seen.append(("responses", body))
        return JSONResponse({**RESPONSE, "model": body["model"]})

    async def messages(request: Request):
        body = await request.json()
        seen.append(("messages", body))

        garbled = body["messages"][-1]["content"] == "garbled"

        async def events():
            for event in MESSAGE_EVENTS:
                yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
                if garbled:  # an upstream that breaks: half an event, and no more
                    yield b'event: content_block_start\ndata: {"type": "content_block_st\n\n'
                    return

        return StreamingResponse(events(), media_type="text/event-stream")

    async def completions(request: Request):
        body = await request.json()
        seen.append(("completions", body))
        if str(body.get("prompt", "")).startswith("slow "):  # "slow 0.5 ...": answer after that many seconds,
            until = time.monotonic() + float(body["prompt"].split()[1])  # unless the gateway leaves first
            while time.monotonic() < until and not await request.is_disconnected():
                await asyncio.sleep(0.02)
        return JSONResponse(
            {
                "id": "cmpl-up",
                "object": "text_completion",
                "created": 1,
                "model": body["model"],
                "choices": [{"index": 0, "text": " raw continuation", "logprobs": None, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5},
            }
        )

    async def count_tokens(request: Request):
        body = await request.json()
        seen.append(("count_tokens", body))
        return JSONResponse({"input_tokens": 42})

    async def retrieve(request: Request):
        if request.method == "DELETE":
            seen.append(("delete", {"id": request.path_params["rid"]}))
            return JSONResponse({"id": request.path_params["rid"], "object": "response", "deleted": True})
        return JSONResponse({**RESPONSE, "id": request.path_params["rid"]})

    app = Starlette(
        routes=[
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/v1/responses/{rid}", retrieve, methods=["GET", "DELETE"]),
            Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )
    app.state.seen = seen
    return app


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    upstream = native_upstream()
    with (
        ThreadServer(upstream) as up,
        openai_gateway(
            up.url + "/v1", tmp_path_factory.mktemp("state"), upstream_protocol=["responses", "messages", "completions"]
        ) as (server, services),
    ):
        yield server, services, upstream.state.seen


def test_responses_relayed_and_recorded_in_chat_form(gateway):
    server, services, seen = gateway
    client = openai.OpenAI(base_url=server.url + "/sessions/pt-1/v1", api_key="x", max_retries=0)
    out = client.responses.create(model="fake-model", input="hi", metadata={"session_id": "ignored", "k": "v"})
    assert out.id == "resp_upstream1" and out.output_text == "native hi"
    protocol, body = seen[-1]
    assert protocol == "responses" and body["input"] == "hi" and body["metadata"] == {"k": "v"}
    [row] = services.store.session_calls("pt-1")
    assert row["protocol"] == "responses" and row["wire_response"]["id"] == "resp_upstream1"
    assert row["request"]["messages"] == [{"role": "user", "content": "hi"}]
    assert client.responses.retrieve("resp_upstream1").output_text == "native hi"  # asked of the upstream
    message = row["response"]["choices"][0]["message"]
    assert message["content"] == "native hi" and message["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'


def test_a_relayed_response_is_deleted_by_the_upstream(gateway):
    """Relayed, a response is the upstream's to keep or delete (OpenAI's client sends no body)."""
    server, _, seen = gateway
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    client.responses.delete("resp_upstream1")
    assert seen[-1] == ("delete", {"id": "resp_upstream1"})


def test_responses_continued_by_the_upstreams_id(gateway):
    """Relayed, response ids are the upstream's, so `previous_response_id` is the upstream's to
    serve (docs/serving.md): passed on as it is, not looked up in the store (a 404)."""
    server, services, seen = gateway
    client = openai.OpenAI(base_url=server.url + "/sessions/pt-chain/v1", api_key="x", max_retries=0)
    first = client.responses.create(model="fake-model", input="hi")
    second = client.responses.create(model="fake-model", input="more", previous_response_id=first.id)
    assert second.output_text == "native hi"
    assert seen[-1] == ("responses", {"model": "fake-model", "input": "more", "previous_response_id": first.id})
    rows = services.store.session_calls("pt-chain")
    assert [row["request"]["messages"] for row in rows] == [  # the chat form holds the new input only
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": "more"}],
    ]


def test_messages_stream_relayed_and_accumulated(gateway):
    server, services, _ = gateway
    client = anthropic.Anthropic(base_url=server.url + "/sessions/pt-2", api_key="x", max_retries=0)
    with client.messages.stream(model="fake-model", max_tokens=9, messages=[{"role": "user", "content": "q"}]) as s:
        final = s.get_final_message()
    assert final.content[0].text == "native anthropic" and final.content[1].input == {"b": 2}
    [row] = services.store.session_calls("pt-2")
    assert row["wire_response"]["content"][1]["input"] == {"b": 2}
    choice = row["response"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "native anthropic"
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"b": 2}


def test_count_tokens_asked_of_the_upstream(gateway):
    """The upstream speaks Messages, so it counts its own tokens; nothing is recorded."""
    server, services, seen = gateway
    client = anthropic.Anthropic(base_url=server.url + "/sessions/pt-count", api_key="x", max_retries=0)
    asked = {"model": "fake-model", "messages": [{"role": "user", "content": "q"}], "system": "s"}
    assert client.messages.count_tokens(**asked).input_tokens == 42
    assert seen[-1] == ("count_tokens", asked)
    assert services.store.session_calls("pt-count") == []


def test_messages_server_tools_relayed_as_they_are(gateway):
    """Anthropic's own tool types, which rlproxy's engines refuse, reach an upstream that speaks Messages."""
    server, services, seen = gateway
    client = anthropic.Anthropic(base_url=server.url + "/sessions/pt-tools", api_key="x", max_retries=0)
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}
    with client.messages.stream(
        model="fake-model", max_tokens=9, messages=[{"role": "user", "content": "news?"}], tools=[search]
    ) as s:
        assert s.get_final_message().content[0].text == "native anthropic"
    assert seen[-1] == ("messages", {**seen[-1][1], "tools": [search]})


def test_completions_relayed(gateway):
    server, services, seen = gateway
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    out = client.completions.create(model="fake-model", prompt="once", extra_headers={"X-Session-Id": "pt-3"})
    assert out.choices[0].text == " raw continuation" and seen[-1] == (
        "completions",
        {"model": "fake-model", "prompt": "once"},
    )
    [row] = services.store.session_calls("pt-3")
    assert row["response"]["choices"][0]["message"]["content"] == " raw continuation"


@pytest.mark.parametrize(
    "watch_after, prompt",
    [(3600.0, "slow 0.5 short"), (0.05, "slow 60 long")],
    ids=["checked-when-answered", "cancelled-by-the-watcher"],
)
def test_a_relayed_call_whose_client_left_is_recorded_as_499(gateway, monkeypatch, watch_after, prompt):
    """As for chat: a short call is checked when its answer is ready, a long one is cancelled
    (the upstream would answer only after 60 s)."""
    server, services, _ = gateway
    monkeypatch.setattr(client_watch, "WATCH_AFTER_SECONDS", watch_after)
    session = f"pt-left-{int(watch_after * 100)}"
    send_and_leave(server.url, "/v1/completions", session, {"model": "fake-model", "prompt": prompt})
    row = first_call(services.store, session, 20)
    assert row is not None and row["http_status"] == 499 and row["protocol"] == "completions"
    assert row["status"] == "error" and "disconnected" in row["error"]


def test_a_relayed_stream_event_that_is_not_json_is_a_502_error_event_and_recorded(gateway):
    server, services, _ = gateway
    client = anthropic.Anthropic(base_url=server.url + "/sessions/pt-garbled", api_key="x", max_retries=0)
    with pytest.raises(anthropic.APIError, match="not a JSON object"):
        with client.messages.stream(
            model="fake-model", max_tokens=9, messages=[{"role": "user", "content": "garbled"}]
        ) as s:
            s.get_final_message()
    [row] = services.store.session_calls("pt-garbled")
    assert row["status"] == "error" and row["http_status"] == 502  # not 499: the client did not leave
