"""What a web page may do to the gateway: nothing it did not get from the gateway itself.

A browser sends some requests to any address without asking first (CORS "simple" requests:
a POST with `Content-Type: text/plain`, a form, a bodiless POST), and it sends the user's
network position along: a page on any site can reach a gateway on loopback. Three checks,
in front of every route (the chat fast path too), keep such pages out, with a key or without:

- `Content-Type: application/json` on every write (an empty body included): a page can send
  JSON cross-site only after a CORS preflight, which rlproxy answers only for `--cors-origin`.
  The dashboard's login form is the one exception: it is a form, and it is same-origin. A
  DELETE without a body needs none (OpenAI's client sends none): a page can send DELETE
  cross-site only after a preflight too, whatever its headers.
  (`JsonWritesMiddleware`, inside the key check: who asks comes before what they sent.)
- `Origin`, when a browser sends one, must be the gateway's own (the `Host` it was reached
  at) or one of `--cors-origin`: a cross-site page's `no-cors` write is refused before it runs.
- `Host` (DNS rebinding: an attacker's name that resolves to 127.0.0.1 makes the gateway
  same-origin with the attacker's page): without `--api-key` it must be a loopback name or one
  of `--allowed-host`; with a key, only when `--allowed-host` is given (the key already keeps
  a rebound page out, and a deployment behind a balancer is reached by many names).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import Forbidden, InvalidRequest, RLProxyError, UnsupportedMediaType
from gateway.http.errors import error_response

_READS = ("GET", "HEAD", "OPTIONS")
FORM_PATHS = ("/ui/login",)
"""Writes that are forms, not JSON: the dashboard's login (same-origin, checked by Origin)."""


def host_name(host: str) -> str:
    """`Host` without its port, lower case: `[::1]:8000` -> `::1`, `Example:80` -> `example`."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host[1:]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback_name(name: str) -> bool:
    """`localhost` (and `*.localhost`, which browsers resolve to loopback themselves) or a
    loopback address; any other name may be an attacker's that resolves to 127.0.0.1."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_allowed(host: str, allowed_hosts: list[str]) -> bool:
    name = host_name(host)
    for allowed in allowed_hosts:
        allowed = allowed.strip().lower()
        if allowed == "*" or allowed == host.strip().lower() or allowed == name:
            return True
        if allowed.startswith("*.") and name.endswith(allowed[1:]):
            return True
    return is_loopback_name(name)


def origin_allowed(origin: str, host: str | None, cors_origins: list[str]) -> bool:
    """Same-origin (the Origin's host and port are the Host the request came to; the scheme is
    left out, as a TLS-terminating proxy changes it) or listed with `--cors-origin`."""
    if "*" in cors_origins or origin in cors_origins:
        return True
    if origin == "null" or host is None:  # sandboxed frames, file:// pages
        return False
    netloc = urlsplit(origin).netloc.lower()
    return bool(netloc) and netloc == host.strip().lower()


def _is_json(content_type: str | None) -> bool:
    if content_type is None:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json"


def _header(scope: Scope, wanted: bytes) -> str | None:
    for name, value in scope["headers"]:
        if name == wanted:
            return value.decode("latin-1")
    return None


def _has_body(scope: Scope) -> bool:
    length = _header(scope, b"content-length")
    return _header(scope, b"transfer-encoding") is not None or (length is not None and length.strip() != "0")


class _Refusing:
    """An ASGI middleware that answers `refusal(scope)`, when there is one, in the route's
    protocol's error shape instead of calling the app."""

    app: ASGIApp

    def refusal(self, scope: Scope) -> RLProxyError | None:
        raise NotImplementedError

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = self.refusal(scope)
            if refused is not None:
                await error_response(scope["path"], refused)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BrowserGuardMiddleware(_Refusing):
    """Outermost, before the key: 400 for a Host not allowed, 403 for a foreign Origin."""

    def __init__(self, app: ASGIApp, *, cors_origins: list[str], allowed_hosts: list[str], check_host: bool):
        self.app = app
        self._cors_origins = list(cors_origins)
        self._allowed_hosts = list(allowed_hosts)
        self._check_host = check_host

    def refusal(self, scope: Scope) -> RLProxyError | None:
        host, origin = _header(scope, b"host"), _header(scope, b"origin")
        if self._check_host and host is not None and not host_allowed(host, self._allowed_hosts):
            return InvalidRequest(
                f"the Host header {host[:100]!r} is not a name this gateway answers to: without --api-key only "
                "loopback names (localhost, 127.0.0.1, [::1]) are, so a page on another site cannot reach it "
                "by a name of its own (DNS rebinding). Start rlproxy with --allowed-host NAME (repeatable) "
                "to add the names it is reached by, or set --api-key",
                code="host_not_allowed",
            )
        if origin is not None and not origin_allowed(origin, host, self._cors_origins):
            return Forbidden(
                f"requests from the web page at {origin[:100]!r} are refused: a page may call this gateway "
                "only from the gateway's own origin or one listed with --cors-origin",
                code="origin_not_allowed",
            )
        return None


class JsonWritesMiddleware(_Refusing):
    """Inside the key (who is asking comes before what they sent): 415 for a write that is not
    JSON, the login form excepted."""

    def __init__(self, app: ASGIApp):
        self.app = app

    def refusal(self, scope: Scope) -> RLProxyError | None:
        if scope["method"] in _READS or scope["path"] in FORM_PATHS:
            return None
        if scope["method"] == "DELETE" and not _has_body(scope):
            return None
        content_type = _header(scope, b"content-type")
        if _is_json(content_type):
            return None
        got = f"Content-Type {content_type[:100]!r}" if content_type else "no Content-Type"
        return UnsupportedMediaType(
            f"{scope['method']} {scope['path']} takes JSON, and the request has {got}: send "
            "'Content-Type: application/json' (with an empty body too, or '{}'); the check keeps "
            "other sites' pages from posting to the gateway",
            code="unsupported_media_type",
        )
