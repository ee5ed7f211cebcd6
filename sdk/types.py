"""What the client, its groups and its sessions share: the ids they mint and the scores they return."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from urllib.parse import quote


def new_id(prefix: str) -> str:
    """A fresh id the gateway accepts (letters, digits, `_`)."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def sendable(text: str) -> bool:
    """Whether an HTTP header can carry `text` as it is: printable ASCII, no space at its ends (a
    server drops those, and a newline would end the header)."""
    return text == text.strip() and all(" " <= c <= "~" for c in text)


def header_id(value: object, what: str) -> str:
    """An id the session's calls carry as a header (X-Session-Id, X-Group-Id, X-Task-Id).

    One no header can carry failed only at the agent's first call, as a bare UnicodeEncodeError
    (`é`) or the OpenAI client's "Connection error." (a newline), retried first. Anything else a
    header carries goes as it is, for the gateway's own check to say what is wrong with it."""
    if not isinstance(value, str) or not value or not sendable(value):
        raise ValueError(
            f"{what} {value!r:.70} is not valid: use 1-128 letters, digits or . _ : @ -, "
            "starting with a letter or digit"
        )
    return value


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
