"""Who may reach the gateway beyond its key (`AccessSettings`), which judges it may reach (`judge_urls`),
and how a repeatable flag reads its RLPROXY_* variable (`EnvList`): pieces of `gateway.settings.Settings`,
kept apart for its size."""

from __future__ import annotations

import json
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, BeforeValidator, Field
from pydantic_settings import NoDecode

from gateway.redact import mask_text


def one_or_list(value: object) -> object:
    """A repeatable flag's RLPROXY_* variable holds one value (RLPROXY_JUDGE_API_BASE=http://...)
    or a JSON list of them; pydantic-settings alone takes JSON only, and fails on a bare URL."""
    if isinstance(value, str):
        return json.loads(value) if value.lstrip().startswith("[") else [value]
    return value


EnvList = Annotated[list[str], NoDecode, BeforeValidator(one_or_list)]
_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origins(origins: list[str]) -> list[str]:
    # Compared with the Origin header as it is, which a browser writes scheme://host[:port], lowercase, with
    # no path and no default port: `https://app.example/` (copied from the address bar) matched no page,
    # and each of its calls was a 403 saying the page was not "listed with --cors-origin".
    for origin in origins:
        if origin == "*":
            continue
        try:
            parts = urlsplit(origin)
            port = parts.port
        except ValueError:
            parts, port = urlsplit(""), None
        host = parts.hostname or ""
        if parts.scheme.lower() not in _DEFAULT_PORTS or not host or parts.username is not None:
            raise ValueError(
                f"--cors-origin {mask_text(origin)!r} is not an origin: give it as a browser sends it, "
                "scheme://host[:port] (https://app.example, http://localhost:3000), or * for any"
            )
        host = f"[{host}]" if ":" in host else host
        shown = f":{port}" if port is not None and port != _DEFAULT_PORTS[parts.scheme.lower()] else ""
        canonical = f"{parts.scheme.lower()}://{host}{shown}"
        if origin != canonical:
            raise ValueError(
                f"--cors-origin {origin!r} would match no page: a browser sends its origin as {canonical} "
                "(lowercase, no path or '/' at the end, no default port); give that"
            )
    return origins


def _host_names(names: list[str]) -> list[str]:
    # Compared with the Host header, a name and maybe a port: a URL given here matched no request.
    for name in names:
        if not name.strip() or any(c in name for c in "/@ "):
            raise ValueError(
                f"--allowed-host {name!r} is not a host name: give the name clients reach the gateway by, as "
                "the Host header has it (rlproxy.example.com, *.example.com, or with its port), not a URL"
            )
    return names


def judge_urls(bases: list[str]) -> list[str]:
    """--judge-api-base: the judges RULER may call (gateway/ruler/judges.py), base URLs."""
    if not all(base.startswith(("http://", "https://")) for base in bases):
        raise ValueError("--judge-api-base must start with http:// or https:// (a base URL: http://gpu-box:8001/v1)")
    return bases


def judge_url(base: str | None) -> str | None:
    # The URL is not repeated: it may hold a password (ftp://u:PASSWORD@judge went to the terminal whole).
    if base and not base.startswith(("http://", "https://")):
        raise ValueError("--shadow-judge-api-base must start with http:// or https:// (http://gpu-box:8001/v1)")
    return base


class AccessSettings(BaseModel):
    """Who may reach the gateway beyond its key (gateway/http/browsers.py, gateway/http/security.py):
    flags of `Settings`, in a class of their own for its size."""

    insecure_no_api_key: bool = Field(
        False,
        description="serve beyond loopback (--host 0.0.0.0) with no --api-key: anyone who reaches the port can "
        "use the model, post rewards and read every recorded call; only where a network of your own keeps "
        "everyone else out (refused at start otherwise)",
    )
    cors_origin: Annotated[EnvList, AfterValidator(_origins)] = Field(
        default_factory=list,
        description="origin allowed to call from a browser, as it sends it: scheme://host[:port], e.g. "
        "https://app.example (repeatable; * for any; CORS is off unless given)",
    )
    allowed_host: Annotated[EnvList, AfterValidator(_host_names)] = Field(
        default_factory=list,
        description="a name the gateway is reached by (the Host header; repeatable; *.example.com for "
        "subdomains). Without --api-key only loopback names are answered (no DNS rebinding); with a key "
        "Host is checked only when this is given",
    )
