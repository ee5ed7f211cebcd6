"""Which live calls are shadowed, what the engine is asked for, and the rows a shadow group is
recorded as: pure functions over the live call's `CallRecord`."""

from __future__ import annotations

import copy
import time

from gateway.engines.base import TokenRecord
from gateway.settings import is_greedy
from gateway.store import CallRecord
from gateway.store.rows import shadow_call_id
from gateway.store.shadows import shadow_group_id

SHADOWED_ENGINES = frozenset({"local", "vllm"})
"""Engines that answer with a policy of ours (an adapter step, or the base model)."""

_NOT_SENT = ("seed", "stream", "stream_options", "logprobs", "top_logprobs", "metadata", "n")


def group_id_for(call_id: str) -> str:
    return shadow_group_id(call_id)


def why_not_shadowed(record: CallRecord) -> str | None:
    """Why a recorded call gets no shadow samples, or None when it is a live call to shadow: an
    answered train call of an ungrouped session, one choice sampled (not greedy) by our policy."""
    if record.status != "ok" or record.untrainable is not None:
        return "not answered"
    if record.shadow_of is not None or record.group_id is not None:
        return "not live"  # a harness's rollouts are compared in their own groups
    if record.split != "train":
        return "val"
    if record.engine not in SHADOWED_ENGINES:
        return "no policy of ours"
    if record.completion_ids is None or len(record.completion_ids) != 1 or record.behaviour_logprobs is None:
        return "not one sampled choice"
    temperature = (record.sampling or {}).get("temperature")
    if temperature is None or is_greedy(float(temperature)):
        return "greedy"
    return None


def shadow_body(request: dict, model: str, k: int) -> dict:
    """The live call's request as the engine is asked for K shadows of it: the same messages,
    tools and sampling parameters, for the step that answered it, without the seed."""
    body = {key: value for key, value in request.items() if key not in _NOT_SENT}
    body["model"] = model
    body["n"] = k
    return body


def _row(live: CallRecord, index: int, **fields) -> CallRecord:
    return CallRecord(
        **{
            "id": shadow_call_id(live.id, index),
            "session_id": f"{group_id_for(live.id)}-{index}",
            "group_id": group_id_for(live.id),
            "split": live.split,
            "model": live.model,
            "served": live.served,
            "step": live.step,
            "engine": live.engine,
            "stream": False,
            "status": "ok",
            "task_key": live.task_key,
            "shadow_of": live.id,
            **fields,
        }
    )


def shadow_calls(live: CallRecord, response: dict, tokens: TokenRecord, latency_ms: float) -> list[CallRecord]:
    """The group's rows: the live answer (a copy, under a session of its own: the client's
    session is left as it was) and one session per shadow choice, each holding one call whose
    context is the live call's and whose completion is its own."""
    assert live.completion_ids is not None and live.behaviour_logprobs is not None
    request = {key: value for key, value in live.request.items() if key != "seed"}
    now = time.time()
    rows = [
        _row(
            live,
            0,
            request=live.request,
            response=live.response,
            latency_ms=live.latency_ms,
            prompt_ids=live.prompt_ids,
            completion_ids=live.completion_ids,
            behaviour_logprobs=live.behaviour_logprobs,
            sampling=live.sampling,
            created_at=now,
        )
    ]
    for i, (choice, choice_tokens) in enumerate(zip(response["choices"], tokens.choices, strict=True), start=1):
        one = copy.deepcopy({**response, "choices": [{**choice, "index": 0}]})
        rows.append(
            _row(
                live,
                i,
                request=request,
                response=one,
                latency_ms=latency_ms,
                prompt_ids=tokens.prompt_ids,
                completion_ids=[choice_tokens.completion_ids],
                behaviour_logprobs=None if choice_tokens.logprobs is None else [choice_tokens.logprobs],
                sampling=tokens.sampling,
                created_at=now,
            )
        )
    return rows


def generated_tokens(tokens: TokenRecord) -> int:
    return sum(len(choice.completion_ids) for choice in tokens.choices)
