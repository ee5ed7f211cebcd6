"""Langfuse tracing: a trace per session, a generation per call, a score per reward and judgement.

Built only when LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY and LANGFUSE_HOST are set.
Nothing here may slow or fail a request: the hooks (`on_call`, `on_reward`,
`on_judgement`) only put an event on a bounded queue and return; one background
thread turns events into Langfuse SDK calls, and the SDK batches and sends them
from its own threads (spans as OTLP to /api/public/otel/v1/traces, scores to
/api/public/scores). When Langfuse is slow or down, events queue up and, once the
queue is full, are dropped and counted; requests never wait.

Ids: the trace id is derived from the rlproxy session id (Langfuse's
`create_trace_id(seed=...)`), so calls and rewards of a session land in one trace
without any state here, and the Langfuse session id is the rlproxy session id.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any

from gateway.settings import Settings
from gateway.store import CallRecord

log = logging.getLogger("rlproxy.tracing")

ENV_VARS = ("LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY", "LANGFUSE_HOST")
QUEUE_SIZE = 10_000  # events waiting for the tracing thread; beyond this they are dropped
SHUTDOWN_TIMEOUT = 10.0  # seconds `close` waits for the last batch; a dead Langfuse costs no more
_STOP = object()
_MODEL_PARAMETERS = (
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "seed",
    "stop",
    "frequency_penalty",
    "presence_penalty",
)


def build_tracer(settings: Settings) -> LangfuseTracer | None:
    """A Langfuse tracer when the three LANGFUSE_* variables are set, else None (no tracing)."""
    values = {name: os.environ.get(name) for name in ENV_VARS}
    if not any(values.values()):
        return None
    missing = [name for name, value in values.items() if not value]
    if missing:
        log.warning("Langfuse tracing is off: %s not set (it needs %s)", ", ".join(missing), ", ".join(ENV_VARS))
        return None
    return LangfuseTracer(
        public_key=values["LANGFUSE_PUBLIC_KEY"], secret_key=values["LANGFUSE_SECRET_KEY"], host=values["LANGFUSE_HOST"]
    )


def _usage(response: dict | None) -> dict[str, int] | None:
    usage = (response or {}).get("usage") or {}
    details = {
        "input": usage.get("prompt_tokens"),
        "output": usage.get("completion_tokens"),
        "total": usage.get("total_tokens"),
    }
    details = {k: int(v) for k, v in details.items() if isinstance(v, (int, float))}
    return details or None


def _output(response: dict | None) -> Any:
    choices = (response or {}).get("choices") or []
    messages = [choice.get("message") for choice in choices]
    return messages[0] if len(messages) == 1 else messages or None


def generation_fields(record: CallRecord) -> dict:
    """What a call becomes in Langfuse (pure, so tests can check it without a server)."""
    request = record.request or {}
    metadata = {
        "step": record.step,
        "request_id": record.id,
        "group_id": record.group_id,
        "split": record.split,
        "engine": record.engine,
        "served": record.served,
        "stream": record.stream,
        "latency_ms": round(record.latency_ms, 3),
    }
    fields: dict[str, Any] = {
        "name": "chat.completion",
        "input": {"messages": request.get("messages"), "tools": request["tools"]}
        if request.get("tools")
        else request.get("messages"),
        "output": _output(record.response),
        "model": record.served or record.model,
        "model_parameters": {k: request[k] for k in _MODEL_PARAMETERS if request.get(k) is not None} or None,
        "usage_details": _usage(record.response),
        "metadata": {k: v for k, v in metadata.items() if v is not None},
    }
    if record.status != "ok":
        fields["level"] = "ERROR"
        fields["status_message"] = record.error or f"HTTP {record.http_status}"
    return fields


class LangfuseTracer:
    """Sends what the gateway records to Langfuse, off the request path."""

    def __init__(
        self,
        *,
        public_key: str,
        secret_key: str,
        host: str,
        flush_interval: float | None = None,
        queue_size: int = QUEUE_SIZE,
    ):
        self._config = {
            "public_key": public_key,
            "secret_key": secret_key,
            "host": host,
            "flush_interval": flush_interval,
        }
        self.host = host
        self._events: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._langfuse: Any = None
        self._provider: Any = None
        self.sent = 0  # events handed to the Langfuse SDK
        self.dropped = 0  # events lost to a full queue
        self.failed = 0  # events the SDK refused (bad data); logged

    def __repr__(self) -> str:  # never shows the keys
        return f"LangfuseTracer(host={self.host!r})"

    # -------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the tracing thread; the Langfuse client is built there (its import is slow)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rlproxy-langfuse", daemon=True)
            self._thread.start()

    def close(self, timeout: float = SHUTDOWN_TIMEOUT) -> None:
        """Send what is queued, then stop; gives up after `timeout` seconds (Langfuse may be down)."""
        if self._thread is None:
            return
        try:
            self._events.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("Langfuse did not take the last events within %.0f s; they are dropped", timeout)
        self._thread = None

    # -------------------------------------------------------------- hooks (never block)

    def _put(self, event: tuple) -> None:
        try:
            self._events.put_nowait(event)
        except queue.Full:
            self.dropped += 1

    def on_call(self, record: CallRecord) -> None:
        self._put(("call", record))

    def on_reward(self, session_id: str, reward: float, metrics: dict[str, float] | None = None) -> None:
        self._put(("reward", session_id, float(reward), dict(metrics or {})))

    def on_judgement(self, group_id: str, scores: list[dict], judge_model: str | None = None) -> None:
        self._put(("judgement", group_id, [dict(s) for s in scores], judge_model))

    def pending(self) -> int:
        """Events not yet handed to the SDK."""
        return self._events.qsize()

    # -------------------------------------------------------------- the tracing thread

    def _client(self) -> Any:
        from langfuse import Langfuse
        from opentelemetry.sdk.trace import TracerProvider

        # Langfuse logs its public key at start-up; keep its chatter out of the gateway's log.
        logging.getLogger("langfuse").setLevel(logging.ERROR)
        # An own provider: the gateway does not take over the process's global OpenTelemetry setup.
        self._provider = TracerProvider()
        config = self._config
        # flush_interval None: the SDK's default, or LANGFUSE_FLUSH_INTERVAL.
        return Langfuse(
            public_key=config["public_key"],
            secret_key=config["secret_key"],
            base_url=config["host"],
            flush_interval=config["flush_interval"],
            tracer_provider=self._provider,
        )

    def _run(self) -> None:
        try:
            self._langfuse = self._client()
        except Exception:
            log.exception("Langfuse tracing could not start; continuing without it")
            self._drain()
            return
        while True:
            event = self._events.get()
            if event is _STOP:
                break
            try:
                getattr(self, "_send_" + event[0])(*event[1:])
                self.sent += 1
            except Exception as exc:  # a bad event is skipped, the thread lives on
                self.failed += 1
                log.warning("Langfuse: could not send a %s event: %s", event[0], type(exc).__name__)
        try:
            self._langfuse.shutdown()
            self._provider.shutdown()
        except Exception as exc:
            log.warning("Langfuse shutdown failed: %s", type(exc).__name__)

    def _drain(self) -> None:
        while self._events.get() is not _STOP:
            self.dropped += 1

    def _trace_id(self, session_id: str) -> str:
        return self._langfuse.create_trace_id(seed=session_id)

    def _send_call(self, record: CallRecord) -> None:
        from langfuse import propagate_attributes

        fields = generation_fields(record)
        attributes = {"session_id": record.session_id, "trace_name": "rlproxy session", "tags": [record.split]}
        if record.group_id:
            attributes["metadata"] = {"group_id": record.group_id}
        with propagate_attributes(**attributes):
            generation = self._langfuse.start_observation(
                trace_context={"trace_id": self._trace_id(record.session_id)}, as_type="generation", **fields
            )
        # The SDK takes no start time: the span started inside that call. Ending it `latency`
        # after a clock read taken once it returned makes Langfuse show the latency the gateway
        # measured, and never an end before the start (a clock read before the call did that
        # whenever the SDK took longer than a fast call's latency).
        generation.end(end_time=time.time_ns() + max(int(record.latency_ms * 1e6), 1))

    def _send_reward(self, session_id: str, reward: float, metrics: dict[str, float]) -> None:
        self._langfuse.create_score(
            name="reward",
            value=reward,
            trace_id=self._trace_id(session_id),
            data_type="NUMERIC",
            metadata=metrics or None,
        )

    def _send_judgement(self, group_id: str, scores: list[dict], judge_model: str | None) -> None:
        for item in scores:
            self._langfuse.create_score(
                name="ruler",
                value=float(item["score"]),
                trace_id=self._trace_id(item["trajectory_id"]),
                data_type="NUMERIC",
                comment=item.get("explanation"),
                metadata={"group_id": group_id, "judge_model": judge_model},
            )
