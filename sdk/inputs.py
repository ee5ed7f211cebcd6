"""What a caller hands the clients, checked before anything is sent: the base URL, the API key,
a reward's numbers. Pure functions; each refusal says what to fix and never repeats a secret."""

from __future__ import annotations

import math
import re
from numbers import Real
from typing import Any
from urllib.parse import urlsplit

from sdk.errors import shown_url
from sdk.types import sendable

# The session-in-the-base-URL forms (gateway/http/session_url.py), for clients that cannot set headers.
_SESSION_IN_PATH = re.compile(r"/(?:(?:groups|tasks)/[^/]+/)?sessions/[^/]+$")


def api_base(url: str) -> str:
    """`http://host:8000`, `.../v1` or `.../v1/` -> `http://host:8000/v1`; a path before it is kept.

    A session's own base URL (`{gateway}/groups/g/sessions/s/v1`) is refused: the gateway would
    put the client's every session into that group (or task), whose path adds X-Group-Id where
    the call has none, so a `proxy.session()` without a group silently joined group `g`."""
    root = url.strip().rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    if _SESSION_IN_PATH.search(urlsplit(root).path):
        raise ValueError(
            f"base_url {shown_url(url.strip())!r} is one session's URL (.../sessions/ID, for a client that cannot "
            "send headers); give the gateway's own URL (http://host:8000/v1): each session the SDK makes sends "
            "its ids as headers"
        )
    return root + "/v1"


def json_number(value: Any, what: str) -> Any:
    """A reward or metric as JSON carries it. numpy's numbers (np.int64(3), np.float32(0.5)) are
    numbers but not JSON's: sent as floats, else the request never left (TypeError: ... is not
    JSON serializable). NaN and infinity JSON cannot carry at all: they failed as httpx's "Out of
    range float values are not JSON compliant", naming neither the reward nor the metric.
    Anything else (a string, None) goes as it is, for the gateway to say what is wrong with it:
    "0.5" was float()ed into a reward, though the gateway refuses it as a client's bug."""
    if isinstance(value, bool) or not isinstance(value, Real):
        return value
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(
            f"{what} is {number}: a reward and its metrics must be finite numbers (a division by zero, a mean "
            "of nothing?); nothing was sent"
        )
    return number


def sendable_key(key: str | None, source: str) -> str | None:
    """`key` if a header can carry it. One it cannot (a file read whole keeps its last newline) was sent
    anyway, and httpx's refusal, `Illegal header value b'Bearer <the key>'`, put the key in the
    exception text and every traceback; the gateway refuses such a key for itself just the same
    (gateway/settings_keys.py), so no gateway could accept it. The key is never repeated."""
    if key and not sendable(key):
        raise ValueError(
            f"the API key ({source}) is not one an HTTP header can carry: it must be printable ASCII, with no "
            "space or newline at its ends (a file read whole keeps its last newline: strip it)"
        )
    return key
