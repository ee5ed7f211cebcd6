"""Typed errors the SDK raises.

The gateway answers errors in OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}`; `raise_for_response` turns such an answer into the exception class for
its status, carrying the gateway's message so it reads the same on both sides.
"""

from __future__ import annotations

import re
import time
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx


def shown_url(url: str) -> str:
    """`url` as messages and reprs show it: the user and password of `https://user:pass@host/v1` (a
    reverse proxy's basic auth) starred out, since errors end up in logs and tracebacks."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


class RLProxySDKError(Exception):
    """Root of every error the SDK raises on purpose."""


class APIConnectionError(RLProxySDKError):
    """The gateway could not be reached (refused, DNS, timeout); there is no response."""

    def __init__(self, message: str, *, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable  # the network failed on the way: worth one more try, unlike a bad URL


class APITimeoutError(APIConnectionError):
    """The gateway was reached but did not answer within `timeout=`: the request may have taken effect."""


# The network failing on the way (refused, reset, a connection dropped before its answer), as
# opposed to the request itself being one no server can take (a URL without http://).
_NETWORK = (httpx.NetworkError, httpx.ConnectTimeout, httpx.RemoteProtocolError)


def connection_error(
    exc: httpx.HTTPError, api_base: str, method: str, path: str, timeout: float, tries: int = 1
) -> APIConnectionError:
    """What went wrong on the way: a gateway that was reached but did not answer in time is not
    one that could not be reached, and what it was asked may have taken effect."""
    if isinstance(exc, httpx.PoolTimeout):  # it never left: it was the "may have taken effect" timeout
        return APIConnectionError(
            f"{method} {api_base}{path}: no connection of the client's pool came free within {timeout:g} s, so it "
            "was not sent; more requests at once than its pool holds (100 by default) wait: lower concurrency= "
            "or pass http_client= with larger httpx.Limits"
        )
    if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
        return APITimeoutError(
            f"{method} {api_base}{path}: no answer within {timeout:g} s; the request may still have taken effect "
            "(get_session / get_group show what was recorded). Give a longer timeout= if the gateway is busy"
        )
    tried = f", {tries} tries" if tries > 1 else ""
    return APIConnectionError(
        f"could not reach the gateway at {api_base} ({method} {path}{tried}): {exc}",
        retryable=isinstance(exc, _NETWORK),
    )


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
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code
        self.body = body
        self.retry_after = retry_after  # seconds, from the answer's Retry-After (a 429's, a 503's), if it had one

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


class RequestTooLargeError(RLProxyAPIError):
    """413: the body is over the gateway's `--max-body-mb`."""


class UnprocessableEntityError(RLProxyAPIError):
    """422."""


class RateLimitError(RLProxyAPIError):
    """429: too many requests; `retry_after` says how long to wait, where the answer said."""


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
    413: RequestTooLargeError,
    422: UnprocessableEntityError,
    429: RateLimitError,
}


def retry_after_seconds(value: str | None, now: float) -> float | None:
    """A Retry-After header as seconds from `now`: HTTP allows a number of seconds or a date.
    Anything else is no answer (None), never an error of its own."""
    if value is None:
        return None
    value = value.strip()
    if re.fullmatch(r"[0-9]+", value):
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:  # HTTP dates are GMT
        return None
    return max(0.0, when.timestamp() - now)


def error_for(
    status_code: int, body: Any, fallback_text: str = "", retry_after: float | None = None
) -> RLProxyAPIError:
    """The typed error for an error response (pure: status and decoded body in, exception out)."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):  # OpenAI's shape, and Anthropic's ({"type": "error", "error": {...}})
        message = str(error.get("message") or fallback_text or f"HTTP {status_code}")
        kind, param, code = error.get("type"), error.get("param"), error.get("code")
    else:
        # What a proxy in front of the gateway may answer: {"error": "..."} or FastAPI's {"detail": "..."}
        said = error if isinstance(error, str) else body.get("detail") if isinstance(body, dict) else None
        message = said if isinstance(said, str) and said else fallback_text or f"HTTP {status_code}"
        kind, param, code = None, None, None
    cls = _BY_STATUS.get(status_code) or (ServerError if status_code >= 500 else RLProxyAPIError)
    return cls(message, status_code=status_code, type=kind, param=param, code=code, body=body, retry_after=retry_after)


def raise_for_response(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        body = response.json()
    except ValueError:
        body = None
    retry_after = retry_after_seconds(response.headers.get("retry-after"), time.time())
    raise error_for(response.status_code, body, response.text[:500], retry_after)


def json_body(response: httpx.Response, api_base: str, path: str) -> Any:
    """A success's JSON, or the typed error for a failure. A success that is not JSON (a login
    proxy's HTML page, another server at that URL) is an error too, naming the URL to check
    (`api_base` as `shown_url` shows it): the bare JSONDecodeError said nothing of where the
    answer came from."""
    raise_for_response(response)
    try:
        return response.json()
    except ValueError:
        kind = response.headers.get("content-type") or "no Content-Type"
        raise RLProxyAPIError(
            f"{response.request.method} {api_base}{path} answered {response.status_code} with {kind}, "
            f"not JSON: check that {api_base} (base_url, or $RLPROXY_URL) is the URL of an rlproxy gateway",
            status_code=response.status_code,
            type="invalid_response",
            body=response.text[:500],
        ) from None
