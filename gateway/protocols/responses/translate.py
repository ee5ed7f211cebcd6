"""A Responses request to a chat request body (`to_chat`), and a chat.completion back to a
`response` object (`from_chat`): pure functions."""

from __future__ import annotations

import time
from typing import Any

from gateway.errors import InvalidRequest
from gateway.protocols import text_of
from gateway.protocols.responses.wire import LOGPROBS, FunctionTool, ResponsesRequest

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


def _strings(item: dict, i: int, fields: tuple[str, ...]) -> None:
    """An item's fields that must be strings (`arguments` is JSON text), checked here so the
    400 names the item's field, not the chat field it becomes."""
    for name in fields:
        value = item.get(name)
        if value is not None and not isinstance(value, str):
            hint = " (the arguments as JSON text: json.dumps them)" if name == "arguments" else ""
            raise InvalidRequest(
                f"input[{i}].{name} must be a string, not {type(value).__name__}{hint}", param=f"input[{i}].{name}"
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
            if item.get("content") is None:  # answered, the model would get an empty turn in its place
                raise InvalidRequest(f"input[{i}]: a message item needs 'content'", param=f"input[{i}].content")
            for part in item.get("content") if isinstance(item.get("content"), list) else []:
                if isinstance(part, dict) and part.get("type") not in ("input_text", "output_text", "text", "refusal"):
                    raise InvalidRequest(
                        f"input[{i}]: content part '{part.get('type')}' is not supported: "
                        "rlproxy's models read text only",
                        param=f"input[{i}].content",
                    )
            messages.append({"role": role, "content": text_of(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id") or item.get("id"),
                "type": "function",
                "function": {"name": item.get("name", ""), "arguments": item.get("arguments") or "{}"},
            }
            if not call["id"]:
                raise InvalidRequest(f"input[{i}]: a function_call item needs 'call_id'", param=f"input[{i}].call_id")
            _strings(item, i, ("call_id", "name", "arguments"))
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
            _strings(item, i, ("call_id",))
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": text_of(item.get("output"), f"input[{i}].output"),
                }
            )
        elif kind == "reasoning":
            continue
        else:
            raise InvalidRequest(
                f"input[{i}]: item type '{kind}' is not supported: use message, function_call or function_call_output",
                param=f"input[{i}].type",
            )
    return messages


# The chat fields to_chat fills from another field of the request: an error about one names the client's.
CHAT_FIELDS = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
    "tools": "tools",
    "tool_choice": "tool_choice",
}


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
    if request.top_logprobs or LOGPROBS in (request.include or []):
        body["logprobs"] = True  # each output_text part then carries its tokens' logprobs
        if request.top_logprobs:
            body["top_logprobs"] = request.top_logprobs
    if (tools := _tools(request.tools)) is not None:
        body["tools"] = tools
    if (choice := _tool_choice(request.tool_choice)) is not None:
        body["tool_choice"] = choice
    text_format = (request.text.format if request.text else None) or {}
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


def usage_of(usage: dict | None) -> dict | None:
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


def envelope(request: dict, resp_id: str, created: float, status: str) -> dict:
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


def message_item(resp_id: str, text: str, status: str = "completed", logprobs: list | None = None) -> dict:
    """The assistant message item; `logprobs` (chat's `logprobs.content` entries, the same
    shape as Responses' own) only where the client asked for them."""
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {
        "type": "message",
        "id": "msg_" + resp_id.removeprefix("resp_"),
        "status": status,
        "role": "assistant",
        "content": [part] if status == "completed" else [],
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
    response = envelope(request, resp_id, chat_response.get("created") or time.time(), "completed")
    text = text_of(message.get("content"))
    if text:
        logprobs = (choice.get("logprobs") or {}).get("content")
        response["output"].append(message_item(resp_id, text, logprobs=logprobs))
    for index, call in enumerate(message.get("tool_calls") or []):
        response["output"].append(function_call_item(resp_id, index, call))
    if choice.get("finish_reason") == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    response["usage"] = usage_of(chat_response.get("usage"))
    return response
