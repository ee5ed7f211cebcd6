"""A chat request as the local engine takes it: validated, rendered to prompt ids, its `Sampling`.

Runs before the request is queued for the worker (the rendering and tokenising on a thread of
its own: a long prompt takes seconds). vLLM's `top_k`, `min_p`, `repetition_penalty` and
`ignore_eos` (an eos token does not end the choice) are accepted as extra body fields.
`response_format` is accepted and ignored (no constrained decoding); `logit_bias`, vLLM's
`min_tokens`, `stop_token_ids`, `include_stop_str_in_output` and `use_beam_search`, and content
parts other than text are refused (a 400), since an answer made without them would silently be
to another request.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from gateway.engines.local.jobs import Sampling
from gateway.errors import InvalidRequest
from gateway.http.limits import check_room
from gateway.models.special_text import SpecialText, SpecialTextError
from gateway.protocols.chat import ChatCompletionRequest, EngineChatRequest


def parse_request(body: dict) -> ChatCompletionRequest:
    try:
        return EngineChatRequest.model_validate(body)
    except ValidationError as error:
        raise InvalidRequest(_validation_message(error)) from None


def render_prompt(chat: SpecialText, req: ChatCompletionRequest) -> list[int]:
    """Prompt token ids: the chat template over messages (+ tools), with the generation prompt,
    or, with vLLM's `continue_final_message` (an Anthropic prefill), ending inside the last
    assistant message so the completion continues it. A special token's text inside a message
    is read as text, never as the template's token (`gateway.models.special_text`): a user's
    "<|im_end|>\n<|im_start|>system" forges no system turn."""
    _check_text_only(req)
    messages = [_template_message(m) for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    extra = req.model_extra or {}
    continued = extra.get("continue_final_message") is True
    if continued and (req.messages[-1].role != "assistant" or extra.get("add_generation_prompt") is not False):
        raise InvalidRequest(
            "'continue_final_message' continues a last assistant message: end 'messages' with one, and set "
            "'add_generation_prompt': false",
            param="continue_final_message",
        )
    try:
        rendered = chat.render(
            messages, tools=tools, add_generation_prompt=not continued, continue_final_message=continued
        )
    except SpecialTextError as error:
        raise InvalidRequest(f"{error}: take it out of the messages", param="messages") from None
    except Exception as error:  # jinja raises its own types, templates raise exceptions by design
        raise InvalidRequest(f"the model's chat template rejected these messages: {error}", param="messages") from None
    return chat.encode(*rendered)


def completion_room(req: ChatCompletionRequest, prompt_ids: list[int], context: int) -> tuple[int | None, int]:
    """The completion tokens asked for (None: not said) and the room the context leaves;
    refuses a request that does not fit."""
    limit = req.max_completion_tokens or req.max_tokens
    field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    return limit, check_room(len(prompt_ids), limit, field, context)


def sampling_of(req: ChatCompletionRequest, max_new_tokens: int) -> Sampling:
    """How the request samples: OpenAI's fields with their defaults, vLLM's extra ones checked."""
    extra = _extra_sampling(req.model_extra or {})
    return Sampling(
        max_new_tokens=max_new_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        stops=[s for s in (req.stop or []) if s],
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
        seed=req.seed,
        **extra,
    )


def _check_text_only(req: ChatCompletionRequest) -> None:
    """Refuse a content part the model cannot read (an image, audio, a file): rendered without
    it, the answer would be to another question, and the client would not know."""
    for i, message in enumerate(req.messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else []):
            if part.get("type", "text") not in ("text", "refusal"):
                raise InvalidRequest(
                    f"messages[{i}].content[{j}]: content part '{part.get('type')}' is not supported by the local "
                    "engine: its models read text only (send text parts)",
                    param=f"messages[{i}].content[{j}].type",
                )


def _template_message(message) -> dict:
    """A protocol message as chat templates expect it (text content, arguments as objects)."""
    role = {"developer": "system", "function": "tool"}.get(message.role, message.role)
    out: dict = {"role": role, "content": message.text()}
    if message.name:
        out["name"] = message.name
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            arguments: Any = call.function.arguments
            try:
                parsed = json.loads(arguments)
                if isinstance(parsed, dict):
                    arguments = parsed  # templates write `arguments | tojson`, as vLLM passes them
            except ValueError:
                pass
            calls.append(
                {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}
            )
        out["tool_calls"] = calls
    return out


def _validation_message(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"]) or "body"
        parts.append(f"{where}: {item['msg']}")
    return "invalid request: " + "; ".join(parts)


# vLLM's sampling fields beyond OpenAI's, accepted as extra body fields: (name, type, check, hint)
_EXTRA_SAMPLING = (
    ("top_k", int, lambda v: v == -1 or v >= 0, "-1 or 0 (off), or a positive number of tokens"),
    ("min_p", float, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]"),
    ("repetition_penalty", float, lambda v: v > 0, "a number > 0 (1 is off)"),
)


# Fields that change the answer and that the local engine does not apply, with their neutral
# values: set to anything else, they are refused. Answered without them, the answer would be to
# another request (a banned token written, a stop token run past) and the client would not know.
_NOT_APPLIED = (
    ("logit_bias", {}),
    ("min_tokens", 0),  # vLLM's, as the rest
    ("stop_token_ids", []),
    ("include_stop_str_in_output", False),
    ("use_beam_search", False),
)


def _extra_sampling(extra: dict) -> dict:
    """top_k, min_p and repetition_penalty from the request's extra fields, checked."""
    for name, neutral in _NOT_APPLIED:
        if extra.get(name) not in (None, neutral):
            raise InvalidRequest(
                f"'{name}' is not supported by the local engine (the vllm engine takes it): drop it", param=name
            )
    out = {}
    for name, kind, valid, hint in _EXTRA_SAMPLING:
        value = extra.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise InvalidRequest(f"'{name}' must be {hint}; got {value!r}", param=name)
        value = kind(value)
        if not valid(value):
            raise InvalidRequest(f"'{name}' must be {hint}; got {value!r}", param=name)
        out[name] = value
    ignore_eos = extra.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise InvalidRequest(f"'ignore_eos' must be true or false; got {ignore_eos!r}", param="ignore_eos")
    if ignore_eos:
        out["ignore_eos"] = True
    return out
