"""What the log says of each call: a line naming its session and request id (so an operator can
follow one call from a client's X-Request-Id to the store), and uvicorn's access line without
the secrets a client put in a URL's query string (`/ui?key=...`, `?api_key=...`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from gateway.redact import mask_text, redact
from gateway.store import CallRecord

log = logging.getLogger("rlproxy.chat")


def log_call(record: CallRecord) -> None:
    """A call observer: debug for a call answered, warning for one the gateway or its engine
    failed (5xx), info for one refused or left by its client (the reason the client got; the
    store holds it redacted, and so does this line). The client's own X-Request-Id is named
    too, so a call can be found from either side."""
    failed = record.status != "ok"
    level = logging.DEBUG if not failed else logging.WARNING if record.http_status >= 500 else logging.INFO
    if not log.isEnabledFor(level):
        return
    client_id = f" (client request id {record.client_request_id})" if record.client_request_id else ""
    if failed:
        outcome = f"failed: {record.http_status} {record.error or ''}"
    else:
        outcome = f"served by {record.served}: {record.http_status} in {record.latency_ms:.1f} ms"
    log.log(level, "call %s%s session %s model %s %s", record.id, client_id, record.session_id, record.model, outcome)


class AccessLogSecrets(logging.Filter):
    """On uvicorn's access logger: its line (`"GET /ui?key=... HTTP/1.1" 401`) holds the whole
    query string, where a client may have put a key; secret-named parameters and the gateway's
    own keys are masked before any handler sees it."""

    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        self.secrets = [secret for secret in secrets if secret]

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's args: (client address, method, path with its query, HTTP version, status).
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], redact(mask_text(args[2]), self.secrets), *args[3:])
        return True


def hide_access_log_secrets(secrets: Iterable[str]) -> None:
    """Install `AccessLogSecrets` on uvicorn's access logger (uvicorn's own logging set-up keeps
    a logger's filters)."""
    logging.getLogger("uvicorn.access").addFilter(AccessLogSecrets(secrets))
