"""Anthropic's Messages API (`POST /v1/messages`) in terms of chat completions.

`to_chat`: `system` becomes a system message; content blocks `text`, `tool_use` (an
assistant tool call, `input` as JSON arguments) and `tool_result` (a `tool` message, put
before the user's own text as a chat template expects it); tools with `input_schema`
become function tools; `tool_choice` auto/any/tool/none map to auto/required/named/none.
`from_chat` gives a `message` with `text` and `tool_use` blocks and a `stop_reason`.
`MessagesStream` re-encodes chat chunks as `message_start`, `content_block_start`,
`content_block_delta` (`text_delta`, `input_json_delta`), `content_block_stop`,
`message_delta`, `message_stop`. Errors use Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import InvalidRequest
from gateway.protocols import text_of

PROTOCOL = "messages"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Tool(_Open):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class Message(_Open):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(_Open):
    """The request body, in the order of Anthropic's reference; unknown fields pass through."""

    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    metadata: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    system: str | list[dict[str, Any]] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    tool_choice: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    top_k: int | None = Field(default=None, ge=1)
    top_p: float | None = Field(default=None, gt=0, le=1)


# Anthropic's error types by HTTP status (its reference's table).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def message_id(request_id: str) -> str:
    return "msg_" + request_id.removeprefix("req_")


# ------------------------------------------------------------------ request -> chat


def _user_messages(blocks: list[dict], where: str) -> list[dict]:
    tool_messages, texts = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind == "tool_result":
            if not block.get("tool_use_id"):
                raise InvalidRequest(f"{where}.content[{j}]: a tool_result block needs 'tool_use_id'")
            content = text_of(block.get("content"))
            if block.get("is_error"):
                content = f"Error: {content}"
            tool_messages.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": content})
        else:
            raise InvalidRequest(
                f"{where}.content[{j}]: block type '{kind}' is not supported in a user message: "
                "use text or tool_result (rlproxy's models read text only)"
            )
    out = tool_messages
    if texts or not tool_messages:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _assistant_message(blocks: list[dict], where: str) -> dict:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind == "tool_use":
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name", ""), "arguments": json.dumps(block.get("input") or {})},
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise InvalidRequest(
                f"{where}.content[{j}]: block type '{kind}' is not supported in an assistant "
                "message: use text or tool_use"
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_choice(choice: dict | None) -> tuple[str | dict | None, bool | None]:
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise InvalidRequest("'tool_choice' must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}")


def to_chat(request: MessagesRequest) -> dict:
    messages: list[dict] = []
    if request.system:
        messages.append({"role": "system", "content": text_of(request.system)})
    for i, message in enumerate(request.messages):
        blocks = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
        if message.role == "user":
            messages += _user_messages(blocks, f"messages[{i}]")
        else:
            messages.append(_assistant_message(blocks, f"messages[{i}]"))
    body: dict[str, Any] = {"model": request.model, "messages": messages, "max_tokens": request.max_tokens}
    for name in ("temperature", "top_p", "top_k"):
        if (value := getattr(request, name)) is not None:
            body[name] = value
    if request.stop_sequences:
        body["stop"] = request.stop_sequences
    if request.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "parameters": t.input_schema,
                    **({"description": t.description} if t.description else {}),
                },
            }
            for t in request.tools
        ]
    choice, parallel = _tool_choice(request.tool_choice)
    if choice is not None:
        body["tool_choice"] = choice
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    return body


# ------------------------------------------------------------------ chat -> message


_STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}


def _arguments(text: str) -> dict:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {"_raw": text}  # a model's malformed JSON is kept, not lost
    return value if isinstance(value, dict) else {"_value": value}


def _usage(usage: dict | None) -> dict:
    usage = usage or {}
    return {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0)}


def from_chat(chat_response: dict, request: dict, msg_id: str) -> dict:
    choice = (chat_response.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[dict] = []
    if text := text_of(message.get("content")):
        content.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id"),
                "name": function.get("name", ""),
                "input": _arguments(function.get("arguments", "")),
            }
        )
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": request.get("model"),
        "content": content,
        "stop_reason": _STOP_REASONS.get(choice.get("finish_reason") or "stop", "end_turn"),
        "stop_sequence": None,
        "usage": _usage(chat_response.get("usage")),
    }


# ------------------------------------------------------------------ stream


class MessagesStream:
    """Chat chunks in, Anthropic stream events out (`(event type, payload)` pairs)."""

    def __init__(self, request: dict, msg_id: str):
        self.request = request
        self.msg_id = msg_id
        self.block = -1  # index of the open content block; -1 before the first
        self.open_kind: str | None = None  # "text" or the chat tool-call index as "tool:N"
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    @staticmethod
    def _event(kind: str, **fields: Any) -> tuple[str, bytes]:
        return kind, orjson.dumps({"type": kind, **fields})

    def start(self) -> list[tuple[str, bytes]]:
        message = {
            "id": self.msg_id,
            "type": "message",
            "role": "assistant",
            "model": self.request.get("model"),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }
        return [self._event("message_start", message=message)]

    def _open(self, kind: str, block: dict) -> list[tuple[str, bytes]]:
        events = self._close()
        self.block += 1
        self.open_kind = kind
        return events + [self._event("content_block_start", index=self.block, content_block=block)]

    def _close(self) -> list[tuple[str, bytes]]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [self._event("content_block_stop", index=self.block)]

    def chunk(self, chunk: dict) -> list[tuple[str, bytes]]:
        events: list[tuple[str, bytes]] = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.open_kind != "text":
                    events += self._open("text", {"type": "text", "text": ""})
                events.append(
                    self._event(
                        "content_block_delta", index=self.block, delta={"type": "text_delta", "text": delta["content"]}
                    )
                )
            for call in delta.get("tool_calls") or []:
                kind = f"tool:{call.get('index', 0)}"
                function = call.get("function") or {}
                if self.open_kind != kind:
                    events += self._open(
                        kind,
                        {"type": "tool_use", "id": call.get("id"), "name": function.get("name") or "", "input": {}},
                    )
                if function.get("arguments"):
                    events.append(
                        self._event(
                            "content_block_delta",
                            index=self.block,
                            delta={"type": "input_json_delta", "partial_json": function["arguments"]},
                        )
                    )
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[tuple[str, bytes]]:
        events = self._close()
        stop_reason = _STOP_REASONS.get(self.finish_reason or "stop", "end_turn")
        events.append(
            self._event(
                "message_delta", delta={"stop_reason": stop_reason, "stop_sequence": None}, usage=_usage(self.usage)
            )
        )
        events.append(self._event("message_stop"))
        return events

    def error(self, error: dict) -> list[tuple[str, bytes]]:
        body = error.get("error") or {}
        return [("error", orjson.dumps(error_body(500, body.get("message", "the stream failed"))))]


# ------------------------------------------------------------------ message -> chat (pass-through)


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
            self.response["content"][event["index"]]["input"] = _arguments(self._json.pop(event["index"]))
        elif kind == "message_delta":
            self.response.update(event.get("delta") or {})
            self.response["usage"] = {**(self.response.get("usage") or {}), **(event.get("usage") or {})}
