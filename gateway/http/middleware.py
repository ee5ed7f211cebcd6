"""Cross-cutting concerns as small ASGI middleware: request ids and bearer keys."""

from __future__ import annotations

import hmac
import itertools
import os
import secrets

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = b"x-request-id"


class _RequestIds:
    """`req_` + a random per-process prefix + a counter: as unique as a uuid4 (the ids are the
    calls' primary keys, across restarts too) without a getrandom syscall per request, which
    gives up the GIL on the hot path. A forked child makes its own prefix."""

    def __init__(self) -> None:
        self._pid = -1

    def __call__(self) -> str:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._prefix = "req_" + secrets.token_hex(8)
            self._counter = itertools.count()
        return f"{self._prefix}{next(self._counter):012x}"


new_request_id = _RequestIds()


class RequestIdMiddleware:
    """Gives every request a fresh id in `scope["state"]["request_id"]` and returns it as the
    X-Request-Id response header. A client's own X-Request-Id is not adopted: the id is the
    call row's primary key, and a client that reuses one (a retry) must not lose its call."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        header = (REQUEST_ID_HEADER, request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        await self.app(scope, receive, send_with_id)


class BearerAuthMiddleware:
    """Requires `Authorization: Bearer <key>` (or `x-api-key: <key>`, as Anthropic's clients
    send it) on every route but the open ones.

    The key is compared in constant time and never logged or echoed."""

    def __init__(
        self, app: ASGIApp, api_key: str, open_paths: tuple[str, ...] = ("/healthz",), admin_key: str | None = None
    ):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        # The admin's key passes here too; the admin routes then tell the two apart (gateway/routes/promotion.py).
        self._admin = f"Bearer {admin_key}".encode() if admin_key else None
        self._expected_bare = api_key.encode()
        self._open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open_paths:
            await self.app(scope, receive, send)
            return
        supplied = x_api_key = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                supplied = value
            elif name == b"x-api-key":
                x_api_key = value
        # Both compared every time, in constant time: which one matched is not a timing signal.
        bearer_ok = hmac.compare_digest(supplied, self._expected)
        x_api_key_ok = hmac.compare_digest(x_api_key, self._expected_bare)
        admin_ok = self._admin is not None and hmac.compare_digest(supplied, self._admin)
        if bearer_ok or (x_api_key and x_api_key_ok) or admin_ok:
            await self.app(scope, receive, send)
            return
        message = (
            "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>' (the key rlproxy was "
            "started with)"
            if not supplied and not x_api_key
            else "invalid API key: the key does not match the one rlproxy was started with"
        )
        path = scope["path"]
        if path.endswith("/v1/messages"):  # Anthropic's clients read Anthropic's error shape
            body = orjson.dumps({"type": "error", "error": {"type": "authentication_error", "message": message}})
        else:
            body = orjson.dumps(
                {
                    "error": {
                        "message": message,
                        "type": "authentication_error",
                        "param": None,
                        "code": "invalid_api_key",
                    }
                }
            )
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
            }
        )
        await send({"type": "http.response.body", "body": body})


class HeadMiddleware:
    """HEAD answered wherever GET is: the GET route runs and its body is dropped (RFC 9110
    9.3.2: the same status and headers, no content). FastAPI's routes answer only the methods
    they name, so `curl -I /healthz`, load balancers' and uptime checks' HEAD got a 405. The
    middleware in front of this one (the bearer key, the dashboard's cookie, Host checks) sees
    HEAD, so it passes exactly where GET would."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        finished = False

        async def send_headers_only(message: Message) -> None:
            nonlocal finished
            if message["type"] != "http.response.body":
                await send(message)
            elif not finished and not message.get("more_body", False):
                finished = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})

        await self.app({**scope, "method": "GET"}, receive, send_headers_only)
