"""One root exception and its named subclasses.

Code raises these; the HTTP edge turns them into OpenAI-shaped errors once
(`gateway.app`), the CLI into a clean message and exit code.
"""

from __future__ import annotations

TRY_AGAIN_EXIT = 75  # sysexits.h's EX_TEMPFAIL: "a temporary failure; the user is invited to retry"


class RLProxyError(Exception):
    """Root of every error rlproxy raises on purpose."""

    status_code = 500
    error_type = "server_error"
    headers: tuple[tuple[str, str], ...] = ()  # sent with the error's response (an upstream's Retry-After)
    # `rlproxy train`'s exit status: 2, the settings or the input are wrong and running it again as
    # it is fails the same way; TRY_AGAIN_EXIT (the errors of the moment below: another trainer holds
    # the lock, the store is restarting), a later start gets past it; 1, a crash (a traceback). `serve
    # --trainer auto` starts its trainer again after 75 for as long as it takes, after 1 until it has
    # crashed too often in a row, never after 2 (gateway/trainer_process.py).
    exit_code = 2
    # Set once the call it ended is in a call row (counted as rlproxy_chat_requests_total); an error
    # without it refused the call before that (counted as rlproxy_chat_refused_total).
    recorded = False

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class InvalidRequest(RLProxyError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(RLProxyError):
    status_code = 401
    error_type = "authentication_error"


class Forbidden(RLProxyError):
    status_code = 403
    error_type = "permission_error"


class UnsupportedMediaType(RLProxyError):
    status_code = 415
    error_type = "invalid_request_error"


class NotFound(RLProxyError):
    status_code = 404
    error_type = "not_found_error"


class MethodNotAllowed(RLProxyError):
    status_code = 405
    error_type = "invalid_request_error"


class Conflict(RLProxyError):
    status_code = 409
    error_type = "conflict_error"


class ClientGone(RLProxyError):
    """The client disconnected before its answer was ready: recorded as 499 (nginx's "client
    closed request"), so an answer nobody read is never trained; there is nobody to send it to."""

    status_code = 499
    error_type = "client_closed_request"

    def __init__(self, message: str = "the client disconnected before the answer was ready", **kwargs):
        super().__init__(message, **kwargs)


class UpstreamError(RLProxyError):
    """The model behind the gateway failed or answered with an error."""

    status_code = 502
    error_type = "upstream_error"


class UpstreamTimeout(UpstreamError):
    status_code = 504
    error_type = "upstream_timeout"


class EngineUnavailable(RLProxyError):
    """The engine cannot take requests right now (starting, restarting)."""

    status_code = 503
    error_type = "engine_unavailable"
    exit_code = TRY_AGAIN_EXIT


class EngineUnreached(EngineUnavailable):
    """The engine answered not one byte of this request (down, refused, dropped before answering):
    a replica set sends it to another replica instead of failing it."""


class ConfigError(RLProxyError):
    """Bad settings or a missing optional dependency; raised at start-up."""

    status_code = 500
    error_type = "config_error"


class TrainerBusy(ConfigError):
    """Another trainer holds this model's lock: this one is refused, and takes over once that one
    is gone (deploy/README.md), so `rlproxy train` exits 75 and `serve --trainer auto` tries again
    for as long as it takes (a standby's wait is not a crash loop)."""

    exit_code = TRY_AGAIN_EXIT


class StoreUnreachable(ConfigError):
    """No connection to the store at start: a wrong --store, or a server down (restarting). A
    trainer under `serve --trainer auto`, whose gateway reached the same store, meets the second:
    `rlproxy train` exits 75, and it is tried again rather than left failed for good."""

    exit_code = TRY_AGAIN_EXIT


class RequestTooLarge(RLProxyError):
    """A request over one of the gateway's limits on size (`--max-body-mb`)."""

    status_code = 413
    error_type = "invalid_request_error"


class StoreUnavailable(RLProxyError):
    """The store cannot record right now (read-only, locked, unavailable): nothing was
    acknowledged; the gateway recovers by itself once the cause is gone."""

    status_code = 503
    error_type = "store_unavailable"
    exit_code = TRY_AGAIN_EXIT

    def __init__(self, message: str, *, cause: str, code: str | None = None):
        super().__init__(message, code=code or f"store_{cause}")
        self.cause = cause  # full, read_only, locked, moved, unavailable, damaged: the label in /metrics


class StoreFull(StoreUnavailable):
    """The disk holding the store is full."""

    status_code = 507
    error_type = "insufficient_storage"


def other_group(session_id: str, group_id: str, named: str) -> Conflict:
    """A call that names a group its session is not in: a session is one rollout of one group."""
    return Conflict(
        f"session '{session_id}' is in group '{group_id}'; this call says X-Group-Id '{named}'. Keep one group "
        "per session (a new session id for a new rollout).",
        param="group_id",
    )
