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

OpenAI trains every assistant message unless it says `"weight": 0`; the trainer trains only the
replies the model sampled. So an assistant message that is no such reply (history the client
wrote, few-shot examples, a greedy call's reply, one trained in an earlier sample) gets weight 0,
and a prefill (`continue_final_message`) and its continuation are one assistant message, as the
model produced them: written as two, the model would learn to end its turn after the prefill.
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


def _plain(content: Any) -> str:
    text = _text(content)
    return text if isinstance(text, str) else ""


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


def _is_prefill(request: dict) -> bool:
    """Whether the call continued the request's last (assistant) message: vLLM's flag, which
    the Messages route sets for Anthropic's prefill too."""
    messages = request.get("messages") or []
    return bool(request.get("continue_final_message")) and bool(messages) and messages[-1].get("role") == "assistant"


def reply_position(request: dict) -> int:
    """Where a call's reply stands in the conversation of a later call that extends it: after
    the request's messages, or in place of the last one for a prefill (the agent sends the
    prefill and its continuation back as one message)."""
    n = len(request.get("messages") or [])
    return n - 1 if _is_prefill(request) else n


def wire_messages(request: dict, response: dict) -> list[dict] | None:
    """The request's messages (as recorded) plus choice 0's reply, a prefill and its continuation
    as one message; None when the call has no reply."""
    choices = (response or {}).get("choices") or []
    if not choices or not choices[0].get("message"):
        return None
    wire = list(request.get("messages") or [])
    reply = {**choices[0]["message"], "role": "assistant"}
    if _is_prefill(request):
        prefill = wire.pop()
        reply = {**reply, "content": _plain(prefill.get("content")) + _plain(reply.get("content"))}
    return [*wire, reply]


def conversation(request: dict, response: dict, trained: set[int] | None = None) -> dict | None:
    """The request's messages plus choice 0's reply (and the request's tools); None when
    the call has no reply to learn from. `trained`: the positions of the assistant messages
    the trainer trained (`reply_position` of each trained call); the others get weight 0.
    None: the reply alone."""
    wire = wire_messages(request, response)
    if wire is None:
        return None
    messages = [fine_tune_message(m) for m in wire]
    trained = {len(messages) - 1} if trained is None else trained
    for position, message in enumerate(messages):
        if message["role"] == "assistant" and position not in trained:
            message["weight"] = 0
    out: dict = {"messages": messages}
    tools = [t for t in request.get("tools") or [] if isinstance(t, dict) and t.get("type", "function") == "function"]
    if tools:
        out["tools"] = [{"type": "function", "function": t["function"]} for t in tools if t.get("function")]
    if isinstance(request.get("parallel_tool_calls"), bool):
        out["parallel_tool_calls"] = request["parallel_tool_calls"]
    return out
