"""The protocols an agent may speak, each translated to and from the internal chat form.

`chat` is the internal form itself: OpenAI Chat Completions' wire models, which the hot path
parses every request with (one light module). Each other protocol is a package of the same
four modules: `responses` (OpenAI Responses), `messages` (Anthropic Messages), `completions`
(legacy completions).

    wire.py       its pydantic request models (unknown fields pass through), its ids, its
                  own error body where it has one, and `PROTOCOL`, its name in the call row
    translate.py  a pair of pure functions: `to_chat` (wire request -> chat request body)
                  and `from_chat` (chat response -> wire response)
    stream.py     its stream encoder (chat chunks -> the protocol's SSE events)
    relay.py      for an upstream that speaks the protocol itself (`--upstream-protocol`):
                  `to_chat_response` (wire response -> chat, for the record) and
                  `Accumulator` (a relayed event stream -> the whole wire response)

In a package a module imports only the ones above it in this list. `toolcalls` turns tool
calls written in model text into chat `tool_calls`. Engines and the trainer only ever see the
chat form; `Wire` is what the chat service records beside it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gateway.errors import InvalidRequest


@dataclass(frozen=True)
class Wire:
    """A call that came in by another protocol than chat: recorded with the call row."""

    protocol: str  # "responses" | "messages" | "completions"
    request: dict  # the client's body as it sent it
    to_wire: Callable[[dict], dict]  # chat.completion -> the response this protocol's client got


def text_of(content: object, where: str | None = None) -> str:
    """Text of a content value in any of the protocols' shapes: a string, or a list of parts
    whose text is under `text` (chat `text`, Responses `input_text`/`output_text`, Anthropic `text`).

    `where` (a client's request: "messages[2].content") refuses, naming the place, what is
    neither a string nor a list of parts, a text part whose `text` is not a string (a client's
    mistake, to be told about in a 400, not joined into a 500), and a part that is not text (an
    image, a document): rlproxy's models read text only, and an answer made without it would
    silently be to another question."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                if where is not None:
                    raise InvalidRequest(f"{where}[{j}] must be a content part (an object)", param=f"{where}[{j}]")
                continue
            kind = part.get("type", "text")
            if kind not in _TEXT_PARTS:
                if where is not None and kind != "refusal":
                    raise InvalidRequest(
                        f"{where}[{j}]: content part '{kind}' is not supported: rlproxy's models read text only",
                        param=f"{where}[{j}].type",
                    )
                continue
            text = part.get("text", "")
            if not isinstance(text, str):
                if where is None:
                    continue
                raise InvalidRequest(
                    f"{where}[{j}].text must be a string, not {type(text).__name__}", param=f"{where}[{j}].text"
                )
            texts.append(text)
        return "".join(texts)
    if where is not None:
        raise InvalidRequest(
            f"{where} must be a string or a list of content parts, not {type(content).__name__}", param=where
        )
    return str(content)


_TEXT_PARTS = ("text", "input_text", "output_text")


def in_client_terms(exc: InvalidRequest, fields: Mapping[str, str]) -> InvalidRequest:
    """`exc`, raised about the translated chat request, told in the client's own terms: a chat
    field in `param` and in the message (quoted, or a validation error's leading place) becomes
    the field the client sent (`max_tokens` -> `max_output_tokens`). `fields` maps a chat field
    to the client's; the place below it (`messages[3].content`) is dropped, since a translation
    need not keep indices (a system prompt, a Responses input item made into several messages)."""
    if exc.param:
        root = re.match(r"[A-Za-z_]+", exc.param)
        if root and root.group() in fields:
            exc.param = fields[root.group()]
    message = exc.message
    for chat, client in fields.items():
        message = re.sub(rf"(^|; ){chat}(?=[.:\[])[^:;]*:", rf"\g<1>{client}:", message)
        message = message.replace(f"'{chat}'", f"'{client}'")
    exc.message = message
    exc.args = (message,)
    return exc
