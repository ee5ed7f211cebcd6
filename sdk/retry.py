"""Which failed requests the clients send again, and after how long (pure; the clients do the waiting).

Sent again: what the gateway did not take, for a route where a second copy changes nothing.
The gateway says a 503 was not acknowledged ("send it again": the store could not record,
it recovers by itself) and a 429 asks the client to come back; a connection refused or
dropped on the way (a gateway restarting) took nothing either, or took a copy the repeat
overwrites with the same. Every rlproxy route the SDK calls is such a route (a reward posted
twice keeps the same reward, a discard and a close are idempotent, reads read) except RULER:
a judgement costs judge calls and a second one while the first runs is a 409. A timeout is
not sent again: the gateway may still be working on it, and the wait was already `timeout=`.
"""

from __future__ import annotations

from sdk.errors import APIConnectionError, APITimeoutError, RLProxyAPIError, RLProxySDKError

DEFAULT_MAX_RETRIES = 2
FIRST_BACKOFF = 0.25  # seconds; doubled each try
# A Retry-After longer than this is not waited out: the error is raised at once, its
# `retry_after` saying how long the gateway asked for, for the caller to decide.
MAX_RETRY_WAIT = 30.0
RETRY_STATUSES = frozenset({429, 503})


def may_send_again(path: str) -> bool:
    return not path.endswith("/ruler")


def backoff(attempt: int) -> float:
    return min(FIRST_BACKOFF * 2**attempt, MAX_RETRY_WAIT)


def retry_delay(error: RLProxySDKError, attempt: int, max_retries: int) -> float | None:
    """Seconds to wait before sending again a request whose try number `attempt` (0 first) failed
    with `error`, or None: raise it."""
    if attempt >= max_retries:
        return None
    if isinstance(error, APITimeoutError):
        return None
    if isinstance(error, APIConnectionError):
        return backoff(attempt) if error.retryable else None
    if isinstance(error, RLProxyAPIError) and error.status_code in RETRY_STATUSES:
        if error.retry_after is None:
            return backoff(attempt)
        return error.retry_after if error.retry_after <= MAX_RETRY_WAIT else None
    return None
