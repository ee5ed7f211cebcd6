"""Whose call this is: session, group and split, from headers or body `metadata` (or a
fresh session id), and the check every id from a request passes before it reaches the store."""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.errors import InvalidRequest

_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
IDENTITY_KEYS = ("session_id", "group_id", "split")


@dataclass(frozen=True)
class Identity:
    """Whose call this is."""

    session_id: str
    group_id: str | None
    split: str
    minted: bool  # the gateway made the session id up (returned in X-Session-Id)
    client_request_id: str | None = None  # the client's X-Request-Id, recorded beside ours


def check_id(value: str, what: str) -> str:
    if not _ID_PATTERN.match(value):
        raise InvalidRequest(
            f"{what} '{value[:64]}' is not valid: "
            "use 1-128 letters, digits or . _ : @ -, starting with a letter or digit",
            param=what,
        )
    return value


def identify(headers: Mapping[str, str], body: dict) -> Identity:
    """Session, group and split from headers, else body `metadata`, else a fresh session id."""
    metadata = body.get("metadata") or {}
    session_id = headers.get("x-session-id") or metadata.get("session_id")
    group_id = headers.get("x-group-id") or metadata.get("group_id")
    split = (headers.get("x-split") or metadata.get("split") or "train").lower()
    if split not in ("train", "val"):
        raise InvalidRequest(f"split '{split}' is not valid: use 'train' or 'val'", param="X-Split")
    minted = not session_id
    session_id = "sess_" + uuid.uuid4().hex if minted else check_id(str(session_id), "session_id")
    if group_id is not None:
        group_id = check_id(str(group_id), "group_id")
    client_request_id = headers.get("x-request-id")
    if client_request_id is not None and not _ID_PATTERN.match(client_request_id):
        client_request_id = None  # a tracing aid only: an odd one is dropped, not refused
    return Identity(
        session_id=session_id, group_id=group_id, split=split, minted=minted, client_request_id=client_request_id
    )
