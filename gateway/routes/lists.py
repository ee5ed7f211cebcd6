"""The JSON the dashboard reads, as documented API: paged session and group lists, and a
one-request overview (serving state, calls per minute, reward curves, step metrics)."""

from __future__ import annotations

import time
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from gateway.chat.identity import check_id
from gateway.routes.reward_history import reward_history
from gateway.routes.rl import json_response
from gateway.routes.step_history import step_history
from gateway.settings import is_greedy
from gateway.store.lists import MAX_LIMIT, ListFilter
from gateway.store.reads import ORIGINS
from gateway.store.waits import read_within

router = APIRouter()

Limit = Query(50, ge=1, le=MAX_LIMIT, description="rows per page")
Cursor = Query(None, description="`next_cursor` of the previous page (pages go newest first)")
Split = Query(None, description="only this split")
MinReward = Query(None, description="reward at least this (groups: mean reward of their sessions)")
MaxReward = Query(None, description="reward at most this (groups: mean reward of their sessions)")
Since = Query(None, description="created at or after this time (unix seconds)")
Until = Query(None, description="created before this time (unix seconds)")


@router.get("/v1/sessions", summary="List sessions, newest first, paged and filtered")
async def list_sessions(
    request: Request,
    limit: int = Limit,
    cursor: str | None = Cursor,
    split: Literal["train", "val"] | None = Split,
    group_id: str | None = Query(None, description="only this group"),
    min_reward: float | None = MinReward,
    max_reward: float | None = MaxReward,
    since: float | None = Since,
    until: float | None = Until,
) -> Response:
    """`{"object": "list", "data": [session...], "has_more", "next_cursor"}`; each session
    without its calls (`GET /v1/sessions/{id}` has them) but with `step`, the adapter step
    that answered its first call."""
    store = request.app.state.services.store
    if group_id is not None:
        check_id(group_id, "group_id")
    f = ListFilter(
        limit=limit,
        cursor=cursor,
        split=split,
        group_id=group_id,
        min_reward=min_reward,
        max_reward=max_reward,
        since=since,
        until=until,
    )
    return json_response(await read_within(store, store.list_sessions, f))


@router.get("/v1/groups", summary="List groups, newest first, paged and filtered")
async def list_groups(
    request: Request,
    limit: int = Limit,
    cursor: str | None = Cursor,
    split: Literal["train", "val"] | None = Split,
    state: Literal["trained", "skipped", "failed", "pending"] | None = Query(
        None,
        description="trained, skipped, failed (set aside: the trainer's or a shadow judge's tries ran out) or "
        "pending (none of these yet: it may still train)",
    ),
    origin: Literal["harness", "live", "shadow"] | None = Query(
        None,
        description="how the group was formed: harness (the client's X-Group-Id), live (rewarded live "
        "sessions of one task key) or shadow (a live turn and its shadow samples)",
    ),
    min_reward: float | None = MinReward,
    max_reward: float | None = MaxReward,
    since: float | None = Since,
    until: float | None = Until,
) -> Response:
    """`{"object": "list", "data": [group...], "has_more", "next_cursor"}`; each group with
    `n_sessions`, `n_rewarded` and its sessions' `reward_mean`, `reward_min`, `reward_max`,
    and its `origin` and `task_key`."""
    store = request.app.state.services.store
    f = ListFilter(
        limit=limit,
        cursor=cursor,
        split=split,
        state=state,
        origin=origin,
        min_reward=min_reward,
        max_reward=max_reward,
        since=since,
        until=until,
    )
    return json_response(await read_within(store, store.list_groups, f))


@router.get("/v1/dashboard", summary="Serving state, calls per minute, reward curves and step metrics")
async def dashboard(request: Request) -> Response:
    """What the dashboard's first page shows, in one request: `model`, `engine`, `step`
    (serving now), `replicas` (each vLLM replica's state, load and step; null with one engine),
    `calls_per_minute` (last 60 minutes), `reward_curve` (per step and
    split: n, mean, std, min, max of the rollouts that step sampled), `steps` (each
    training step's metrics) and `live_traffic` (groups per origin, total and trained, the
    sessions a stale reward left untrained, and this gateway's `shadow_samples` counts), `trainer`
    (`serve --trainer auto`'s child as on /healthz; null without one)."""
    services = request.app.state.services
    trainer = getattr(request.app.state, "trainer", None)  # `serve --trainer auto`'s child, as on /healthz
    model = services.settings.model_name
    steps, counts, per_minute, curve = await read_within(services.store, _dashboard_reads, services.store, model)
    return json_response(
        {
            "model": model,
            "base_model": services.settings.base_model,
            "engine": services.engine.kind,
            "step": services.registry.current,
            "replicas": services.engine.replica_states(model, services.registry.current),
            "counts": counts,
            "live_traffic": {**live_traffic(counts), "shadow_samples": _shadow_counts(services)},
            "calls_per_minute": per_minute,
            "reward_curve": curve,
            "steps": [
                {"step": s["step"], "created_at": s["created_at"], "metrics": s["metrics"], "groups": s["groups"]}
                for s in steps
            ],
            "trainer": None if trainer is None else trainer.status(),
        }
    )


def _dashboard_reads(store, model: str) -> tuple[list[dict], dict, list[dict], list[dict]]:
    """The dashboard's store reads, run in a worker thread: a store that does not answer
    (PostgreSQL gone, until its pool gives up) must not hold up every other request."""
    steps = step_history(store, model)  # only the steps recorded since the last poll are read
    curve = reward_history(store, model)  # only the sessions written since the last poll are read
    return steps, store.counts(), store.calls_per_minute(time.time()), curve


def _shadow_counts(services) -> dict | None:
    """This gateway's shadow sampler since it started (gateway/shadow/sampler.py: the same as its
    `rlproxy_shadow_*` metrics): live calls shadowed, completed, dropped, failed, the tokens the
    shadows generated, the judge's calls and, per task key, the share of its calls dropped;
    None when shadow sampling is off."""
    sampler = services.extras.get("shadow")
    return None if sampler is None else sampler.summary()


def live_traffic(counts: dict[str, int]) -> dict:
    """`{"groups": {origin: {"total", "trained"}}, "stale_sessions"}` from the store's counts."""
    groups = {
        origin: {"total": counts.get(f"groups_{origin}", 0), "trained": counts.get(f"groups_{origin}_trained", 0)}
        for origin in ORIGINS
    }
    return {"groups": groups, "stale_sessions": counts.get("sessions_stale", 0)}


GREEDY_REASON = "greedy: sampled at temperature < 1e-5, never trained (context for later turns)"


def _greedy(call: dict) -> bool:
    """The trainer's rule (`trainer.retries.is_greedy_call`): the recorded temperature in
    force, else the request's, below `GREEDY_BELOW`."""
    temperature = (call.get("sampling") or {}).get("temperature")
    if temperature is None:
        temperature = (call.get("request") or {}).get("temperature")
    return (
        isinstance(temperature, (int, float))
        and not isinstance(temperature, bool)
        and 0 <= temperature
        and is_greedy(temperature)
    )


@router.get("/v1/sessions/{session_id}/tokens", summary="The session's completion tokens: text, logprob, trained")
async def session_tokens(session_id: str, request: Request) -> Response:
    """For each call: its completion tokens (choice 0) with the recorded logprob and, where
    the gateway's engine has a tokenizer, each token's text; and whether the call's tokens
    were trained on (its group was trained, the session was not discarded, the call
    succeeded and was not greedy: `trainer.data.call_turn`'s rule; only choice 0 of an `n>1`
    call trains). A greedy call (temperature below 1e-5) says so in `untrained_reason`: its
    tokens are context for the later turns, never trained. A shadow sample's session also
    says which session holds the live call it shadows (`shadow_of_session`, None if that call
    is not recorded)."""
    services = request.app.state.services
    session, shadowed, group = await read_within(
        services.store, _session_reads, services.store, check_id(session_id, "session_id")
    )
    trained_step = group.get("trained_step") if group else None
    tokenizer = getattr(services.engine, "tokenizer", None)
    calls = []
    for call in session["calls"]:
        ids = (call.get("completion_ids") or [[]])[0]
        logprobs = (call.get("behaviour_logprobs") or [None])[0] or [None] * len(ids)
        texts = _token_texts(tokenizer, ids)
        behaviour = _first_choice(call.get("behaviour_logprobs"), len(ids))
        greedy = _greedy(call)
        untrained = _untrained_reason(call, session, greedy)
        calls.append(
            {
                "call_id": call["id"],
                "step": call.get("step"),
                "status": call["status"],
                "prompt_tokens": len(call.get("prompt_ids") or []),
                "trained": bool(
                    trained_step is not None and not session["discarded"] and call["status"] == "ok" and ids
                )
                and untrained is None,
                "untrained_reason": untrained,
                "sampling": call.get("sampling"),
                "tokens": [
                    {
                        "id": t,
                        "text": texts[i] if texts else None,
                        "logprob": logprobs[i] if i < len(logprobs) else None,
                        "behaviour_logprob": behaviour[i] if behaviour else None,
                    }
                    for i, t in enumerate(ids)
                ],
            }
        )
    return json_response(
        {
            "session_id": session_id,
            "trained_step": trained_step,
            "shadow_of_session": shadowed["session_id"] if shadowed else None,
            "calls": calls,
        }
    )


def _untrained_reason(call: dict, session: dict, greedy: bool) -> str | None:
    """Why a call that succeeded is not trained although its group may be: it came after the
    group was claimed or trained, it was greedy, or its session left the group (no trainable
    sample, `trainer.data.build_batch`)."""
    if call["status"] != "ok":
        return None
    if call.get("untrainable"):
        return call["untrainable"]
    if greedy:
        return GREEDY_REASON
    return session.get("untrained_reason")


def _first_choice(values, n: int) -> list | None:
    """Choice 0's per-token values from a per-choice list (or a flat one), if they line up."""
    if not values:
        return None
    first = values[0] if isinstance(values[0], list) else values
    return first if len(first) == n else None


def _session_reads(store, session_id: str) -> tuple[dict, dict | None, dict | None]:
    """The session, the live call it shadows and its group (in a worker thread, as `_dashboard_reads`)."""
    session = store.get_session(session_id)
    shadowed = store.get_call(session["shadow_of"]) if session.get("shadow_of") else None
    group = store.get_group(session["group_id"]) if session.get("group_id") else None
    return session, shadowed, group


def _token_texts(tokenizer, ids: list[int]) -> list[str] | None:
    if tokenizer is None or not ids:
        return None
    try:
        return tokenizer.batch_decode([[t] for t in ids])
    except Exception:  # noqa: BLE001 - a tokenizer that cannot decode leaves ids only
        return None
