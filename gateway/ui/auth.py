"""The API key for browsers: a login form sets an HttpOnly cookie.

The cookie holds an HMAC of a fixed label under the key, never the key itself, and it is
compared in constant time. It is accepted on GET and HEAD only, and is SameSite=Strict:
the dashboard reads, and a page on another site can never make a browser post a reward or
trigger training with it. Everything else is `BearerAuthMiddleware`'s job, unchanged.
The key is never taken from a URL (`/ui?key=...`): URLs end up in access logs, proxies' logs
and the browser's history.
"""

from __future__ import annotations

import hashlib
import hmac
from html import escape
from urllib.parse import parse_qs, quote, urlencode

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.http.middleware import BearerAuthMiddleware

COOKIE = "rlproxy_ui"
LOGIN_PATH = "/ui/login"
STATIC_PREFIX = "/ui/static/"
_READ_METHODS = ("GET", "HEAD")
_MAX_FORM_BYTES = 16 * 1024


def cookie_token(api_key: str) -> str:
    return hmac.new(api_key.encode(), b"rlproxy dashboard session v1", hashlib.sha256).hexdigest()


def cookie_name(api_key: str) -> str:
    """`rlproxy_ui_` and the token's first 8 hex digits. A browser keeps one cookie per name and
    host whatever the port (RFC 6265, 8.5): with one name for every gateway, signing in to a
    second one on the same host (another port, another key) signed the browser out of the first."""
    return f"{COOKIE}_{cookie_token(api_key)[:8]}"


def _cookies(scope: Scope) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in scope["headers"]:
        if name == b"cookie":
            for part in value.decode("latin-1").split(";"):
                key, _, val = part.strip().partition("=")
                out.setdefault(key, val)
    return out


def _safe_next(target: str | None) -> str:
    """Only a path of this dashboard: never an open redirect to another site."""
    if target and target.startswith("/ui") and not target.startswith("//") and "\\" not in target:
        return target
    return "/ui"


def login_page(next_path: str, message: str | None = None) -> bytes:
    note = f'<p class="error" role="alert">{escape(message)}</p>' if message else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>rlproxy: sign in</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="/ui/static/favicon.svg" type="image/svg+xml">
<link rel="stylesheet" href="/ui/static/dashboard.css"></head>
<body class="login"><main><h1>rlproxy dashboard</h1>
<p>This gateway needs its API key (the one <code>rlproxy serve --api-key</code> was started with).</p>
{note}
<form method="post" action="{LOGIN_PATH}">
<input type="hidden" name="next" value="{escape(_safe_next(next_path))}">
<label>API key <input type="password" name="key" autocomplete="current-password" required autofocus></label>
<button type="submit">Sign in</button></form></main></body></html>""".encode()


class DashboardAuthMiddleware(BearerAuthMiddleware):
    """`BearerAuthMiddleware`, plus the dashboard's cookie for reads and its login."""

    def __init__(
        self, app: ASGIApp, api_key: str, open_paths: tuple[str, ...] = ("/healthz",), admin_key: str | None = None
    ):
        super().__init__(app, api_key, open_paths, admin_key)
        self._key = api_key.encode()
        self._token = cookie_token(api_key).encode()
        self._cookie = cookie_name(api_key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        if path.startswith(STATIC_PREFIX):  # the vendored chart library and the page's own JS/CSS
            await self.app(scope, receive, send)
            return
        if path == LOGIN_PATH:
            await self._login(scope, receive, send)
            return
        if method in _READ_METHODS and hmac.compare_digest(_cookies(scope).get(self._cookie, "").encode(), self._token):
            await self.app(scope, receive, send)
            return
        if path == "/ui" or path.startswith("/ui/"):
            if method in _READ_METHODS:
                if any(name == b"authorization" for name, _ in scope["headers"]):
                    await super().__call__(scope, receive, send)
                    return
                # An old `/ui?key=...` link signs nobody in, and its key is not put into the page.
                query_string = scope.get("query_string", b"").decode("latin-1")
                query = parse_qs(query_string, keep_blank_values=True)
                if "key" in query:
                    query_string = urlencode({k: v for k, v in query.items() if k != "key"}, doseq=True)
                await self._refuse(send, path + ("?" + query_string if query_string else ""), None)
                return
        await super().__call__(scope, receive, send)

    async def _login(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            await self._refuse(send, query.get("next", ["/ui"])[0], None, status=200)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if len(body) > _MAX_FORM_BYTES:
                await self._refuse(send, "/ui", "The form was too large.", status=413)
                return
            if not message.get("more_body"):
                break
        form = parse_qs(body.decode("utf-8", errors="replace"))
        target = _safe_next(form.get("next", ["/ui"])[0])
        if hmac.compare_digest(form.get("key", [""])[0].encode(), self._key):
            await self._signed_in(scope, send, target)
        else:
            await self._refuse(send, target, "That key does not match the gateway's API key.")

    async def _signed_in(self, scope: Scope, send: Send, target: str) -> None:
        secure = "; Secure" if scope.get("scheme") == "https" else ""
        cookie = f"{self._cookie}={self._token.decode()}; Path=/; HttpOnly; SameSite=Strict{secure}"
        await send(
            {
                "type": "http.response.start",
                "status": 303,
                # Re-encoded: a decoded path may hold CR/LF, which must never reach a header.
                "headers": [
                    (b"location", quote(_safe_next(target), safe="/?&=%-._~:@+").encode()),
                    (b"set-cookie", cookie.encode()),
                    (b"cache-control", b"no-store"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": b""})

    async def _refuse(self, send: Send, next_path: str, message: str | None, status: int = 401) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"text/html; charset=utf-8"),
                    (b"cache-control", b"no-store"),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": login_page(next_path, message)})
