"""What is recorded of a call: the row (`call_record`) built from the request, the target,
the engine's tokens and the protocol it came by; and the split guard (one split per session
and group)."""

from __future__ import annotations

import logging
import time

from gateway.adapters import Target
from gateway.chat.identity import Identity, task_key
from gateway.engines.base import TokenRecord
from gateway.errors import Conflict, RLProxyError, other_group
from gateway.protocols import Wire
from gateway.store import CallRecord

log = logging.getLogger("rlproxy.chat")

SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "max_tokens",
)


def requested_sampling(raw: dict) -> dict:
    """The sampling parameters a request set, for engines that cannot report the ones in
    force (an upstream's own defaults are unknown: a field the client left out is None)."""
    out = {name: raw.get(name) for name in SAMPLING_FIELDS}
    out["max_tokens"] = raw.get("max_completion_tokens") or raw.get("max_tokens")
    return out


def call_record(
    *,
    engine_kind: str,
    request_id: str,
    identity: Identity,
    raw: dict,
    target: Target | None,
    stream: bool,
    started: float,
    response: dict | None,
    tokens: TokenRecord | None,
    error: RLProxyError | None = None,
    wire: Wire | None = None,
) -> CallRecord:
    record = CallRecord(
        id=request_id,
        client_request_id=identity.client_request_id,
        session_id=identity.session_id,
        group_id=identity.group_id,
        task_key=task_key(identity, raw.get("messages")),
        split=identity.split,
        model=str(raw.get("model", "")),
        served=target.adapter or target.model if target else None,
        step=target.step if target else None,
        engine=engine_kind,
        stream=stream,
        status="error" if error else "ok",
        http_status=error.status_code if error else 200,
        error=error.message if error else None,
        request=raw,
        response=response,
        latency_ms=(time.perf_counter() - started) * 1000.0,
    )
    if wire is not None:
        record.protocol = wire.protocol
        record.wire_request = wire.request
        if response is not None:
            try:
                record.wire_response = wire.to_wire(response)
            except Exception:  # the record must not be lost to a translation bug
                log.exception("could not translate a %s response for the record", wire.protocol)
    if tokens is not None:
        record.prompt_ids = tokens.prompt_ids
        record.completion_ids = [choice.completion_ids for choice in tokens.choices]
        if all(choice.logprobs is not None for choice in tokens.choices):
            record.behaviour_logprobs = [choice.logprobs for choice in tokens.choices]
        record.sampling = tokens.sampling
    if record.sampling is None:
        record.sampling = requested_sampling(raw)
    return record


class SplitGuard:
    """One split per session and per group, one group per session. Remembers the split of the
    sessions and groups this process recorded and each session's group, so a call that
    contradicts one is refused before it is generated (the store checks again in the
    transaction, which also covers calls to other replicas)."""

    def __init__(self) -> None:
        self._splits: dict[str, str] = {}
        self._groups: dict[str, str] = {}  # session -> its group

    def check(self, identity: Identity) -> None:
        known_group = self._groups.get(identity.session_id)
        if identity.group_id is not None and known_group is not None and known_group != identity.group_id:
            raise other_group(identity.session_id, known_group, identity.group_id)
        for key, what in ((f"s:{identity.session_id}", "session"), (f"g:{identity.group_id}", "group")):
            known = self._splits.get(key)
            if known is not None and known != identity.split and (what == "session" or identity.group_id):
                # the store's words (gateway/store/rows.py): a session is one rollout of a split,
                # a group holds sessions of one
                held = (
                    f"session '{identity.session_id}' is a '{known}' session"
                    if what == "session"
                    else f"group '{identity.group_id}' holds '{known}' sessions"
                )
                raise Conflict(
                    f"{held}; this call says X-Split '{identity.split}'. Use one split per {what}"
                    + (" (a separate group id for val rollouts)." if what == "group" else "."),
                    param="split",
                )

    def remember(self, record: CallRecord) -> None:
        if len(self._splits) > 200_000:
            self._splits.clear()
            self._groups.clear()
        self._splits[f"s:{record.session_id}"] = record.split
        if record.group_id is not None:
            self._splits[f"g:{record.group_id}"] = record.split
            self._groups.setdefault(record.session_id, record.group_id)
