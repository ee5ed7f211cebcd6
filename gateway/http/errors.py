"""Errors at the edge: every exception a route lets out becomes one response, in the shape of
the route's protocol (OpenAI's error JSON, Anthropic's on /v1/messages), with the status its
class names. Code inside raises `RLProxyError` subclasses and never builds an error response."""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from gateway.errors import InvalidRequest, RLProxyError
from gateway.protocols.messages import wire as messages_wire

log = logging.getLogger("rlproxy")


CALL_PATHS = frozenset(("/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/completions"))
"""The routes a model call comes in by (every protocol): their errors are counted on /metrics."""


def is_anthropic_path(path: str) -> bool:
    return path.endswith("/v1/messages") or path.startswith("/v1/messages/")


def error_response(path: str, exc: RLProxyError) -> Response:
    """`exc` in the shape the route's protocol documents: Anthropic's for /v1/messages,
    OpenAI's everywhere else."""
    # 413: the rest of the body is still coming; close rather than read it all.
    headers = dict(exc.headers)
    if exc.status_code == 413:
        headers["Connection"] = "close"
    if is_anthropic_path(path):
        body = messages_wire.error_body(exc.status_code, exc.message)
    else:
        body = exc.to_openai()
    return Response(orjson.dumps(body), status_code=exc.status_code, headers=headers, media_type="application/json")


def _validation_text(errors: list, body: Any = None) -> str:
    """Pydantic's validation errors as one sentence: where (the client's field, as in `param`,
    when the body is at hand), and what is wrong."""
    parts: list[str] = []
    for err in errors[:5]:
        loc = tuple(err.get("loc", ()))
        where = _param_of(loc, err.get("type") == "missing", body) if body is not None else None
        where = where or ".".join(str(p) for p in loc if p != "body")
        message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        part = f"{where}: {message}" if where else message
        if part not in parts:
            parts.append(part)
    return "; ".join(parts) or "the request body is not valid"


def _param_of(loc: tuple, missing: bool, body: Any) -> str | None:
    """The field an error is about, in OpenAI's form (`messages[0].content`), walked along the
    body the client sent: pydantic's location also names union members (`content.str`) and
    validator wrappers, which are no field of the client's; a missing field is named too."""
    place: list[str | int] = []
    value = body
    for key in loc:
        if isinstance(value, dict) and isinstance(key, str):
            if key not in value and not missing:
                break
            place.append(key)
            value = value.get(key)
        elif isinstance(value, list) and isinstance(key, int) and 0 <= key < len(value):
            place.append(key)
            value = value[key]
        else:
            break
    text = "".join(f"[{key}]" if isinstance(key, int) else f".{key}" for key in place).lstrip(".")
    return text or None


def invalid_body(errors: list, body: Any) -> InvalidRequest:
    """A 400 for a body that failed validation, its `param` the first error's field."""
    first = errors[0] if errors else {}
    return InvalidRequest(
        _validation_text(errors, body),
        param=_param_of(tuple(first.get("loc", ())), first.get("type") == "missing", body),
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RLProxyError)
    async def _rlproxy_error(request: Request, exc: RLProxyError) -> Response:
        if request.method == "POST" and request.url.path in CALL_PATHS:
            request.app.state.services.metrics.observe_refused(exc)
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        loc = tuple(errors[0].get("loc", ())) if errors else ()
        if loc[:1] == ("body",):
            param = _param_of(loc[1:], errors[0].get("type") == "missing", exc.body)
        else:  # a query or path parameter: its name
            param = str(loc[1]) if len(loc) > 1 else None
        return error_response(request.url.path, InvalidRequest(_validation_text(errors), param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        error = RLProxyError(str(exc.detail))
        error.status_code = exc.status_code
        error.error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        if exc.status_code == 404:
            error.message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            error.message = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(request.url.path, error)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        error = RLProxyError(f"internal error: {type(exc).__name__}; see the gateway log")
        if request.method == "POST" and request.url.path in CALL_PATHS:
            request.app.state.services.metrics.observe_refused(error)
        return error_response(request.url.path, error)
