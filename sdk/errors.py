"""Typed errors the SDK raises.

The gateway answers errors in OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}`; `raise_for_response` turns such an answer into the exception class for
its status, carrying the gateway's message so it reads the same on both sides.
"""

from __future__ import annotations

from typing import Any

import httpx


class RLProxySDKError(Exception):
    """Root of every error the SDK raises on purpose."""


class APIConnectionError(RLProxySDKError):
    """The gateway could not be reached (refused, DNS, timeout); there is no response."""


def connection_error(exc: httpx.HTTPError, api_base: str, method: str, path: str, timeout: float) -> APIConnectionError:
    """What went wrong on the way: a gateway that was reached but did not answer in time is not
    one that could not be reached, and what it was asked may have taken effect."""
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
        return APIConnectionError(
            f"{method} {api_base}{path}: no answer within {timeout:g} s; the request may still have taken effect "
            "(get_session / get_group show what was recorded). Give a longer timeout= if the gateway is busy"
        )
    return APIConnectionError(f"could not reach the gateway at {api_base} ({method} {path}): {exc}")


class RLProxyAPIError(RLProxySDKError):
    """The gateway answered with an error status."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        body: Any = None,
    ):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code
        self.body = body

    def __str__(self) -> str:
        return f"{self.status_code} {self.type or 'error'}: {self.message}"


class BadRequestError(RLProxyAPIError):
    """400: the request is malformed; the message says what to fix."""


class AuthenticationError(RLProxyAPIError):
    """401: missing or wrong API key."""


class PermissionDeniedError(RLProxyAPIError):
    """403."""


class NotFoundError(RLProxyAPIError):
    """404: no such session, group or route."""


class ConflictError(RLProxyAPIError):
    """409: the request clashes with the current state (e.g. a judgement already running)."""


class UnprocessableEntityError(RLProxyAPIError):
    """422."""


class ServerError(RLProxyAPIError):
    """5xx: the gateway, its engine or its judge failed."""


class RolloutsFailed(RLProxySDKError):
    """More rollouts of `group.run` raised than `max_exceptions` allows.

    `result` holds what happened so far; the last rollout exception is the `__cause__`.
    """

    def __init__(self, message: str, result: Any):
        super().__init__(message)
        self.result = result


_BY_STATUS: dict[int, type[RLProxyAPIError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    422: UnprocessableEntityError,
}


def error_for(status_code: int, body: Any, fallback_text: str = "") -> RLProxyAPIError:
    """The typed error for an error response (pure: status and decoded body in, exception out)."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        message = str(error.get("message") or fallback_text or f"HTTP {status_code}")
        kind, param, code = error.get("type"), error.get("param"), error.get("code")
    else:
        message, kind, param, code = fallback_text or f"HTTP {status_code}", None, None, None
    cls = _BY_STATUS.get(status_code) or (ServerError if status_code >= 500 else RLProxyAPIError)
    return cls(message, status_code=status_code, type=kind, param=param, code=code, body=body)


def raise_for_response(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        body = response.json()
    except ValueError:
        body = None
    raise error_for(response.status_code, body, response.text[:500])


def json_body(response: httpx.Response, api_base: str) -> Any:
    """A success's JSON, or the typed error for a failure. A success that is not JSON (a login
    proxy's HTML page, another server at that URL) is an error too, naming the URL to check:
    the bare JSONDecodeError said nothing of where the answer came from."""
    raise_for_response(response)
    try:
        return response.json()
    except ValueError:
        kind = response.headers.get("content-type") or "no Content-Type"
        raise RLProxyAPIError(
            f"{response.request.method} {response.request.url} answered {response.status_code} with {kind}, "
            f"not JSON: check that {api_base} (base_url, or $RLPROXY_URL) is the URL of an rlproxy gateway",
            status_code=response.status_code,
            type="invalid_response",
            body=response.text[:500],
        ) from None
