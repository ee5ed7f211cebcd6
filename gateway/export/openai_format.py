"""A recorded call's conversation in OpenAI's chat fine-tuning format.

One JSON object per line: `{"messages": [...], "tools": [...], "parallel_tool_calls": bool}`
and nothing else (OpenAI rejects a line with any other top-level key). Messages keep only
the keys the format defines for their role:

- system / user: `content` (and `name`); user content parts are kept as a list only when
  one is not text (images), else joined into a string;
- assistant: `content` (omitted when the message only calls tools), `tool_calls` as
  `{"id", "type": "function", "function": {"name", "arguments"}}` with `arguments` a JSON
  string (an object recorded by any route is encoded), `name`;
- tool: `tool_call_id`, `content`.

OpenAI's newer `developer` role is written as `system`, which fine-tuning accepts.
"""

from __future__ import annotations

import json
from typing import Any

_ROLES = {"developer": "system"}


def _text(content: Any) -> Any:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p for p in content if isinstance(p, dict)]
        if all(p.get("type") == "text" for p in parts):
            return "".join(p.get("text", "") for p in parts)
        return parts
    return str(content)


def _tool_call(call: dict) -> dict:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments if arguments is not None else {})
    return {
        "id": call.get("id") or "",
        "type": "function",
        "function": {"name": function.get("name") or "", "arguments": arguments},
    }


def fine_tune_message(message: dict) -> dict:
    role = _ROLES.get(message.get("role"), message.get("role"))
    out: dict = {"role": role}
    content = _text(message.get("content"))
    if role == "assistant":
        calls = [_tool_call(c) for c in message.get("tool_calls") or []]
        if content or not calls:
            out["content"] = content or ""
        if calls:
            out["tool_calls"] = calls
    elif role == "tool":
        out["tool_call_id"] = message.get("tool_call_id") or ""
        out["content"] = content if isinstance(content, str) else json.dumps(content)
    else:
        out["content"] = content if content is not None else ""
    if message.get("name") and role in ("system", "user", "assistant"):
        out["name"] = message["name"]
    return out


def conversation(request: dict, response: dict) -> dict | None:
    """The request's messages plus choice 0's reply (and the request's tools); None when
    the call has no reply to learn from."""
    choices = (response or {}).get("choices") or []
    if not choices or not choices[0].get("message"):
        return None
    messages = [fine_tune_message(m) for m in request.get("messages") or []]
    messages.append(fine_tune_message({**choices[0]["message"], "role": "assistant"}))
    out: dict = {"messages": messages}
    tools = [t for t in request.get("tools") or [] if isinstance(t, dict) and t.get("type", "function") == "function"]
    if tools:
        out["tools"] = [{"type": "function", "function": t["function"]} for t in tools if t.get("function")]
    if isinstance(request.get("parallel_tool_calls"), bool):
        out["parallel_tool_calls"] = request["parallel_tool_calls"]
    return out
