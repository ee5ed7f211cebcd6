"""Calls recorded without token ids (the `openai` engine) -> turns, with the base model's chat template.

The prompt is the request's messages (and tools) rendered with the generation prompt (or, for
a prefill, `continue_final_message`, up to the end of the last assistant message's text); the
completion is what rendering the response's assistant message appends to it, up to and
including the end-of-turn token the model would have sampled. No behaviour logprobs: the
upstream's policy is unknown.

The text of one of the tokenizer's special tokens inside a message (a user's or a reply's
literal "<|im_end|>") is tokenized as text, as the local engine serves it
(`gateway.models.special_text`): encoded as the template's own text is, it would become the
control token, a turn ended mid-reply, a fake turn in the prompt.

A call that cannot be rendered faithfully is not trained (`ChatTemplateRenderer.turn` says why,
the trainer's log repeats it): a content part the template drops (an image, audio, a file: the
reply would train as the answer to a question without it), a special token's text in a string
the template rewrites (cuts: its place is unknown; one escaped is rendered as escaped), a
template that refuses the conversation (one that allows no system message), or one that is not
prefix-stable.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from typing import Any

from gateway.models.special_text import SpecialText, SpecialTextError
from trainer.data import Turn

log = logging.getLogger("rlproxy.trainer")

NAN = math.nan


_TEMPLATE_ROLES = {"developer": "system", "function": "tool"}

NO_REPLY = "the response has no assistant message"
DROPPED_PARTS = "a message has content parts the chat template drops ({kinds}); only text is trained"
SPECIAL_TEXT = (
    "a message's text holds '{token}', a special token of the tokenizer, that cannot be told from the "
    "template's own tokens (the chat template rewrites it, or a message holds a private-use character "
    "rlproxy reserves)"
)
TEMPLATE_REFUSED = "the chat template refused the conversation: {error}"
NOT_PREFIX_STABLE = "the chat template is not prefix-stable for one of its calls"


_WORDS = {"text": "text", "refusal": "refusal"}
"""Content parts that are words, and the field that holds them (a refusal is what the model said)."""


def dropped_parts(messages: Sequence[dict]) -> set[str]:
    """The kinds of the content parts of `messages` that are not words (rendering keeps only words)."""
    kinds = set()
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            kinds |= {
                str(part.get("type")) for part in content if isinstance(part, dict) and part.get("type") not in _WORDS
            }
    return kinds


def _plain_message(message: dict) -> dict:
    """A wire message as chat templates expect it, the way the local engine renders it
    (`gateway.engines.local.request`): text (and refusal) parts joined into one string, OpenAI's newer roles
    mapped to the ones templates know, tool-call arguments given as an object (templates
    write `arguments | tojson`; a JSON string would be encoded twice)."""
    out = dict(message)
    role = out.get("role")
    out["role"] = _TEMPLATE_ROLES.get(role, role) if isinstance(role, str) else role
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = "".join(
            str(part.get(_WORDS[str(part.get("type"))]) or "")
            for part in content
            if isinstance(part, dict) and part.get("type") in _WORDS
        )
    if not out.get("content") and isinstance(out.get("refusal"), str):
        # OpenAI's refusal: the words the model answered with instead of content. Left out,
        # the reply rendered (and trained) as an empty turn.
        out["content"] = out["refusal"]
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
        self.chat = SpecialText(tokenizer)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens included (a tool call's tags are often special)."""
        return str(self.tokenizer.decode(list(ids)))

    def __call__(self, request: dict, response: dict) -> Turn | None:
        """The call's turn, or None (logged with the reason) where it cannot be rendered faithfully."""
        turn = self.turn(request, response)
        if isinstance(turn, str):
            log.warning("a recorded call is not trained on: %s", turn)
            return None
        return turn

    def turn(self, request: dict, response: dict) -> Turn | str:
        """The call's turn, or why it cannot be rendered faithfully (module docstring)."""
        choices = response.get("choices") or []
        if not choices or not choices[0].get("message"):
            return NO_REPLY
        dropped = dropped_parts([*request.get("messages", []), choices[0]["message"]])
        if dropped:
            return DROPPED_PARTS.format(kinds=", ".join(sorted(dropped)))
        try:
            return self._turn(request, choices[0])
        except SpecialTextError:
            strings = json.dumps(
                [request.get("messages"), request.get("tools"), choices[0]["message"]], ensure_ascii=False
            )
            found = self.chat.pattern.search(strings) if self.chat.pattern else None
            return SPECIAL_TEXT.format(token=found.group() if found else "?")
        except Exception as error:  # jinja's errors, and templates raise exceptions by design
            return TEMPLATE_REFUSED.format(error=error)

    def _turn(self, request: dict, choice: dict) -> Turn | str:
        messages = [_plain_message(m) for m in request.get("messages", [])]
        reply = {**_plain_message(choice["message"]), "role": "assistant"}
        tools = request.get("tools") or None
        render = self.chat.render  # a special token's text in a string: rendered to be tokenized as text
        if request.get("continue_final_message") and messages and messages[-1].get("role") == "assistant":
            # A prefill (vLLM's flag): the reply continued the last assistant message's text.
            prompt = render(messages, tools=tools, continue_final_message=True)
            prefill = messages.pop()
            reply = {**reply, "content": (prefill.get("content") or "") + (reply.get("content") or "")}
        else:
            prompt = render(messages, tools=tools, add_generation_prompt=True)
        full = render([*messages, reply], tools=tools)
        if not full.text.startswith(prompt.text):
            return NOT_PREFIX_STABLE
        completion_text = full.text[len(prompt.text) :]
        if self.end_of_turn and self.end_of_turn in completion_text:
            end = completion_text.rindex(self.end_of_turn)
            # A reply cut by max_tokens never sampled the end-of-turn token.
            finished = choice.get("finish_reason") != "length"
            completion_text = completion_text[: end + len(self.end_of_turn) if finished else end]
        completion_ids = self.chat.encode(completion_text, full.shielded)
        return Turn(tuple(self.chat.encode(*prompt)), tuple(completion_ids), (NAN,) * len(completion_ids))
