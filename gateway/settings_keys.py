"""The keys among the settings (`gateway.settings.Settings`), checked when they are read: the
gateway's own long enough not to be guessed, and every key one that an HTTP header can carry."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, SecretStr

MIN_API_KEY_LENGTH = 16
WEAK_API_KEY = (
    f"the gateway's API key must be at least {MIN_API_KEY_LENGTH} characters: an empty or short key is one "
    "anyone can guess, and the dashboard's cookie is computed from it. Make one with `openssl rand -hex 24` "
    "and set it as RLPROXY_API_KEY (or --api-key, which other users see in `ps`); to run without a key (loopback "
    "only), leave both unset"
)


def _sendable(key: SecretStr | None) -> SecretStr | None:
    # A key read whole from a file (a Kubernetes secret, `--env-file`) ends with its newline: no client can
    # send that in a header (HTTP drops a value's spaces at its ends, and a newline ends the header), so the
    # gateway answered every call 401 "the key does not match", and an upstream key every call a 400
    # "malformed HTTP request", blamed on the client. The key itself is never repeated.
    value = "" if key is None else key.get_secret_value()
    if value != value.strip() or not all(" " <= c <= "~" for c in value):
        raise ValueError(
            "a key must be printable ASCII, with no space or newline at its ends (a file read whole keeps its "
            "last newline: strip it, e.g. RLPROXY_API_KEY=\"$(tr -d '\\n' < FILE)\")"
        )
    return key


def _long_enough(key: SecretStr | None) -> SecretStr | None:
    # A blank RLPROXY_API_KEY= is refused too: whoever set it meant a key, not none.
    if key is not None and len(key.get_secret_value().strip()) < MIN_API_KEY_LENGTH:
        raise ValueError(WEAK_API_KEY)
    return key


Key = Annotated[SecretStr | None, AfterValidator(_sendable)]
"""A key rlproxy sends upstream in a header (--upstream-api-key, --vllm-api-key)."""
GatewayKey = Annotated[SecretStr | None, AfterValidator(_long_enough), AfterValidator(_sendable)]
"""A key clients send the gateway (--api-key, --admin-key)."""


def admin_apart(api_key: SecretStr | None, admin_key: SecretStr | None) -> None:
    """--admin-key is a key agents do not hold: the same as --api-key, every agent would be admin."""
    if api_key is not None and admin_key is not None and api_key.get_secret_value() == admin_key.get_secret_value():
        raise ValueError(
            "--admin-key is the same as --api-key: every agent holding the key could promote, reject, resume "
            "and trigger; give the admin a key of its own (`openssl rand -hex 24`), or leave --admin-key out"
        )
