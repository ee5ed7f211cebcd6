"""OpenAI's Responses API (`POST /v1/responses`) in terms of chat completions.

`to_chat` turns a request (and, for `previous_response_id`, the conversation so far in
chat form) into a chat request body; `from_chat` turns the chat.completion back into a
`response` object; `ResponsesStream` re-encodes chat chunks as the documented event
sequence: `response.created`, `response.in_progress`, per output item
`response.output_item.added` ... `response.output_text.delta` /
`response.function_call_arguments.delta` ... `response.output_item.done`, then
`response.completed`. Item ids are derived from the response id, so the streamed items
and the stored response agree.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import InvalidRequest
from gateway.protocols import text_of

PROTOCOL = "responses"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionTool(_Open):
    type: str = "function"
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(_Open):
    """The request body, in the order of OpenAI's reference; unknown fields pass through."""

    model: str
    input: str | list[dict[str, Any]] = Field(description="a string (one user message) or a list of input items")
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=2)
    text: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[FunctionTool] | None = None
    top_p: float | None = Field(default=None, gt=0, le=1)
    user: str | None = None


# ------------------------------------------------------------------ ids


def response_id(request_id: str) -> str:
    """The response's id is the call row's key with another prefix, so the store finds it."""
    return "resp_" + request_id.removeprefix("req_")


def call_id_of(response_id_: str) -> str | None:
    """The call row key a response id names, or None if it is not one of ours."""
    if not response_id_.startswith("resp_") or len(response_id_) > 140:
        return None
    return "req_" + response_id_.removeprefix("resp_")


# ------------------------------------------------------------------ request -> chat


def _tools(tools: list[FunctionTool] | None) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise InvalidRequest(
                f"tools[{i}]: tool type '{tool.type}' is not supported by rlproxy: only 'function' tools "
                "(run built-in tools such as web search in the agent and pass them as functions)",
                param=f"tools[{i}].type",
            )
        if not tool.name:
            raise InvalidRequest(f"tools[{i}]: a function tool needs 'name'", param=f"tools[{i}].name")
        function = {"name": tool.name, "parameters": tool.parameters or {"type": "object", "properties": {}}}
        if tool.description is not None:
            function["description"] = tool.description
        if tool.strict is not None:
            function["strict"] = tool.strict
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest(
        "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}", param="tool_choice"
    )


def input_messages(items: str | list[dict]) -> list[dict]:
    """Input items as chat messages. Consecutive `function_call` items (and an assistant
    message just before them) become one assistant message with `tool_calls`, as a chat
    model would have produced them; `function_call_output` becomes a `tool` message;
    `reasoning` items carry nothing a chat model reads and are dropped."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidRequest(f"input[{i}] must be an object (an input item)", param=f"input[{i}]")
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(
                    f"input[{i}]: role '{role}' is not one of user, assistant, system, developer",
                    param=f"input[{i}].role",
                )
            for part in item.get("content") if isinstance(item.get("content"), list) else []:
                if isinstance(part, dict) and part.get("type") not in ("input_text", "output_text", "text", "refusal"):
                    raise InvalidRequest(
                        f"input[{i}]: content part '{part.get('type')}' is not supported: "
                        "rlproxy's models read text only",
                        param=f"input[{i}].content",
                    )
            messages.append({"role": role, "content": text_of(item.get("content"))})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id") or item.get("id"),
                "type": "function",
                "function": {"name": item.get("name", ""), "arguments": item.get("arguments") or "{}"},
            }
            if not call["id"]:
                raise InvalidRequest(f"input[{i}]: a function_call item needs 'call_id'", param=f"input[{i}].call_id")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                if last.get("content") == "":
                    last["content"] = None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not item.get("call_id"):
                raise InvalidRequest(
                    f"input[{i}]: a function_call_output item needs 'call_id'", param=f"input[{i}].call_id"
                )
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text_of(item.get("output"))})
        elif kind == "reasoning":
            continue
        else:
            raise InvalidRequest(
                f"input[{i}]: item type '{kind}' is not supported: use message, function_call or function_call_output",
                param=f"input[{i}].type",
            )
    return messages


def to_chat(request: ResponsesRequest, history: list[dict] | None = None) -> dict:
    """The chat request body for `request`; `history` is the conversation up to and
    including the previous response's answer (instructions are not carried over, as OpenAI
    documents for `previous_response_id`)."""
    messages = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    messages += history or []
    messages += input_messages(request.input)
    if not messages:
        raise InvalidRequest("'input' is empty: give a string or at least one input item", param="input")
    body: dict[str, Any] = {"model": request.model, "messages": messages}
    if request.max_output_tokens is not None:
        body["max_tokens"] = request.max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls", "metadata"):
        value = getattr(request, name)
        if value is not None:
            body[name] = value
    if (tools := _tools(request.tools)) is not None:
        body["tools"] = tools
    if (choice := _tool_choice(request.tool_choice)) is not None:
        body["tool_choice"] = choice
    text_format = (request.text or {}).get("format") or {}
    if text_format.get("type") == "json_schema":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {k: text_format[k] for k in ("name", "schema", "strict", "description") if k in text_format},
        }
    elif text_format.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    return body


def history_of(chat_request: dict, wire_request: dict | None, chat_response: dict) -> list[dict]:
    """The conversation a stored response ends: its chat messages without the system
    message its own `instructions` made, plus its answer."""
    messages = list(chat_request.get("messages") or [])
    if wire_request and wire_request.get("instructions") and messages and messages[0].get("role") == "system":
        messages = messages[1:]
    choices = chat_response.get("choices") or []
    if choices and choices[0].get("message"):
        answer = {k: v for k, v in choices[0]["message"].items() if k in ("role", "content", "tool_calls")}
        messages.append({**answer, "role": "assistant"})
    return messages


# ------------------------------------------------------------------ chat -> response


def _usage(usage: dict | None) -> dict | None:
    if not usage:
        return None
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _envelope(request: dict, resp_id: str, created: float, status: str) -> dict:
    """Everything of a response object but its output and usage."""
    return {
        "id": resp_id,
        "object": "response",
        "created_at": int(created),
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "model": request.get("model"),
        "output": [],
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "previous_response_id": request.get("previous_response_id"),
        "reasoning": None,
        "store": request.get("store", True),
        "temperature": request.get("temperature"),
        "text": request.get("text") or {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice") or "auto",
        "tools": request.get("tools") or [],
        "top_p": request.get("top_p"),
        "truncation": "disabled",
        "usage": None,
        "user": request.get("user"),
        "metadata": request.get("metadata") or {},
    }


def message_item(resp_id: str, text: str, status: str = "completed") -> dict:
    return {
        "type": "message",
        "id": "msg_" + resp_id.removeprefix("resp_"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else [],
    }


def function_call_item(resp_id: str, index: int, call: dict, status: str = "completed") -> dict:
    function = call.get("function") or {}
    return {
        "type": "function_call",
        "id": f"fc_{resp_id.removeprefix('resp_')}_{index}",
        "call_id": call.get("id"),
        "name": function.get("name", ""),
        "arguments": function.get("arguments", "") if status == "completed" else "",
        "status": status,
    }


def from_chat(chat_response: dict, request: dict, resp_id: str) -> dict:
    """The response object for a chat.completion (choice 0, the one an agent continues with)."""
    choice = (chat_response.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    response = _envelope(request, resp_id, chat_response.get("created") or time.time(), "completed")
    text = text_of(message.get("content"))
    if text:
        response["output"].append(message_item(resp_id, text))
    for index, call in enumerate(message.get("tool_calls") or []):
        response["output"].append(function_call_item(resp_id, index, call))
    if choice.get("finish_reason") == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    response["usage"] = _usage(chat_response.get("usage"))
    return response


def error_body(message: str, error_type: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


# ------------------------------------------------------------------ stream


class ResponsesStream:
    """Chat chunks in, Responses events out (`(event type, payload)` pairs)."""

    def __init__(self, request: dict, resp_id: str):
        self.request = request
        self.resp_id = resp_id
        self.created = time.time()
        self.sequence = 0
        self.text: str | None = None  # the message item's text so far; None until it opens
        self.calls: dict[int, dict] = {}  # chat tool-call index -> {"id", "function": {"name", "arguments"}}
        self.open_item: tuple[str, int] | None = None  # ("message", output_index) or ("call", chat index)
        self.output: list[dict] = []  # finished items
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    def _event(self, kind: str, **fields: Any) -> tuple[str, bytes]:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return kind, orjson.dumps(payload)

    def start(self) -> list[tuple[str, bytes]]:
        snapshot = _envelope(self.request, self.resp_id, self.created, "in_progress")
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def _close_open(self) -> list[tuple[str, bytes]]:
        events = []
        if self.open_item is None:
            return events
        kind, key = self.open_item
        index = len(self.output)
        if kind == "message":
            item = message_item(self.resp_id, self.text or "")
            part = item["content"][0]
            events += [
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                ),
                self._event(
                    "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
                ),
            ]
        else:
            item = function_call_item(self.resp_id, key, self.calls[key])
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            )
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        self.open_item = None
        return events

    def chunk(self, chunk: dict) -> list[tuple[str, bytes]]:
        events: list[tuple[str, bytes]] = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.open_item is None or self.open_item[0] != "message":
                    events += self._close_open()
                    self.text = ""
                    self.open_item = ("message", len(self.output))
                    item = message_item(self.resp_id, "", status="in_progress")
                    events += [
                        self._event("response.output_item.added", output_index=len(self.output), item=item),
                        self._event(
                            "response.content_part.added",
                            item_id=item["id"],
                            output_index=len(self.output),
                            content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []},
                        ),
                    ]
                self.text += delta["content"]
                events.append(
                    self._event(
                        "response.output_text.delta",
                        item_id="msg_" + self.resp_id[5:],
                        output_index=len(self.output),
                        content_index=0,
                        delta=delta["content"],
                        logprobs=[],
                    )
                )
            for call_delta in delta.get("tool_calls") or []:
                key = call_delta.get("index", len(self.calls))
                function = call_delta.get("function") or {}
                if key not in self.calls:
                    events += self._close_open()
                    self.calls[key] = {
                        "id": call_delta.get("id"),
                        "function": {"name": function.get("name") or "", "arguments": ""},
                    }
                    self.open_item = ("call", key)
                    item = function_call_item(self.resp_id, key, self.calls[key], status="in_progress")
                    events.append(self._event("response.output_item.added", output_index=len(self.output), item=item))
                elif function.get("name"):
                    self.calls[key]["function"]["name"] += function["name"]
                if function.get("arguments"):
                    self.calls[key]["function"]["arguments"] += function["arguments"]
                    events.append(
                        self._event(
                            "response.function_call_arguments.delta",
                            item_id=f"fc_{self.resp_id[5:]}_{key}",
                            output_index=len(self.output),
                            delta=function["arguments"],
                        )
                    )
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[tuple[str, bytes]]:
        events = self._close_open()
        response = _envelope(self.request, self.resp_id, self.created, "completed")
        response["output"] = self.output
        response["usage"] = _usage(self.usage)
        kind = "response.completed"
        if self.finish_reason == "length":
            response["status"], response["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
            kind = "response.incomplete"
        events.append(self._event(kind, response=response))
        return events

    def error(self, error: dict) -> list[tuple[str, bytes]]:
        """The documented failure: an `error` event, then `response.failed` with the response
        as far as it got."""
        body = error.get("error") or {}
        code, message = body.get("code") or body.get("type") or "server_error", body.get("message", "")
        response = _envelope(self.request, self.resp_id, self.created, "failed")
        response["output"], response["error"] = self.output, {"code": code, "message": message}
        return [
            self._event("error", code=code, message=message, param=body.get("param")),
            self._event("response.failed", response=response),
        ]


# ------------------------------------------------------------------ response -> chat (pass-through)


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
