"""rlproxy's own routes: rewards, sessions, groups, training, health and metrics."""

from __future__ import annotations

import hmac
from typing import TypeVar

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from gateway.chat.identity import check_id
from gateway.errors import Forbidden, StoreUnavailable
from gateway.http.errors import invalid_body
from gateway.promotion.serving import loading
from gateway.protocols.chat import DiscardRequest, GroupCloseRequest, RewardRequest, TriggerRequest
from gateway.routes.openai import read_json
from gateway.settings import Settings
from gateway.store import LiveRule, Store
from gateway.store.steps import paused_reason
from gateway.store.waits import read_within, recheck

router = APIRouter()
Body = TypeVar("Body", bound=BaseModel)


def json_response(data: object, status_code: int = 200) -> Response:
    return Response(orjson.dumps(data, default=str), status_code=status_code, media_type="application/json")


async def parse(request: Request, model: type[Body], *, allow_empty: bool = False) -> Body:
    if allow_empty and not await request.body():
        return model()
    raw = await read_json(request)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise invalid_body(exc.errors(), raw) from None


def require_admin(request: Request) -> None:
    """403 unless the caller sent the admin key (where one is set)."""
    admin_key = request.app.state.services.settings.admin_key
    if admin_key is None:
        return
    supplied = request.headers.get("authorization", "").encode()
    if not hmac.compare_digest(supplied, f"Bearer {admin_key.get_secret_value()}".encode()):
        raise Forbidden(
            "this is an admin action (promote, reject, resume, trigger): send the gateway's --admin-key as "
            "'Authorization: Bearer <admin key>'; an agent's --api-key may not do it",
            code="admin_key_required",
        )


@router.post("/v1/sessions/{session_id}/reward")
async def post_reward(session_id: str, request: Request) -> Response:
    services = request.app.state.services
    body = await parse(request, RewardRequest)
    settings = services.settings
    live = LiveRule(settings.live_group_size, settings.live_max_staleness) if settings.live_group_size else None
    result = await services.store.set_reward(check_id(session_id, "session_id"), body.reward, body.metrics, live)
    if services.tracer is not None:
        services.tracer.on_reward(session_id, body.reward, body.metrics)
    return json_response(result)


@router.post("/v1/sessions/{session_id}/discard")
async def discard_session(session_id: str, request: Request) -> Response:
    """Leave a failed rollout out of its group (no reward needed, never trained); calls are kept."""
    store = request.app.state.services.store
    body = await parse(request, DiscardRequest, allow_empty=True)
    return json_response(await store.discard_session(check_id(session_id, "session_id"), body.reason))


@router.get("/v1/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> Response:
    store = request.app.state.services.store
    return json_response(await read_within(store, store.get_session, check_id(session_id, "session_id")))


@router.post("/v1/groups/{group_id}/close")
async def close_group(group_id: str, request: Request) -> Response:
    services = request.app.state.services
    body = await parse(request, GroupCloseRequest, allow_empty=True)
    await services.store.close_group(check_id(group_id, "group_id"), body.expected_sessions)
    return json_response(await read_within(services.store, services.store.get_group, group_id))


@router.get("/v1/groups/{group_id}")
async def get_group(group_id: str, request: Request) -> Response:
    store = request.app.state.services.store
    return json_response(await read_within(store, store.get_group, check_id(group_id, "group_id")))


@router.get("/v1/training/steps")
async def training_steps(request: Request) -> Response:
    services = request.app.state.services
    steps = await read_within(services.store, services.store.steps, services.settings.model_name)
    return json_response({"object": "list", "data": steps})


@router.post("/v1/training/trigger")
async def training_trigger(request: Request) -> Response:
    require_admin(request)
    services = request.app.state.services
    body = await parse(request, TriggerRequest, allow_empty=True)
    model = body.model or services.settings.model_name
    trigger_id = await services.store.request_trigger(model)
    return json_response({"model": model, "trigger_id": trigger_id, "status": "requested"}, status_code=202)


@router.get("/healthz")
async def healthz(request: Request) -> Response:
    """200 `ok`, or 503 `degraded` with the reason while the store cannot record or the
    engine cannot serve, or 503 `loading` while NAME waits for its `--init-from` step 0.
    While the store is degraded each look probes it with a write, so it turns `ok` once the
    cause is gone."""
    services = request.app.state.services
    store = services.store
    try:  # a write hanging on the database, or a probe it does not answer in time: degraded
        await recheck(store)
    except StoreUnavailable:
        pass
    body = {
        "status": "ok",
        "engine": services.engine.kind,
        "model": services.settings.model_name,
        "step": services.registry.current,
    }
    if services.settings.promote != "always":  # the promotion's state: serving, undecided, paused
        try:
            body.update(await read_within(store, promotion_state, store, services.settings))
            serving = body["serving_step"]
            failed = services.registry.load_errors.get(serving)
            if failed is not None and serving != services.registry.current:  # its files gone by hand, say
                body["serving_load_error"] = (  # else a bare `ok` hid that NAME is not the store's serving step
                    f"step {serving} does not load ({failed}); '{services.settings.model_name}' answers with step "
                    f"{services.registry.current} meanwhile, retrying every poll"
                )
            failed = services.registry.load_errors.get(body["candidate_step"])
            if failed is not None:  # the candidate's share stays on the incumbent; --canary-max-wait rejects it
                body["candidate_load_error"] = failed
            canary = services.registry.canary
            if canary is not None and canary.progress is not None and canary.progress["step"] == body["candidate_step"]:
                body["canary"] = canary.progress  # its sessions so far (HTTP rewards only), the next look
            if canary is not None and canary.refused is not None and canary.refused["step"] == body["serving_step"]:
                body["rollback_refused"] = canary.refused  # its watch found a drop, but what it replaced is gone
        except StoreUnavailable:  # noted in store.health: the answer below is `degraded` with the cause
            pass
    if services.registry.policy_mismatch is not None:  # the trainer records steps under another --promote
        body["promotion_mismatch"] = services.registry.policy_mismatch
    replicas = services.engine.replica_states(services.settings.model_name, services.registry.current)
    if replicas is not None:
        body["replicas"] = replicas
    trainer = getattr(request.app.state, "trainer", None)  # `serve --trainer auto`'s child; serving goes on without it
    if trainer is not None:
        body["trainer"] = trainer.status()
    if services.engine.health() is not None:
        await services.engine.probe()  # back now? (as the store is probed while degraded)
    engine_down = services.engine.health()
    waiting = loading(services.registry)
    if not store.health.degraded and engine_down is None and waiting is None:
        return json_response(body)
    if store.health.degraded:
        report = store.health.report()
        body.update(status="degraded", reason=report["reason"], store=report)
    elif engine_down is not None:
        body.update(status="degraded", reason=f"the {services.engine.kind} engine cannot serve: {engine_down}")
    else:  # with why step 0 will never come, where the trainer failed (promotion.serving.loading)
        body.update(status="loading", reason=waiting)
    return json_response(body, status_code=503)


def promotion_state(store: Store, settings: Settings) -> dict:
    """`/healthz`'s promotion fields: the store's serving and candidate steps, and why training is
    paused (`--max-rejections` in a row, until POST /v1/training/resume); serving goes on meanwhile."""
    model = settings.model_name
    rejected = store.rejections_in_a_row(model)
    paused = paused_reason(rejected) if rejected >= settings.max_rejections else None
    candidate = store.undecided_step(model)
    return {"serving_step": store.serving_step(model), "candidate_step": candidate, "training": paused}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    services = request.app.state.services
    model = services.settings.model_name
    try:  # bounded: a store that does not answer must hold up neither the event loop nor the scrape
        steps = await read_within(
            services.store, lambda: (services.store.serving_step(model), services.store.undecided_step(model))
        )
    except StoreUnavailable:  # the scrape still answers: rlproxy_store_degraded says why the steps are old
        steps = None
    body, content_type = services.metrics.render(services, steps, getattr(request.app.state, "trainer", None))
    return Response(body, media_type=content_type)
