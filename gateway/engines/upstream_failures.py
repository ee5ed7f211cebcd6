"""An OpenAI-compatible upstream's failures as the gateway's errors (`gateway.engines.openai`).

None holds a configured secret: an upstream may echo the Authorization header it got.
"""

from __future__ import annotations

import re

import aiohttp
import orjson

from gateway.engines.base import logged_body
from gateway.engines.http1 import ConnectError
from gateway.errors import RLProxyError, UpstreamError, UpstreamTimeout
from gateway.redact import redact

# Retry-After as HTTP defines it, seconds or a date: only that is passed on to the client.
_RETRY_AFTER = re.compile(r"[0-9]{1,10}|[A-Za-z]{3}, [0-9]{2} [A-Za-z]{3} [0-9]{4} [0-9:]{8} GMT")


class UpstreamRejected(RLProxyError):
    """The upstream refused the request with a 4xx the client can act on; status and type pass through."""

    def __init__(self, status: int, message: str, error_type: str | None, param: str | None, code: str | None):
        super().__init__(message, param=param, code=code)
        self.status_code = status
        self.error_type = error_type or "invalid_request_error"


class UpstreamFailures:
    """The upstream's failures as the gateway's errors, none holding a configured secret, and
    `down`: why the last try reached no upstream at all (what `/healthz` says until it answers)."""

    def __init__(self, base_url: str, secrets: list[str]) -> None:
        self.base_url, self.secrets = base_url, secrets
        self.down: str | None = None

    def fail(self, message: str, kind: type[UpstreamError] = UpstreamError) -> UpstreamError:
        return kind(redact(message, self.secrets))

    def timed_out(self, timeout: float) -> UpstreamError:
        return self.fail(
            f"the upstream at {self.base_url} did not answer within {timeout:g} s "
            "(raise --upstream-timeout if it is just slow)",
            UpstreamTimeout,
        )

    def unreachable(self, exc: aiohttp.ClientError | OSError) -> UpstreamError:
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, (aiohttp.ClientConnectorError, ConnectError)):
            error = self.fail(f"cannot reach the upstream at {self.base_url}: {reason}")
            self.down = error.message
            return error
        return self.fail(f"the connection to the upstream at {self.base_url} failed: {reason}")

    def status(self, status: int, payload: bytes, retry_after: str | None = None) -> RLProxyError:
        return status_error(self.base_url, status, payload, self.secrets, retry_after)

    def logged(self, payload: bytes) -> str:
        return logged_body(self.base_url, payload, self.secrets)


def status_error(
    where: str, status: int, payload: bytes, secrets: list[str], retry_after: str | None = None
) -> RLProxyError:
    """The gateway's error for an upstream's error answer, `secrets` redacted from all of it. The
    upstream's `Retry-After` is kept on a 4xx the client can act on (a 429 above all: the client's
    SDK waits that long before it retries, rather than at once) and on a 5xx (an overloaded
    upstream's 503 says when it will take calls again; without it the SDK's retries come sooner)."""
    error: dict = {}
    try:
        body = orjson.loads(payload)
        if isinstance(body, dict):
            raw_error = body.get("error", body)
            error = raw_error if isinstance(raw_error, dict) else {"message": str(raw_error)}
    except orjson.JSONDecodeError:
        pass

    def text(value: object) -> str | None:
        return None if value is None else redact(str(value), secrets)

    message = str(error.get("message") or error.get("detail") or "")
    message = redact(message, secrets) if message else logged_body(where, payload, secrets) if payload else "no message"
    if status in (401, 403):
        refused = f"the upstream at {where} refused rlproxy's upstream key ({status})"
        return UpstreamError(redact(f"{refused}: {message}; check --upstream-api-key", secrets))
    if status < 500:
        rejected = UpstreamRejected(
            status, message, text(error.get("type")), text(error.get("param")), text(error.get("code"))
        )
        rejected.headers = _kept_retry_after(retry_after)
        return rejected
    failed = UpstreamError(redact(f"the upstream at {where} answered {status}: {message}", secrets))
    failed.headers = _kept_retry_after(retry_after)
    return failed


def _kept_retry_after(retry_after: str | None) -> tuple[tuple[str, str], ...]:
    if retry_after and _RETRY_AFTER.fullmatch(retry_after.strip()):
        return (("Retry-After", retry_after.strip()),)
    return ()
