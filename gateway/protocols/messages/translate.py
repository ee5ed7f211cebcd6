"""A Messages request to a chat request body (`to_chat`), and a chat.completion back to a
`message` (`from_chat`): pure functions."""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import InvalidRequest
from gateway.protocols import text_of
from gateway.protocols.messages.wire import MessagesRequest, Tool

# ------------------------------------------------------------------ request -> chat


def _string(block: dict, name: str, where: str, default: str | None = None) -> str:
    """A block's field that must be a string, checked here so the 400 names the block's field,
    not the chat field it becomes."""
    value = block.get(name, default)
    if not isinstance(value, str):
        what = "is missing" if value is None else f"must be a string, not {type(value).__name__}"
        raise InvalidRequest(f"{where}.{name} {what}", param=f"{where}.{name}")
    return value


def _block_text(block: dict, where: str) -> str:
    return _string(block, "text", where, default="")


def _user_messages(blocks: list[dict], where: str) -> list[dict]:
    tool_messages, texts = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            texts.append(_block_text(block, f"{where}.content[{j}]"))
        elif kind == "tool_result":
            if not block.get("tool_use_id"):
                raise InvalidRequest(f"{where}.content[{j}]: a tool_result block needs 'tool_use_id'")
            _string(block, "tool_use_id", f"{where}.content[{j}]")
            content = text_of(block.get("content"), f"{where}.content[{j}].content")
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
            texts.append(_block_text(block, f"{where}.content[{j}]"))
        elif kind == "tool_use":
            place = f"{where}.content[{j}]"
            calls.append(
                {
                    "id": _string(block, "id", place),
                    "type": "function",
                    "function": {
                        "name": _string(block, "name", place),
                        "arguments": json.dumps(block.get("input") or {}),
                    },
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


def refuse_builtin_tools(request: MessagesRequest) -> None:
    """Anthropic's own tool types (web_search_..., bash_..., text_editor_..., computer_...) come
    without an input_schema a model could read, and a server tool needs Anthropic to run it:
    refused where rlproxy's engine answers (an upstream that speaks Messages takes them), not
    offered as a function with no parameters that the model would call blind."""
    for i, tool in enumerate(request.tools or []):
        kind = (tool.model_extra or {}).get("type")
        if kind not in (None, "custom"):
            raise InvalidRequest(
                f"tools[{i}]: tool type '{kind}' is not supported by rlproxy's engines: only custom tools (name, "
                "description, input_schema); run the tool in the agent and describe it as a custom tool",
                param=f"tools[{i}].type",
            )


def _tools(tools: list[Tool]) -> list[dict]:
    out = []
    for tool in tools:
        function = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description:
            function["description"] = tool.description
        out.append({"type": "function", "function": function})
    return out


# The chat fields to_chat fills from another field of the request: an error about one names the client's.
CHAT_FIELDS = {
    "messages": "messages",
    "stop": "stop_sequences",
    "tools": "tools",
    "tool_choice": "tool_choice",
    "parallel_tool_calls": "tool_choice",
}


def to_chat(request: MessagesRequest) -> dict:
    messages: list[dict] = []
    if request.system:
        messages.append({"role": "system", "content": text_of(request.system, "system")})
    for i, message in enumerate(request.messages):
        blocks = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
        if message.role == "user":
            messages += _user_messages(blocks, f"messages[{i}]")
        else:
            messages.append(_assistant_message(blocks, f"messages[{i}]"))
    body: dict[str, Any] = {"model": request.model, "messages": messages, "max_tokens": request.max_tokens}
    last = messages[-1]
    if last["role"] == "assistant" and last.get("content") and not last.get("tool_calls"):
        # A prefill: Anthropic's answer continues this text. A chat template would close it and
        # open a new turn, so the flags vLLM reads (the local engine too) continue it instead.
        body.update(continue_final_message=True, add_generation_prompt=False)
    for name in ("temperature", "top_p", "top_k"):
        if (value := getattr(request, name)) is not None:
            body[name] = value
    if request.stop_sequences:
        body["stop"] = request.stop_sequences
    if request.tools:
        body["tools"] = _tools(request.tools)
    choice, parallel = _tool_choice(request.tool_choice)
    if choice is not None:
        body["tool_choice"] = choice
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    return body


# ------------------------------------------------------------------ chat -> message


STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}


def arguments_of(text: str) -> dict:
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {"_raw": text}  # a model's malformed JSON is kept, not lost
    return value if isinstance(value, dict) else {"_value": value}


def stop_of(finish_reason: str | None, stop_reason: object, request: dict) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` for a chat choice's end. A chat choice that a
    stop string ended says only "stop"; the engine's `stop_reason` (vLLM's, the local engine's)
    names the string, so a client that asked for `stop_sequences` learns which one it was."""
    if finish_reason in (None, "stop") and isinstance(stop_reason, str):
        if stop_reason in (request.get("stop_sequences") or []):
            return "stop_sequence", stop_reason
    return STOP_REASONS.get(finish_reason or "stop", "end_turn"), None


def usage_of(usage: dict | None) -> dict:
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
                "input": arguments_of(function.get("arguments", "")),
            }
        )
    stop_reason, stop_sequence = stop_of(choice.get("finish_reason"), choice.get("stop_reason"), request)
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": request.get("model"),
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage_of(chat_response.get("usage")),
    }
