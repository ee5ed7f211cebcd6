"""The admin's training routes: decide a candidate step, resume paused training.

Promote, reject, resume and trigger are admin actions. With `--admin-key` set they need it
(`Authorization: Bearer <admin key>`; an agent's `--api-key` gets 403); without it, the API key
lets a caller do everything, as before. A decision is one conditional UPDATE of the step row
(`gateway.store.steps`): of two racing decisions, or two replicas, one lands, the other gets 409.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.errors import NotFound
from gateway.protocols.chat import StepDecisionRequest
from gateway.routes.rl import json_response, parse, require_admin

router = APIRouter()
MAX_STEP = 2**63 - 1  # the largest integer SQLite and Postgres (BIGINT) store
log = logging.getLogger("rlproxy.promotion")


async def _decide(request: Request, step: int, to_state: str) -> Response:
    require_admin(request)
    services = request.app.state.services
    body = await parse(request, StepDecisionRequest)
    if body.model != services.settings.model_name:
        raise NotFound(
            f"model '{body.model}' is not trained here; this gateway trains '{services.settings.model_name}'",
            param="model",
            code="model_not_found",
        )
    if not 0 <= step <= MAX_STEP:  # past what the store's integers hold: no such step, not an overflow (500)
        raise NotFound(f"model '{body.model}' has no step {step}", param="step")
    decision = {"by": "api", "reason": body.reason}
    result = await asyncio.to_thread(services.store.decide_step, body.model, step, to_state, decision)
    log.info("step %d of %s %s through the API: %s", step, body.model, to_state, body.reason or "no reason given")
    await services.registry.refresh()  # NAME follows the serving step now, not at the next poll
    return json_response(result)


@router.post("/v1/training/steps/{step}/promote")
async def promote_step(step: int, request: Request) -> Response:
    """Serve candidate step `step` as NAME (the incumbent is superseded); the trainer goes on from it."""
    return await _decide(request, step, "promoted")


@router.post("/v1/training/steps/{step}/reject")
async def reject_step(step: int, request: Request) -> Response:
    """Turn candidate step `step` down: NAME keeps the incumbent, the trainer goes on from it."""
    return await _decide(request, step, "rejected")


@router.post("/v1/training/resume")
async def resume_training(request: Request) -> Response:
    """Clear the rejections in a row that paused training (`--max-rejections`)."""
    require_admin(request)
    services = request.app.state.services
    model = services.settings.model_name
    cleared = await asyncio.to_thread(services.store.resume_training, model)
    log.info("training of %s resumed through the API (%d rejection(s) cleared)", model, cleared)
    return json_response({"model": model, "status": "resumed", "cleared": cleared})
