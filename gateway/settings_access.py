"""Who may reach the gateway beyond its key (`AccessSettings`), which judges it may reach (`judge_urls`),
and how a repeatable flag reads its RLPROXY_* variable (`EnvList`): pieces of `gateway.settings.Settings`,
kept apart for its size."""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, Field
from pydantic_settings import NoDecode


def one_or_list(value: object) -> object:
    """A repeatable flag's RLPROXY_* variable holds one value (RLPROXY_JUDGE_API_BASE=http://...)
    or a JSON list of them; pydantic-settings alone takes JSON only, and fails on a bare URL."""
    if isinstance(value, str):
        return json.loads(value) if value.lstrip().startswith("[") else [value]
    return value


EnvList = Annotated[list[str], NoDecode, BeforeValidator(one_or_list)]


def judge_urls(bases: list[str]) -> list[str]:
    """--judge-api-base: the judges RULER may call (gateway/ruler/judges.py), base URLs."""
    if not all(base.startswith(("http://", "https://")) for base in bases):
        raise ValueError("--judge-api-base must start with http:// or https:// (a base URL: http://gpu-box:8001/v1)")
    return bases


class AccessSettings(BaseModel):
    """Who may reach the gateway beyond its key (gateway/http/browsers.py, gateway/http/security.py):
    flags of `Settings`, in a class of their own for its size."""

    insecure_no_api_key: bool = Field(
        False,
        description="serve beyond loopback (--host 0.0.0.0) with no --api-key: anyone who reaches the port can "
        "use the model, post rewards and read every recorded call; only where a network of your own keeps "
        "everyone else out (refused at start otherwise)",
    )
    cors_origin: EnvList = Field(
        default_factory=list, description="origin allowed to call from a browser (repeatable; CORS is off unless given)"
    )
    allowed_host: EnvList = Field(
        default_factory=list,
        description="a name the gateway is reached by (the Host header; repeatable; *.example.com for "
        "subdomains). Without --api-key only loopback names are answered (no DNS rebinding); with a key "
        "Host is checked only when this is given",
    )
