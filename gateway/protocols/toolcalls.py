"""Hermes-style tool calls in model text → OpenAI `tool_calls`.

Qwen2.5 (and the tiny model's template) asks the model to answer a tool call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`parse_tool_calls` turns a finished completion into `(content, tool_calls)`;
`ToolCallStream` does the same for a completion that arrives piece by piece: it passes
content through as it comes, holds text back from the first `<tool_call>` on, and hands
over the tool calls once the completion is finished. Both agree: the content deltas of a
stream concatenate to the content `parse_tool_calls` returns for the same text.
"""

from __future__ import annotations

import json
import re
import uuid

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# A closed block, or an unclosed last one (the model hit eos or the token limit before
# writing the end tag), as vLLM's hermes parser does.
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Split completion text into content and OpenAI tool calls.

    Without a `<tool_call>` block the text comes back unchanged with no calls. With
    blocks, the content is the text outside them, stripped (None if nothing is left),
    and every block becomes `{"id", "type": "function", "function": {"name",
    "arguments": <JSON string>}}`. If any block is not a JSON object with a string
    "name", nothing is parsed: the whole text is the content, with no calls.
    """
    if TOOL_CALL_START not in text:
        return text, []
    calls: list[dict] = []
    outside: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        outside.append(text[position : match.start()])
        position = match.end()
        call = _call_from_json(match.group(1) if match.group(1) is not None else match.group(2))
        if call is None:
            return text, []
        calls.append(call)
    outside.append(text[position:])
    content = "".join(outside).strip()
    return (content or None), calls


def _call_from_json(raw: str) -> dict | None:
    try:
        obj = json.loads(raw.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(arguments, str):
        # Same separators as the chat template's `tojson`, so re-rendering the call
        # reproduces the text the model wrote (prefix-stable sessions).
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": arguments}}


class ToolCallStream:
    """Content deltas for a completion that grows, tool calls once it is finished.

    `push(text)` takes the whole text so far and returns the content not yet sent.
    It holds back whitespace at either end (a tool call may follow, and then the
    content is stripped), a trailing partial `<tool_call>`, and everything from the
    first `<tool_call>` on. `finish(text)` takes the final text and returns the rest of
    the content plus the parsed calls.
    """

    def __init__(self) -> None:
        self.sent = ""

    def push(self, text: str) -> str:
        return self._advance(_streamable(text))

    def finish(self, text: str) -> tuple[str, list[dict]]:
        content, calls = parse_tool_calls(text)
        return self._advance(content or ""), calls

    def _advance(self, content: str) -> str:
        if not content.startswith(self.sent):
            return ""  # cannot happen for growing text; never take back what was sent
        delta = content[len(self.sent) :]
        self.sent = content
        return delta


def _streamable(text: str) -> str:
    """The part of `text` that is content whatever follows."""
    start = text.find(TOOL_CALL_START)
    if start >= 0:
        text = text[:start]
    else:
        for size in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
            if TOOL_CALL_START.startswith(text[-size:]):
                text = text[:-size]
                break
    if not text[:1].strip():
        return ""  # leading whitespace: sent only if it turns out to be plain content
    return text.rstrip()
