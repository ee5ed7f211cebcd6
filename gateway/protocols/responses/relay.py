"""A response an upstream gave in this protocol itself (`--upstream-protocol responses`),
read back: its chat form for the record, and the whole response from a relayed stream."""

from __future__ import annotations

from typing import Any

from gateway.protocols import text_of


def to_chat_response(response: dict) -> dict:
    """The chat.completion a response amounts to, for the record of a call an upstream
    answered in this protocol itself (`--upstream-protocol responses`)."""
    texts, calls = [], []
    for item in response.get("output") or []:
        if item.get("type") == "message":
            texts.append(text_of(item.get("content")))
        elif item.get("type") == "function_call":
            calls.append(
                {
                    "id": item.get("call_id"),
                    "type": "function",
                    "function": {"name": item.get("name", ""), "arguments": item.get("arguments") or ""},
                }
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    finish = "tool_calls" if calls else ("length" if response.get("status") == "incomplete" else "stop")
    usage = response.get("usage") or {}
    return {
        "id": response.get("id"),
        "object": "chat.completion",
        "created": response.get("created_at"),
        "model": response.get("model"),
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {
            "prompt_tokens": usage.get("input_tokens", 0),
            "completion_tokens": usage.get("output_tokens", 0),
            "total_tokens": usage.get("total_tokens", 0),
        }
        if usage
        else None,
    }


class Accumulator:
    """The response a relayed event stream amounts to: its final event carries it whole."""

    def __init__(self) -> None:
        self.response: dict | None = None

    def add(self, event: dict) -> None:
        if event.get("type") in ("response.completed", "response.incomplete", "response.failed"):
            self.response = event.get("response")
        elif event.get("type") == "response.created" and self.response is None:
            self.response = event.get("response")
