"""Retries are not trajectories: which of a session's calls the trainer must leave out.

A call whose answer never reached the client (it left: 499) is recorded as an error and
`call_turn` skips it already. A client's retry leaves an orphan: two calls of one session
with the same request (the same conversation so far), of which the conversation went on
from at most one answer. The orphan is every such call but the one a later call continued
from (its request's messages extend the call's messages with that call's answer); when
none was continued from (the retried call was the last turn), the latest one is kept.

Greedy calls are not trained either (`is_greedy_call`: temperature below 1e-5,
`gateway.settings.GREEDY_BELOW`): `trainer.data` keeps their completion as context only
and counts them (`GREEDY`, the step's `greedy_calls` metric).

Pure functions over the store's call dicts (`request` is always the chat form, whatever
protocol the call came in by, so calls of different protocols compare).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import orjson

from gateway.settings import is_greedy


def _key(call: dict) -> bytes | None:
    """What makes two requests the same question: the conversation, the tools, the model
    (None for a call without a conversation: nothing to compare)."""
    request = call.get("request") or {}
    if not request.get("messages"):
        return None
    return orjson.dumps(
        [request.get("model"), request.get("messages"), request.get("tools")], option=orjson.OPT_SORT_KEYS
    )


def _answer(call: dict) -> tuple:
    message = ((call.get("response") or {}).get("choices") or [{}])[0].get("message") or {}
    calls = tuple(
        ((c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments"))
        for c in message.get("tool_calls") or []
    )
    return (message.get("content") or "", calls)


def _continues(later: dict, earlier: dict) -> bool:
    """`later`'s conversation is `earlier`'s followed by `earlier`'s answer."""
    before = (earlier.get("request") or {}).get("messages") or []
    after = (later.get("request") or {}).get("messages") or []
    if len(after) <= len(before) or after[: len(before)] != before:
        return False
    next_message = after[len(before)]
    if next_message.get("role") != "assistant":
        return False
    calls = tuple(
        ((c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments"))
        for c in next_message.get("tool_calls") or []
    )
    return (next_message.get("content") or "", calls) == _answer(earlier)


def _orphan_positions(calls: Sequence[dict]) -> set[int]:
    """Positions in `calls` (call order, one session) of the calls a retry made orphans."""
    ok = [(n, c) for n, c in enumerate(calls) if c.get("status") == "ok"]
    by_request: dict[bytes, list[int]] = {}
    for i, (_, call) in enumerate(ok):
        if (key := _key(call)) is not None:
            by_request.setdefault(key, []).append(i)
    orphans: set[int] = set()
    for positions in by_request.values():
        if len(positions) < 2:
            continue
        continued = [i for i in positions if any(_continues(later, ok[i][1]) for _, later in ok[i + 1 :])]
        keep = continued[-1] if continued else positions[-1]
        orphans.update(ok[i][0] for i in positions if i != keep)
    return orphans


def retry_orphans(calls: Sequence[dict]) -> set[str]:
    """Ids of the calls (in call order, one session) that a retry made orphans."""
    return {calls[n]["id"] for n in _orphan_positions(calls)}


def trainable_calls(calls: Sequence[dict]) -> list[dict]:
    """A session's calls without those whose answer never reached the client (499), without
    retry orphans and without those recorded after their group was claimed by a step or
    trained (`untrainable`: the store marks them), in order. (Positions, not ids: calls built
    by hand may have none.)"""
    orphans = _orphan_positions(calls)
    return [
        c for n, c in enumerate(calls) if c.get("http_status") != 499 and n not in orphans and not c.get("untrainable")
    ]


# ------------------------------------------------------------------ greedy calls


def _recorded_temperature(call: dict) -> float | None:
    """The engine's record of the temperature in force, else what the request asked for
    (None: neither says, or not a number)."""
    temperature: Any = (call.get("sampling") or {}).get("temperature")  # JSON: a number, or anything
    if temperature is None:
        temperature = (call.get("request") or {}).get("temperature")
    try:
        temperature = float(temperature)
    except (TypeError, ValueError):
        return None
    return temperature if math.isfinite(temperature) and temperature >= 0 else None


def is_greedy_call(call: dict) -> bool:
    """Whether a call sampled greedily: temperature below 1e-5 (`GREEDY_BELOW`), whichever
    engine answered it (vLLM's own rule; the engines record it as 0)."""
    temperature = _recorded_temperature(call)
    return temperature is not None and is_greedy(temperature)


def sampling_temperature(call: dict) -> float:
    """The temperature a call's completion was sampled at; greedy and unknown count as 1."""
    temperature = _recorded_temperature(call)
    return 1.0 if temperature is None or is_greedy(temperature) else temperature


GREEDY = "greedy: sampled at temperature < 1e-5 (a point mass, no distribution to train on)"
"""Why a greedy call is not trained (counted per step: the `greedy_calls` metric)."""


def greedy_calls(calls: Sequence[dict]) -> list[str]:
    """Ids of the calls of a session (call order) that would train but for `GREEDY`."""
    return [c.get("id", "") for c in trainable_calls(calls) if c.get("status") == "ok" and is_greedy_call(c)]


# ------------------------------------------------------------------ a session that trains nothing

EVERY_CALL_FAILED = "no trainable sample: every call failed"
CLIENT_LEFT = "no trainable sample: its client left before every answer (499)"
EVERY_CALL_LATE = "no trainable sample: every call came after its group was claimed by a step"
EVERY_CALL_GREEDY = "no trainable sample: every call was " + GREEDY


def untrained_reason(calls: Sequence[dict]) -> str | None:
    """Why a session's calls (call order) gave no trainable sample, where one cause explains
    every call; None otherwise (a mix, or a call that could not be re-rendered, which the
    trainer's log names): the session's `untrained_reason` on the dashboard says which."""
    if not calls:
        return None
    answered = [c for c in calls if c.get("status") == "ok" and c.get("http_status") != 499]
    if not answered:
        return CLIENT_LEFT if all(c.get("http_status") == 499 for c in calls) else EVERY_CALL_FAILED
    if len(answered) < len(calls):
        return None  # some failed, some did not: the list of causes
    if all(c.get("untrainable") for c in answered):
        return EVERY_CALL_LATE
    if all(is_greedy_call(c) for c in answered):
        return EVERY_CALL_GREEDY
    return None
