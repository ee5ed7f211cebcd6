"""What the client, its groups and its sessions share: the ids they mint and the scores they return."""

from __future__ import annotations

import uuid
from dataclasses import dataclass


def new_id(prefix: str) -> str:
    """A fresh id the gateway accepts (letters, digits, `_`)."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Score:
    """One session's RULER judgement."""

    session_id: str
    score: float  # in [0, 1]; it is now the session's reward
    explanation: str | None
