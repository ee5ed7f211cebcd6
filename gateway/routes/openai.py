"""OpenAI-compatible routes: chat completions and models.

`POST /v1/chat/completions` is the gateway's hot path, so it is a bare ASGI
endpoint (`chat_completions`): no dependency solving, no Request object, SSE
framed once and handed to sse-starlette. `gateway.app` also sends it straight here, around FastAPI's
middleware stack; the route below is what the route table (405s) sees.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError
from sse_starlette import EventSourceResponse
from starlette.types import Receive, Scope, Send

from gateway.chat.identity import identify
from gateway.errors import ClientGone, InvalidRequest, NotFound, RLProxyError
from gateway.http.errors import invalid_body
from gateway.protocols.chat import ChatCompletionRequest
from gateway.routes.client_watch import ClientWatch

log = logging.getLogger("rlproxy.routes")
router = APIRouter()

SSE_PING_SECONDS = 15.0  # a comment line on a quiet stream, so proxies in between do not time it out
_IDENTITY_HEADERS = frozenset((b"x-session-id", b"x-group-id", b"x-task-id", b"x-split", b"x-request-id"))
_JSON = (b"content-type", b"application/json")


def parse_json_body(raw_bytes: bytes) -> dict:
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


async def read_json(request: Request) -> dict:
    return parse_json_body(await request.body())


def _response_headers_dict(session_id: str, step: int | None) -> dict[str, str]:
    headers = {"X-Session-Id": session_id}
    if step is not None:
        headers["X-Model-Step"] = str(step)
    return headers


def _response_headers(session_id: str, step: int | None) -> list[tuple[bytes, bytes]]:
    headers = [(b"x-session-id", session_id.encode())]  # X-Request-Id comes from the middleware
    if step is not None:
        headers.append((b"x-model-step", str(step).encode()))
    return headers


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone("the client disconnected before its request was read")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


class ChatCompletionsEndpoint:
    """ASGI endpoint for POST /v1/chat/completions; errors become OpenAI-shaped JSON.

    A class, not a function, so Starlette's router mounts it as ASGI as it is."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked_send(message: dict) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await _chat_completions(scope, receive, tracked_send)
        except ClientGone:
            pass
        except RLProxyError as exc:
            scope["app"].state.services.metrics.observe_refused(exc)
            if not started:
                # 413: the rest of the body is still coming; close rather than read it all.
                extra = [(name.lower().encode(), value.encode()) for name, value in exc.headers]
                if exc.status_code == 413:
                    extra.append((b"connection", b"close"))
                await _send_json(send, exc.status_code, exc.to_openai(), extra)
        except Exception:
            log.exception("unexpected error on POST /v1/chat/completions")
            scope["app"].state.services.metrics.observe_refused(RLProxyError("internal error"))
            if not started:
                error = RLProxyError("internal error; see the gateway log")
                await _send_json(send, error.status_code, error.to_openai())


chat_completions = ChatCompletionsEndpoint()


async def _send_json(send: Send, status: int, data: object, headers: list | None = None) -> None:
    body = orjson.dumps(data)
    # With its length given, the body goes out as it is rather than chunked.
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [_JSON, (b"content-length", b"%d" % len(body)), *(headers or [])],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _chat_completions(scope: Scope, receive: Receive, send: Send) -> None:
    services = scope["app"].state.services
    raw = parse_json_body(await _read_body(receive))
    try:
        chat_request = ChatCompletionRequest.model_validate(raw)
    except ValidationError as exc:
        raise invalid_body(exc.errors(), raw) from None
    headers = {
        name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"] if name in _IDENTITY_HEADERS
    }
    identity = identify(headers, raw)
    request_id = scope["state"]["request_id"]
    if not chat_request.stream:
        watch = ClientWatch(receive)
        response, target = await watch.run(
            services.chat.complete(chat_request, raw, identity, request_id, client_left=watch.left)
        )
        await _send_json(send, 200, response, _response_headers(identity.session_id, target.step))
        return
    events, target = await services.chat.open_stream(chat_request, raw, identity, request_id)
    response = EventSourceResponse(
        _sse_frames(events),
        headers=_response_headers_dict(identity.session_id, target.step),
        ping=SSE_PING_SECONDS,
        sep="\n",
    )
    try:
        await response(scope, receive, send)
    finally:
        await events.aclose()  # records a stream the client left early


async def _sse_frames(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Each payload framed as OpenAI does (`data: ...` and a blank line); bytes pass through
    sse-starlette as they are, so a chunk is encoded once."""
    async for payload in events:
        yield b"data: " + payload + b"\n\n"


router.add_route("/v1/chat/completions", chat_completions, methods=["POST"], include_in_schema=False)


async def _models(services) -> list[dict]:
    created = int(time.time())
    names = [*services.registry.served_names(), *await services.engine.list_models()]
    seen, data = set(), []
    for name in names:
        if name in seen:
            continue
        seen.add(name)
        data.append({"id": name, "object": "model", "created": created, "owned_by": "rlproxy"})
    return data


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    data = await _models(request.app.state.services)
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> Response:
    """One model of the list (OpenAI's `client.models.retrieve`); names may hold '/'."""
    data = await _models(request.app.state.services)
    for entry in data:
        if entry["id"] == model:
            return Response(orjson.dumps(entry), media_type="application/json")
    raise NotFound(
        f"model '{model[:100]}' not found; this gateway serves {', '.join(e['id'] for e in data)}",
        param="model",
        code="model_not_found",
    )
