"""`POST /v1/groups/{id}/ruler`: judge a group with RULER and answer with the scores.

Synchronous: the answer comes once the judge has scored the group (a reasoning
judge can take minutes; clients should allow for it). A client that hangs up does
not cancel the judgement; `GET /v1/groups/{id}` shows `ruler_status` (running,
scored, failed) and `ruler_error` either way.

Only the judges the operator named may be called (`--judge-model`, `--judge-api-base`,
the shadow judge, `self`); another is a 400 before anything is sent
(`gateway.ruler.judges.judge_for`).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.chat.identity import check_id
from gateway.protocols.chat import RulerRequest
from gateway.routes.rl import json_response, parse
from gateway.ruler.scoring import RulerService

router = APIRouter()


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # stored in the group already; keeps asyncio from warning about it


@router.post("/v1/groups/{group_id}/ruler")
async def ruler(group_id: str, request: Request) -> Response:
    services = request.app.state.services
    body = await parse(request, RulerRequest)
    service: RulerService = services.extras.setdefault("ruler", RulerService(services))
    task = service.start(check_id(group_id, "group_id"), body.judge_model, body.rubric, body.judge_api_base)
    task.add_done_callback(_retrieve)
    scores = await asyncio.shield(task)
    return json_response(
        {
            "group_id": group_id,
            "judge_model": body.judge_model,
            "status": "scored",
            "scores": [
                {"session_id": s["trajectory_id"], "score": s["score"], "explanation": s["explanation"]} for s in scores
            ],
        }
    )
