import json

import pytest

from gateway.protocols.toolcalls import ToolCallStream, parse_tool_calls

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
SEARCH = '<tool_call>{"name": "search", "arguments": {"query": "pizza"}}</tool_call>'


def _shape(call: dict) -> tuple[str, dict]:
    assert call["type"] == "function"
    assert call["id"].startswith("call_") and len(call["id"]) > len("call_")
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def test_plain_text_is_content_unchanged():
    assert parse_tool_calls("  Hello, world.\n") == ("  Hello, world.\n", [])
    assert parse_tool_calls("") == ("", [])


def test_one_call_without_content():
    content, calls = parse_tool_calls(WEATHER)
    assert content is None
    assert [_shape(c) for c in calls] == [("get_weather", {"city": "Paris", "days": 2})]
    # arguments is a JSON string, written the way the chat template writes it back
    assert calls[0]["function"]["arguments"] == '{"city": "Paris", "days": 2}'


def test_several_calls_with_content_and_whitespace():
    text = f"Let me check.\n\n{WEATHER}\n{SEARCH}\n"
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [_shape(c) for c in calls] == [("get_weather", {"city": "Paris", "days": 2}), ("search", {"query": "pizza"})]
    assert len({c["id"] for c in calls}) == 2


def test_unclosed_last_block_is_a_call():
    content, calls = parse_tool_calls('Sure <tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n')
    assert content == "Sure"
    assert [_shape(c) for c in calls] == [("search", {"query": "x"})]


def test_string_arguments_and_parameters_key():
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert calls[0]["function"]["arguments"] == '{"a": 1}'
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>')
    assert _shape(calls[0]) == ("f", {"a": 1})
    _, calls = parse_tool_calls('<tool_call>{"name": "f"}</tool_call>')
    assert _shape(calls[0]) == ("f", {})


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>["name", "f"]</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        f'{WEATHER}<tool_call>{{"name": "f", "arguments": {{</tool_call>',  # one bad block spoils all
    ],
)
def test_malformed_blocks_leave_text_as_content(text):
    assert parse_tool_calls(text) == (text, [])


def _stream(text: str, step: int = 1) -> tuple[str, list[dict], list[str]]:
    helper = ToolCallStream()
    deltas = [helper.push(text[:end]) for end in range(step, len(text) + 1, step)]
    rest, calls = helper.finish(text)
    deltas.append(rest)
    return "".join(deltas), calls, deltas


@pytest.mark.parametrize(
    "text",
    [
        "Hello there, how are you?",
        "  leading and trailing  \n",
        f"Let me check.\n{WEATHER}",
        f"{WEATHER}\n{SEARCH}",
        "a < b and <tool is not a tag",
        "<tool_call>{broken</tool_call> tail",
        f"Before {WEATHER} after",
    ],
)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_stream_agrees_with_parser(text, step):
    content, calls = parse_tool_calls(text)
    streamed, stream_calls, _ = _stream(text, step)
    assert streamed == (content or "")
    assert [_shape(c) for c in stream_calls] == [_shape(c) for c in calls]


def test_stream_holds_back_only_what_may_become_a_call():
    _, _, deltas = _stream(f"Checking the weather now {WEATHER}")
    sent_before_end = "".join(deltas[:-1])
    assert sent_before_end == "Checking the weather now"
    assert "<" not in sent_before_end
    _, _, deltas = _stream("plain words arrive as they come")
    assert "".join(deltas[:-1]).startswith("plain words arrive as they")
