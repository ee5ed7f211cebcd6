"""Whose call this is: session, group, task key and split, from headers or body `metadata` (or
a fresh session id), and the check every id from a request passes before it reaches the store."""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from gateway.errors import InvalidRequest

# Matched whole (`fullmatch`): `$` would let a final line break through, into headers and the store.
_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
IDENTITY_KEYS = ("session_id", "group_id", "task_id", "split")


@dataclass(frozen=True)
class Identity:
    """Whose call this is."""

    session_id: str
    group_id: str | None
    split: str
    minted: bool  # the gateway made the session id up (returned in X-Session-Id)
    client_request_id: str | None = None  # the client's X-Request-Id, recorded beside ours
    task_id: str | None = None  # X-Task-Id: the task of an ungrouped (live) session (gateway/store/live.py)


def check_id(value: str, what: str) -> str:
    if not _ID_PATTERN.fullmatch(value):
        raise InvalidRequest(
            f"{what} '{value[:64]}' is not valid: "
            "use 1-128 letters, digits or . _ : @ -, starting with a letter or digit",
            param=what,
        )
    return value


def identify(headers: Mapping[str, str], body: dict) -> Identity:
    """Session, group, task and split from headers, else body `metadata`, else a fresh session id."""
    metadata = body.get("metadata") or {}  # an object: the protocol's model checked it
    session_id = headers.get("x-session-id") or metadata.get("session_id")
    group_id = headers.get("x-group-id") or metadata.get("group_id")
    split = headers.get("x-split") or metadata.get("split") or "train"
    if not isinstance(split, str) or split.lower() not in ("train", "val"):
        where = "X-Split" if headers.get("x-split") else "metadata.split"
        raise InvalidRequest(f"split '{str(split)[:64]}' is not valid: use 'train' or 'val'", param=where)
    split = split.lower()
    minted = not session_id
    session_id = "sess_" + uuid.uuid4().hex if minted else check_id(str(session_id), "session_id")
    if group_id is not None:
        group_id = check_id(str(group_id), "group_id")
    task_id = headers.get("x-task-id") or metadata.get("task_id")
    if task_id is not None:
        task_id = check_id(str(task_id), "task_id")
    client_request_id = headers.get("x-request-id")
    if client_request_id is not None and not _ID_PATTERN.fullmatch(client_request_id):
        client_request_id = None  # a tracing aid only: an odd one is dropped, not refused
    return Identity(
        session_id=session_id,
        group_id=group_id,
        split=split,
        minted=minted,
        client_request_id=client_request_id,
        task_id=task_id,
    )


NO_SYSTEM_PROMPT = "system:none"
"""The task key of an ungrouped session with no X-Task-Id and no system prompt: all such
sessions of a model share it (and so a baseline)."""


def _text(content: object) -> str:
    if isinstance(content, list):  # content parts: their text, in order
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


def task_key(identity: Identity, messages: object) -> str | None:
    """The task key a session is recorded under: its X-Task-Id, or for a session with no group
    one derived from the system prompt (`system:` and 16 hex digits of its SHA-256; the system
    and developer messages before the first other one, joined), or `NO_SYSTEM_PROMPT`. A
    harness session (it has a group) has only the key it was given."""
    if identity.task_id is not None or identity.group_id is not None:
        return identity.task_id
    system = []
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer"):
            break
        system.append(_text(message.get("content")))
    if not system:
        return NO_SYSTEM_PROMPT
    return "system:" + hashlib.sha256("\n".join(system).encode()).hexdigest()[:16]


def canary_key(identity: Identity) -> str:
    """What `--promote canary` routes NAME by: a harness group's sessions follow its first (one
    step per group, so GRPO compares rollouts of one policy), any other session by its own id."""
    return f"group:{identity.group_id}" if identity.group_id else f"session:{identity.session_id}"
