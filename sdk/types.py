"""What the client, its groups and its sessions share: the ids they mint and the scores they return."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from urllib.parse import quote


def new_id(prefix: str) -> str:
    """A fresh id the gateway accepts (letters, digits, `_`)."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def path_id(value: str, what: str) -> str:
    """An id as one segment of a route's path, so that it can only ever name itself.

    Put in a URL as it is, `abc#1` or `abc?x` would end the path early (`get_session("abc#1")`
    read session `abc`) and `../groups/g/close?` would walk to another route. Escaped, the id
    reaches the gateway whole, whose own check says what is wrong with it. A `/` or a dot
    segment cannot be escaped (the server decodes `%2F` before routing; the client resolves
    `..`), so they are refused here."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, not {value!r}")
    if "/" in value or value in (".", ".."):
        raise ValueError(
            f"{what} {value[:64]!r} is not valid: use 1-128 letters, digits or . _ : @ -, "
            "starting with a letter or digit"
        )
    return quote(value, safe="")


@dataclass(frozen=True)
class Score:
    """One session's RULER judgement."""

    session_id: str
    score: float  # in [0, 1]; it is now the session's reward
    explanation: str | None
