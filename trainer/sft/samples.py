"""Recorded sessions -> supervised samples: the assistant turns, as the student's chat template writes them.

Every call of a session is re-rendered with the student's template (`trainer.render`), whatever
model answered it: a teacher behind the `openai` engine has another tokenizer, and the
student's own traffic renders to the same tokens it was sampled as. A call's completion is the
assistant message (text and tool calls) up to and including the end-of-turn token; the turns
of one session merge into one sample while each prompt extends the sequence so far, so the
system, user and tool turns in between are context (masked) and every assistant turn is
trained once. Where a prompt does not extend it (a reasoning template, Qwen3's family, writes
`<think>...</think>` only for the turn being rendered and drops it from the history; an agent
that rewrote its history), a new sample starts there, with the whole prompt as context: GRPO's
turn merging (`trainer.data.merge_turns`), the same rule. Each such start is a split, counted.

A session is skipped, with the reason, and counted, never trained wrongly, when rendering it
is ambiguous: a message has content parts the template drops (an image, audio, a file) or the
text of a special token, the template refuses the conversation or is not prefix-stable
(`trainer.render`), or it does not write one of the reply's tool calls or its text.

Pure functions over the store's call dicts and a renderer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainer.data import Turn, merge_turns
from trainer.render import (  # noqa: F401  (the reasons a session is skipped for, named here too)
    DROPPED_PARTS,
    NOT_PREFIX_STABLE,
    SPECIAL_TEXT,
    TEMPLATE_REFUSED,
    ChatTemplateRenderer,
)
from trainer.retries import trainable_calls
from trainer.types import Sample

NO_CALLS = "no answered call"
NO_TOKENS = "no assistant token to train: every reply rendered empty"
TOOL_CALL_LOST = "the chat template does not write the reply's tool call '{name}'"
TEXT_LOST = "the chat template does not write the reply's text"


@dataclass(frozen=True)
class SessionSamples:
    """What one session gives supervised training: samples, or why none."""

    session_id: str
    samples: tuple[Sample, ...]
    skipped: str | None = None
    splits: int = 0
    """Where a call's prompt did not extend the sequence so far and a new sample started."""


def _lost(reply: dict, completion_text: str) -> str | None:
    """Why the rendered completion does not carry the reply (None: it does)."""
    for call in reply.get("tool_calls") or []:
        function = call.get("function") or {}
        name = str(function.get("name") or "")
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (TypeError, ValueError):
            arguments = None
        keys = list(arguments) if isinstance(arguments, dict) else []
        if name not in completion_text or any(str(key) not in completion_text for key in keys):
            return TOOL_CALL_LOST.format(name=name)
    text = reply.get("content")
    if isinstance(text, list):
        text = "".join(p.get("text", "") for p in text if isinstance(p, dict))
    if isinstance(text, str) and text.strip() and text.strip() not in completion_text:
        return TEXT_LOST
    return None


def session_samples(session_id: str, calls: Sequence[dict], render: ChatTemplateRenderer) -> SessionSamples:
    """The supervised sample of one session (its calls in order), or why it is skipped."""
    answered = [c for c in trainable_calls(calls) if c.get("status") == "ok" and c.get("response")]
    if not answered:
        return SessionSamples(session_id, (), NO_CALLS)
    turns: list[Turn] = []
    for call in answered:
        request, response = call["request"], call["response"]
        reply = ((response.get("choices") or [{}])[0]).get("message") or {}
        turn = render.turn(request, response)
        if isinstance(turn, str):
            return SessionSamples(session_id, (), turn)
        lost = _lost(reply, render.decode(turn.completion_ids))
        if lost is not None:
            return SessionSamples(session_id, (), lost)
        turns.append(turn)
    samples = merge_turns(turns, trajectory_id=session_id, group_id=session_id, advantage=1.0)  # no advantage in SFT
    if not samples:
        return SessionSamples(session_id, (), NO_TOKENS)
    return SessionSamples(session_id, tuple(samples), splits=len(samples) - 1)


def load_session_samples(store: Any, session_ids: Sequence[str], render: ChatTemplateRenderer) -> list[SessionSamples]:
    """`session_samples` of sessions read from the store (the one I/O function here)."""
    return [session_samples(sid, store.session_calls(sid), render) for sid in session_ids]
