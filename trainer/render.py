"""Calls recorded without token ids (the `openai` engine) -> turns, with the base model's chat template.

The prompt is the request's messages (and tools) rendered with the generation prompt (or, for
a prefill, `continue_final_message`, up to the end of the last assistant message's text); the
completion is what rendering the response's assistant message appends to it, up to and
including the end-of-turn token the model would have sampled. No behaviour logprobs: the
upstream's policy is unknown.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from typing import Any

from trainer.data import Turn

log = logging.getLogger("rlproxy.trainer")

NAN = math.nan


_TEMPLATE_ROLES = {"developer": "system", "function": "tool"}


def _plain_message(message: dict) -> dict:
    """A wire message as chat templates expect it, the way the local engine renders it
    (`gateway.engines.local.request`): text parts joined into one string, OpenAI's newer roles
    mapped to the ones templates know, tool-call arguments given as an object (templates
    write `arguments | tojson`; a JSON string would be encoded twice)."""
    out = dict(message)
    role = out.get("role")
    out["role"] = _TEMPLATE_ROLES.get(role, role) if isinstance(role, str) else role
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = "".join(
            part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"
        )
    if out.get("tool_calls"):
        calls = []
        for call in out["tool_calls"]:
            function = dict(call.get("function") or {})
            try:
                parsed = json.loads(function.get("arguments") or "")
            except (TypeError, ValueError):
                parsed = None
            if isinstance(parsed, dict):
                function["arguments"] = parsed
            calls.append({**call, "function": function})
        out["tool_calls"] = calls
    return out


_MARK = "\u2063rlproxy-end-of-reply\u2063"


def turn_terminator(tokenizer: Any) -> str | None:  # a tokenizer or processor: duck-typed, as HF's are
    """The token the chat template closes an assistant turn with (`<|im_end|>` for Qwen,
    `<|eot_id|>` for Llama 3), which is what the model samples to stop, and not always
    `tokenizer.eos_token` (a base Qwen's is `<|endoftext|>`). Found by rendering a reply and
    reading the special token right after it; the eos token where the template shows none."""
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _MARK}], tokenize=False
        )
    except Exception:  # no chat template, or one that refuses this conversation
        return tokenizer.eos_token
    after = text[text.rfind(_MARK) + len(_MARK) :] if _MARK in text else ""
    ids = list(tokenizer(after, add_special_tokens=False)["input_ids"]) if after else []
    special = set(getattr(tokenizer, "all_special_ids", []) or []) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    if ids and ids[0] in special:
        return tokenizer.convert_ids_to_tokens(ids[0])
    return tokenizer.eos_token


class ChatTemplateRenderer:
    """Turns a call recorded without token ids into a turn, with the tokenizer's chat
    template: prompt = the request's messages (and tools) with the generation prompt;
    completion = what rendering the response's assistant message appends to it, up to
    and including the end-of-turn token the model would have sampled (the template's
    text after it, such as a newline, belongs to the next prompt). No logprobs."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.end_of_turn = turn_terminator(tokenizer)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens included (a tool call's tags are often special)."""
        return str(self.tokenizer.decode(list(ids)))

    def __call__(self, request: dict, response: dict) -> Turn | None:
        choices = response.get("choices") or []
        if not choices or not choices[0].get("message"):
            return None
        messages = [_plain_message(m) for m in request.get("messages", [])]
        reply = {**_plain_message(choices[0]["message"]), "role": "assistant"}
        tools = request.get("tools") or None
        render = self.tokenizer.apply_chat_template
        if request.get("continue_final_message") and messages and messages[-1].get("role") == "assistant":
            # A prefill (vLLM's flag): the reply continued the last assistant message's text.
            prompt_text = render(messages, tools=tools, continue_final_message=True, tokenize=False)
            prefill = messages.pop()
            reply = {**reply, "content": (prefill.get("content") or "") + (reply.get("content") or "")}
        else:
            prompt_text = render(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        full_text = render([*messages, reply], tools=tools, tokenize=False)
        if not full_text.startswith(prompt_text):
            log.warning("chat template is not prefix-stable for a recorded call; the call is not trained on")
            return None
        completion_text = full_text[len(prompt_text) :]
        if self.end_of_turn and self.end_of_turn in completion_text:
            end = completion_text.rindex(self.end_of_turn)
            # A reply cut by max_tokens never sampled the end-of-turn token.
            finished = choices[0].get("finish_reason") != "length"
            completion_text = completion_text[: end + len(self.end_of_turn) if finished else end]
        completion_ids = self._encode(completion_text)
        return Turn(tuple(self._encode(prompt_text)), tuple(completion_ids), (NAN,) * len(completion_ids))
