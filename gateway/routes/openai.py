"""OpenAI-compatible routes: chat completions and models."""

from __future__ import annotations

import time

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError
from sse_starlette import EventSourceResponse

from gateway.chat import identify
from gateway.errors import InvalidRequest
from gateway.protocol import ChatCompletionRequest

router = APIRouter()


def _headers(request_id: str, session_id: str, step: int | None) -> dict[str, str]:
    headers = {"X-Session-Id": session_id}  # X-Request-Id comes from the middleware
    if step is not None:
        headers["X-Model-Step"] = str(step)
    return headers


def validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body",))
        message = err.get("msg", "invalid").removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


async def read_json(request: Request) -> dict:
    raw_bytes = await request.body()
    try:
        raw = orjson.loads(raw_bytes)
    except orjson.JSONDecodeError as exc:
        hint = ""
        if any(token in raw_bytes for token in (b"NaN", b"Infinity")) or "infinity" in str(exc):
            hint = " (JSON has no NaN or Infinity: numbers such as a reward must be finite)"
        raise InvalidRequest(f"the request body is not valid JSON: {exc}{hint}") from None
    if not isinstance(raw, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return raw


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    services = request.app.state.services
    raw = await read_json(request)
    try:
        chat_request = ChatCompletionRequest.model_validate(raw)
    except ValidationError as exc:
        raise InvalidRequest(validation_message(exc)) from None
    identity = identify(request.headers, raw)
    request_id = request.scope["state"]["request_id"]
    if chat_request.stream:
        events, target = await services.chat.open_stream(chat_request, raw, identity, request_id)
        headers = _headers(request_id, identity.session_id, target.step)
        return EventSourceResponse(
            _as_events(events),
            headers=headers,
            ping=15,
            sep="\n",
        )
    response, target = await services.chat.complete(chat_request, raw, identity, request_id)
    return Response(orjson.dumps(response), media_type="application/json",
                    headers=_headers(request_id, identity.session_id, target.step))


async def _as_events(payloads):
    async for payload in payloads:
        yield {"data": payload.decode()}


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    services = request.app.state.services
    created = int(time.time())
    names = [*services.registry.served_names(), *await services.engine.list_models()]
    seen, data = set(), []
    for name in names:
        if name in seen:
            continue
        seen.add(name)
        data.append({"id": name, "object": "model", "created": created, "owned_by": "rlproxy"})
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")
