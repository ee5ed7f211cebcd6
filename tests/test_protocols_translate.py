"""The protocols' pure translations, on hand-written examples (no server)."""

import pytest

from gateway.errors import InvalidRequest
from gateway.http import session_url
from gateway.protocols.completions import translate as completions_translate
from gateway.protocols.completions import wire as completions_wire
from gateway.protocols.messages import relay as messages_relay
from gateway.protocols.messages import translate as messages_translate
from gateway.protocols.messages import wire as messages_wire
from gateway.protocols.responses import translate as responses_translate
from gateway.protocols.responses import wire as responses_wire


def test_responses_items_become_chat_messages():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "hi "}, {"type": "input_text", "text": "you"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "let me look"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}'},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
    ]
    assert responses_translate.input_messages(items) == [
        {"role": "user", "content": "hi you"},
        {
            "role": "assistant",
            "content": "let me look",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"a": 1}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]


def test_responses_request_and_answer():
    request = responses_wire.ResponsesRequest(
        model="m",
        input="q",
        instructions="sys",
        max_output_tokens=7,
        tool_choice={"type": "function", "name": "f"},
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
    )
    body = responses_translate.to_chat(request, history=[{"role": "user", "content": "before"}])
    assert body["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "before"},
        {"role": "user", "content": "q"},
    ]
    assert body["max_tokens"] == 7 and body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    chat = {
        "created": 5,
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
        "choices": [
            {
                "message": {
                    "content": "ok",
                    "tool_calls": [{"id": "call_1", "function": {"name": "f", "arguments": "{}"}}],
                },
                "finish_reason": "length",
            }
        ],
    }
    out = responses_translate.from_chat(chat, {"model": "m"}, "resp_abc")
    assert [i["type"] for i in out["output"]] == ["message", "function_call"]
    assert out["output"][0]["id"] == "msg_abc" and out["output"][1]["call_id"] == "call_1"
    assert out["status"] == "incomplete" and out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["usage"]["total_tokens"] == 5
    assert responses_wire.call_id_of(responses_wire.response_id("req_0123")) == "req_0123"


def test_responses_history_drops_the_previous_instructions():
    chat_request = {"messages": [{"role": "system", "content": "old rules"}, {"role": "user", "content": "q"}]}
    chat_response = {"choices": [{"message": {"role": "assistant", "content": "a", "refusal": None}}]}
    assert responses_translate.history_of(chat_request, {"instructions": "old rules"}, chat_response) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
    ]


def test_anthropic_blocks_become_chat_messages():
    request = messages_wire.MessagesRequest(
        model="m",
        max_tokens=9,
        system=[{"type": "text", "text": "be "}, {"type": "text", "text": "nice"}],
        stop_sequences=["END"],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        tools=[{"name": "f", "input_schema": {"type": "object"}}],
        messages=[
            {"role": "user", "content": "q"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "and?"},
                    {"type": "tool_result", "tool_use_id": "t1", "content": "r", "is_error": True},
                ],
            },
        ],
    )
    body = messages_translate.to_chat(request)
    assert body["messages"] == [
        {"role": "system", "content": "be nice"},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "calling",
            "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "Error: r"},  # results first, as templates expect
        {"role": "user", "content": "and?"},
    ]
    assert body["stop"] == ["END"] and body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(InvalidRequest, match="image"):
        messages_translate.to_chat(
            messages_wire.MessagesRequest(
                model="m", max_tokens=1, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]
            )
        )


def test_anthropic_answer_and_error_shape():
    chat = {
        "usage": {"prompt_tokens": 4, "completion_tokens": 1},
        "choices": [
            {
                "finish_reason": "tool_calls",
                "message": {
                    "content": None,
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": '{"y": 2}'}}],
                },
            }
        ],
    }
    out = messages_translate.from_chat(chat, {"model": "m"}, "msg_1")
    assert out["content"] == [{"type": "tool_use", "id": "c", "name": "f", "input": {"y": 2}}]
    assert out["stop_reason"] == "tool_use" and out["usage"] == {"input_tokens": 4, "output_tokens": 1}
    assert messages_wire.error_body(529, "busy") == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "busy"},
    }
    assert (
        messages_relay.to_chat_response(out)["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
        == '{"y": 2}'
    )


def test_completions_logprobs_in_the_legacy_layout():
    chat = {
        "created": 1,
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "message": {"content": "ab"},
                "logprobs": {
                    "content": [
                        {"token": "a", "logprob": -0.5, "top_logprobs": [{"token": "a", "logprob": -0.5}]},
                        {"token": "b", "logprob": -1.0, "top_logprobs": []},
                    ]
                },
            }
        ],
    }
    out = completions_translate.from_chat(chat, {"model": "m"}, "cmpl-1", first_index=2)
    assert out["choices"] == [
        {
            "text": "ab",
            "index": 2,
            "finish_reason": "length",
            "logprobs": {
                "tokens": ["a", "b"],
                "token_logprobs": [-0.5, -1.0],
                "top_logprobs": [{"a": -0.5}, {}],
                "text_offset": [0, 1],
            },
        }
    ]
    with pytest.raises(ValueError, match="echo"):
        completions_wire.CompletionRequest(model="m", prompt="x", echo=True)


def test_session_url_rewrite():
    scope = {"type": "http", "path": "/groups/g1/sessions/s%3A1/messages", "headers": [(b"host", b"h")]}
    out = session_url.rewrite(scope)
    assert out["path"] == "/v1/messages"
    assert (b"x-session-id", b"s:1") in out["headers"] and (b"x-group-id", b"g1") in out["headers"]
    header_wins = session_url.rewrite(
        {"type": "http", "path": "/sessions/url/v1/models", "headers": [(b"x-session-id", b"hdr")]}
    )
    assert header_wins["path"] == "/v1/models" and header_wins["headers"] == [(b"x-session-id", b"hdr")]
    plain = {"type": "http", "path": "/v1/sessions/s/reward", "headers": []}
    assert session_url.rewrite(plain) is plain
