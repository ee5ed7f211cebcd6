"""Request validation says what is wrong; identity comes from headers or metadata."""

import pytest
from pydantic import ValidationError

from gateway.adapters import Target
from gateway.chat.identity import identify
from gateway.chat.service import engine_body
from gateway.chat.stream import StreamAccumulator
from gateway.errors import InvalidRequest
from gateway.protocols.chat import ChatCompletionRequest, RewardRequest

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


def request(**overrides):
    body = {"model": "agent", "messages": [{"role": "user", "content": "hi"}], **overrides}
    return ChatCompletionRequest.model_validate(body), body


def test_a_tool_choice_naming_an_offered_tool_is_taken():
    parsed, _ = request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "weather"}})
    assert parsed.tool_choice == {"type": "function", "function": {"name": "weather"}}


def test_unknown_openai_fields_pass_through():
    parsed, _ = request(reasoning_effort="low")
    assert parsed.model_extra == {"reasoning_effort": "low"}


@pytest.mark.parametrize(
    "overrides, says",
    [
        ({"messages": []}, "at least 1"),
        ({"temperature": 3}, "less than or equal to 2"),
        ({"n": 0}, "greater than or equal to 1"),
        ({"top_logprobs": 3}, "'top_logprobs' needs 'logprobs'"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        ({"tool_choice": "required"}, "'tool_choice' needs 'tools'"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "g"}}},
            "'tool_choice' names 'g', which is not in 'tools' \\(weather\\)",
        ),
        ({"tools": [WEATHER], "tool_choice": {"foo": 1}}, "'tool_choice' as an object is"),
    ],
)
def test_invalid_requests_say_what_to_fix(overrides, says):
    with pytest.raises(ValidationError, match=says):
        request(**overrides)


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), "high", "1.0", True, 1e200, -2e6])
def test_reward_must_be_a_finite_number(reward):
    with pytest.raises(ValidationError):
        RewardRequest.model_validate({"reward": reward})


@pytest.mark.parametrize("reward", [0, 1, -1.5, 1e6, -1e6])
def test_a_reward_is_any_number_within_bounds(reward):
    assert RewardRequest.model_validate({"reward": reward}).reward == reward


def test_identity_from_headers_then_metadata_then_minted():
    from_headers = identify({"x-session-id": "s1", "x-group-id": "g1", "x-split": "val"}, {})
    assert (from_headers.session_id, from_headers.group_id, from_headers.split) == ("s1", "g1", "val")
    from_body = identify({}, {"metadata": {"session_id": "s2", "group_id": "g2"}})
    assert (from_body.session_id, from_body.group_id, from_body.split) == ("s2", "g2", "train")
    minted = identify({}, {})
    assert minted.minted and minted.session_id.startswith("sess_") and minted.group_id is None


@pytest.mark.parametrize("headers", [{"x-session-id": "../../etc/passwd"}, {"x-group-id": "a b"}, {"x-split": "test"}])
def test_bad_identity_is_a_clear_400(headers):
    with pytest.raises(InvalidRequest):
        identify(headers, {})


def test_engine_body_drops_rlproxy_metadata_and_sets_target_model():
    parsed, body = request(metadata={"session_id": "s", "group_id": "g", "team": "x"})
    sent = engine_body(parsed, body, Target(model="agent@2", adapter="agent@2", step=2))
    assert sent["model"] == "agent@2" and sent["metadata"] == {"team": "x"}
    parsed, body = request(metadata={"session_id": "s"})
    assert "metadata" not in engine_body(parsed, body, Target(model="m", adapter=None, step=None))


def test_stream_accumulator_rebuilds_content_and_tool_calls():
    acc = StreamAccumulator()
    acc.add(
        {
            "id": "c1",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": "He"}}],
        }
    )
    acc.add({"id": "c1", "choices": [{"index": 0, "delta": {"content": "llo"}}]})
    acc.add(
        {
            "id": "c1",
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "get", "arguments": '{"a"'},
                            }
                        ]
                    },
                }
            ],
        }
    )
    acc.add(
        {
            "id": "c1",
            "choices": [
                {
                    "index": 0,
                    "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                    "finish_reason": "tool_calls",
                }
            ],
        }
    )
    message = acc.response()["choices"][0]["message"]
    assert message["content"] == "Hello"
    assert message["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"a": 1}'}}
    ]
    assert acc.response()["choices"][0]["finish_reason"] == "tool_calls"
