"""Security defaults that are not a middleware of their own: CORS only when asked for, and a
refusal to start when the gateway would listen beyond loopback with no key.

(The bearer-key check, constant time, is `gateway.http.middleware.BearerAuthMiddleware`; ids and
names from requests are checked by `gateway.chat.identity.check_id` before they reach the store.)
"""

from __future__ import annotations

import logging

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

from gateway.errors import ConfigError
from gateway.http.browsers import is_loopback_name

log = logging.getLogger("rlproxy")

# What a browser client may read of rlproxy's own response headers.
_EXPOSED = ["X-Session-Id", "X-Request-Id", "X-Model-Step"]


def cors_middleware(app: ASGIApp, origins: list[str]) -> ASGIApp:
    """CORS for the given origins only (`--cors-origin`, repeatable; `*` for any). Without
    the flag no CORS header is sent, so browsers keep other sites' pages off the gateway."""
    return CORSMiddleware(
        app,
        allow_origins=list(origins),
        allow_methods=["GET", "POST", "OPTIONS"],
        allow_headers=["*"],
        expose_headers=_EXPOSED,
        allow_credentials=False,
    )


def is_loopback(host: str) -> bool:
    """Whether `--host` listens on loopback only. Not "" (an empty RLPROXY_HOST=): the gateway binds
    its socket itself (gateway/http/listen.py), and bind("") takes every interface, as 0.0.0.0."""
    return host.strip() != "" and is_loopback_name(host.strip("[]").lower())


def refuse_if_exposed(settings) -> None:
    """`--host 0.0.0.0` (or any address beyond loopback) without `--api-key` would serve anyone
    who can reach the port (the Host check stops browsers, not a client that sends
    `Host: localhost`): refused at start, unless `--insecure-no-api-key` says a network of
    the operator's own keeps everyone else out, and then warned about."""
    if settings.api_key is not None or is_loopback(settings.host):
        return
    where = settings.host.strip() or "every interface (--host empty)"
    exposed = (
        f"listening on {where} with no API key: anyone who can reach this port can use the model, "
        "post rewards and read every recorded call"
    )
    if not settings.insecure_no_api_key:
        raise ConfigError(
            f"refusing to start: {exposed}. Set --api-key (or RLPROXY_API_KEY; make one with "
            "`openssl rand -hex 24`), listen on 127.0.0.1, or, where a network of your own keeps everyone "
            "else out, pass --insecure-no-api-key"
        )
    log.warning("%s (--insecure-no-api-key).", exposed)
