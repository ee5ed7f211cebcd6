"""A message an upstream gave in Anthropic's protocol itself (`--upstream-protocol messages`),
read back: its chat form for the record, and the whole message from a relayed stream."""

from __future__ import annotations

import json
from typing import Any

from gateway.protocols.messages.translate import arguments_of

_FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}


def to_chat_response(message: dict) -> dict:
    """The chat.completion a message amounts to, for the record of a call an upstream
    answered in Anthropic's protocol itself (`--upstream-protocol messages`)."""
    texts, calls = [], []
    for block in message.get("content") or []:
        if block.get("type") == "text":
            texts.append(block.get("text", ""))
        elif block.get("type") == "tool_use":
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name", ""), "arguments": json.dumps(block.get("input") or {})},
                }
            )
    reply: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        reply["tool_calls"] = calls
    usage = message.get("usage") or {}
    prompt, completion = usage.get("input_tokens", 0), usage.get("output_tokens", 0)
    return {
        "id": message.get("id"),
        "object": "chat.completion",
        "model": message.get("model"),
        "choices": [
            {
                "index": 0,
                "message": reply,
                "finish_reason": _FINISH_REASONS.get(message.get("stop_reason") or "end_turn", "stop"),
            }
        ],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }


class Accumulator:
    """The message a relayed event stream amounts to, rebuilt from its events."""

    def __init__(self) -> None:
        self.response: dict | None = None
        self._json: dict[int, str] = {}

    def add(self, event: dict) -> None:
        kind = event.get("type")
        if kind == "message_start":
            self.response = {**event.get("message", {}), "content": []}
            return
        if self.response is None:
            return
        if kind == "content_block_start":
            self.response["content"].append(dict(event.get("content_block") or {}))
        elif kind == "content_block_delta":
            block, delta = self.response["content"][event.get("index", -1)], event.get("delta") or {}
            if delta.get("type") == "text_delta":
                block["text"] = block.get("text", "") + delta.get("text", "")
            elif delta.get("type") == "input_json_delta":
                self._json[event.get("index", -1)] = self._json.get(event.get("index", -1), "") + delta.get(
                    "partial_json", ""
                )
        elif kind == "content_block_stop" and event.get("index") in self._json:
            self.response["content"][event["index"]]["input"] = arguments_of(self._json.pop(event["index"]))
        elif kind == "message_delta":
            self.response.update(event.get("delta") or {})
            self.response["usage"] = {**(self.response.get("usage") or {}), **(event.get("usage") or {})}
