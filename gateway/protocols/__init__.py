"""The protocols an agent may speak, each translated to and from the internal chat form.

One module per protocol: `chat` (the internal form itself: OpenAI Chat Completions' wire
models, which the hot path parses every request with), `responses` (OpenAI Responses), `messages` (Anthropic Messages),
`completions` (legacy completions). Each holds its pydantic wire models, a pair of pure
functions (`to_chat`: wire request -> chat request body; `from_chat`: chat response ->
wire response) and a stream encoder (chat chunks -> the protocol's SSE events). Engines
and the trainer only ever see the chat form; `Wire` is what the chat service records
beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Wire:
    """A call that came in by another protocol than chat: recorded with the call row."""

    protocol: str  # "responses" | "messages" | "completions"
    request: dict  # the client's body as it sent it
    to_wire: Callable[[dict], dict]  # chat.completion -> the response this protocol's client got


def text_of(content: object) -> str:
    """Text of a content value in any of the protocols' shapes: a string, or a list of parts
    whose text is under `text` (chat `text`, Responses `input_text`/`output_text`, Anthropic `text`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, dict) and part.get("type", "text") in ("text", "input_text", "output_text")
        )
    return str(content)
