"""The chat service: identify the session, route to an adapter, call the engine, record.

Routes stay thin; everything a chat completion does lives here. A response is
handed back only after its call row is committed (the stream's `[DONE]` too).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

from gateway.adapters import AdapterRegistry, Target
from gateway.chat.gate import RequestGate
from gateway.engines.base import Engine, EngineRequest, StreamEnd, TokenRecord
from gateway.errors import ClientGone, Conflict, InvalidRequest, RLProxyError, StoreUnavailable
from gateway.http.limits import Limits, check_chat_limits
from gateway.protocols import Wire
from gateway.protocols.chat import ChatCompletionRequest
from gateway.store import CallRecord, Store

log = logging.getLogger("rlproxy.chat")

_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")
_IDENTITY_KEYS = ("session_id", "group_id", "split")


@dataclass(frozen=True)
class Identity:
    """Whose call this is."""

    session_id: str
    group_id: str | None
    split: str
    minted: bool  # the gateway made the session id up (returned in X-Session-Id)
    client_request_id: str | None = None  # the client's X-Request-Id, recorded beside ours


def _check_id(value: str, what: str) -> str:
    if not _ID_PATTERN.match(value):
        raise InvalidRequest(
            f"{what} '{value[:64]}' is not valid: "
            "use 1-128 letters, digits or . _ : @ -, starting with a letter or digit",
            param=what,
        )
    return value


def identify(headers: Mapping[str, str], body: dict) -> Identity:
    """Session, group and split from headers, else body `metadata`, else a fresh session id."""
    metadata = body.get("metadata") or {}
    session_id = headers.get("x-session-id") or metadata.get("session_id")
    group_id = headers.get("x-group-id") or metadata.get("group_id")
    split = (headers.get("x-split") or metadata.get("split") or "train").lower()
    if split not in ("train", "val"):
        raise InvalidRequest(f"split '{split}' is not valid: use 'train' or 'val'", param="X-Split")
    minted = not session_id
    session_id = "sess_" + uuid.uuid4().hex if minted else _check_id(str(session_id), "session_id")
    if group_id is not None:
        group_id = _check_id(str(group_id), "group_id")
    client_request_id = headers.get("x-request-id")
    if client_request_id is not None and not _ID_PATTERN.match(client_request_id):
        client_request_id = None  # a tracing aid only: an odd one is dropped, not refused
    return Identity(
        session_id=session_id, group_id=group_id, split=split, minted=minted, client_request_id=client_request_id
    )


def engine_body(request: ChatCompletionRequest, raw: dict, target: Target) -> dict:
    """The body the engine sees: the client's, minus rlproxy's metadata keys, with the target model."""
    body = dict(raw)
    body["model"] = target.model
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and any(key in metadata for key in _IDENTITY_KEYS):
        rest = {k: v for k, v in metadata.items() if k not in _IDENTITY_KEYS}
        if rest:
            body["metadata"] = rest
        else:
            body.pop("metadata")
    if request.stop is not None:
        body["stop"] = request.stop
    return body


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


class ChatService:
    def __init__(
        self,
        engine: Engine,
        store: Store,
        registry: AdapterRegistry,
        gate: RequestGate,
        observers: list[Callable[[CallRecord], None]] | None = None,
        limits: Limits | None = None,
    ):
        self.limits = limits or Limits()
        self.engine = engine
        self.store = store
        self.registry = registry
        self.gate = gate
        # Called with every committed call (metrics, tracing); they must not block.
        self.observers = observers or []
        # Split of the sessions and groups this process recorded: a call that contradicts
        # one is refused before it is generated (the store checks again in the transaction,
        # which also covers calls that went to other replicas).
        self._splits: dict[str, str] = {}

    def check_split(self, identity: Identity) -> None:
        for key, what in ((f"s:{identity.session_id}", "session"), (f"g:{identity.group_id}", "group")):
            known = self._splits.get(key)
            if known is not None and known != identity.split and (what == "session" or identity.group_id):
                name = identity.session_id if what == "session" else identity.group_id
                raise Conflict(
                    f"{what} '{name}' holds '{known}' sessions; this call says X-Split '{identity.split}'. "
                    f"Use one split per {what}"
                    + (" (a separate group id for val rollouts)." if what == "group" else "."),
                    param="split",
                )

    def _remember_split(self, record: CallRecord) -> None:
        if len(self._splits) > 200_000:
            self._splits.clear()
        self._splits[f"s:{record.session_id}"] = record.split
        if record.group_id is not None:
            self._splits[f"g:{record.group_id}"] = record.split

    def _record(
        self,
        *,
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
            split=identity.split,
            model=str(raw.get("model", "")),
            served=target.adapter or target.model if target else None,
            step=target.step if target else None,
            engine=self.engine.kind,
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

    async def _commit(self, record: CallRecord) -> None:
        # No call in the engine: nobody to share a group commit with, so commit at once.
        await self.store.record_call(record, alone=self.gate.in_flight == 0)
        self._remember_split(record)
        for observe in self.observers:
            try:
                observe(record)
            except Exception:  # an observer's failure never fails a call
                log.exception("call observer failed")

    async def admit(self, request: ChatCompletionRequest) -> None:
        """Refuse, before any engine work, a request over the limits, or any request while the
        store cannot record (its answer could not be acknowledged): a probe write decides,
        so calls come back by themselves once the disk has room again."""
        check_chat_limits(request, self.limits, getattr(self.engine, "context_length", None))
        if self.store.health.degraded:
            await self.store.probe()

    async def complete(
        self,
        request: ChatCompletionRequest,
        raw: dict,
        identity: Identity,
        request_id: str,
        wire: Wire | None = None,
        client_left: Callable[[], bool] | None = None,
    ) -> tuple[dict, Target]:
        """The engine's answer, recorded. `client_left`, asked once the answer is ready: True
        records the call as 499 (nobody will read it) and raises `ClientGone`."""
        await self.admit(request)
        started = time.perf_counter()
        target = None
        self.check_split(identity)
        try:
            async with self.gate.passage(), self.registry.use(request.model) as target:
                completion = await self.engine.complete(
                    EngineRequest(body=engine_body(request, raw, target), adapter=target.adapter, request_id=request_id)
                )
            if client_left is not None and client_left():
                raise ClientGone()
        except RLProxyError as exc:
            await self._commit(
                self._record(
                    request_id=request_id,
                    identity=identity,
                    raw=raw,
                    target=target,
                    stream=False,
                    started=started,
                    response=None,
                    tokens=None,
                    error=exc,
                    wire=wire,
                )
            )
            raise
        except asyncio.CancelledError:
            # The route gave up on the call because its client left: recorded (499), never trained.
            await asyncio.shield(
                self._commit(
                    self._record(
                        request_id=request_id,
                        identity=identity,
                        raw=raw,
                        target=target,
                        stream=False,
                        started=started,
                        response=None,
                        tokens=None,
                        error=ClientGone(),
                        wire=wire,
                    )
                )
            )
            raise
        response = completion.response
        response["model"] = request.model  # the client sees the name it asked for
        await self._commit(
            self._record(
                request_id=request_id,
                identity=identity,
                raw=raw,
                target=target,
                stream=False,
                started=started,
                response=response,
                tokens=completion.tokens,
                wire=wire,
            )
        )
        return response, target

    async def open_stream(
        self,
        request: ChatCompletionRequest,
        raw: dict,
        identity: Identity,
        request_id: str,
        wire: Wire | None = None,
    ) -> tuple[AsyncIterator[bytes], Target]:
        """Resolve the target and wait for the first chunk before the response starts, so a
        request the engine refuses at once gets its real HTTP status, not a 200 stream."""
        await self.admit(request)
        self.check_split(identity)
        await self.gate.wait()
        await self.registry.ensure(request.model)  # a pinned step not loaded: load it now
        target = self.registry.resolve(request.model)
        events = self._stream(request, raw, identity, request_id, target, time.perf_counter(), wire)
        first = await events.__anext__()  # raises the engine's error when no chunk came before it
        return prepend_first(first, events), target

    async def _stream(
        self,
        request: ChatCompletionRequest,
        raw: dict,
        identity: Identity,
        request_id: str,
        resolved: Target,
        started: float,
        wire: Wire | None = None,
    ) -> AsyncIterator[bytes]:
        """Yields SSE `data` payloads; `[DONE]` only after the call row is committed."""
        import orjson

        accumulator = StreamAccumulator()
        tokens: TokenRecord | None = None
        error: RLProxyError | None = None
        finished = False
        yielded = False
        target: Target | None = resolved
        try:
            async with self.gate.passage(), self.registry.hold(resolved):
                body = engine_body(request, raw, target)
                async for item in self.engine.stream(
                    EngineRequest(body=body, adapter=target.adapter, request_id=request_id)
                ):
                    if isinstance(item, StreamEnd):
                        tokens = item.tokens
                        break
                    item.data["model"] = request.model
                    accumulator.add(item.data)
                    yielded = True
                    yield orjson.dumps(item.data)
            finished = True
        except RLProxyError as exc:
            error = exc
        finally:
            if not finished and error is None:
                # The client went away (or we were cancelled): still record what was sent.
                error = ClientGone("stream ended early: the client disconnected")
                record = self._record(
                    request_id=request_id,
                    identity=identity,
                    raw=raw,
                    target=target,
                    stream=True,
                    started=started,
                    response=accumulator.response(),
                    tokens=tokens,
                    error=error,
                    wire=wire,
                )
                await asyncio.shield(self._commit(record))
        record = self._record(
            request_id=request_id,
            identity=identity,
            raw=raw,
            target=target,
            stream=True,
            started=started,
            response=accumulator.response(),
            tokens=tokens,
            error=error,
            wire=wire,
        )
        try:
            await self._commit(record)
        except StoreUnavailable as store_error:
            if not yielded:
                raise
            # Chunks went out, but the call is not on disk: no `[DONE]`, so the client does not
            # take it for a finished call; the error event says why.
            yield orjson.dumps(store_error.to_openai())
            return
        if error is not None:
            if not yielded:
                raise error  # nothing sent yet: open_stream turns it into an HTTP error
            yield orjson.dumps(error.to_openai())
        yield b"[DONE]"


async def prepend_first(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`first` (already awaited, so errors before it became HTTP errors), then the rest."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()  # a client that left mid-stream still gets its call recorded, now


class StreamAccumulator:
    """Rebuilds the chat.completion a stream amounts to, for the record."""

    def __init__(self) -> None:
        self.meta: dict = {}
        self.choices: dict[int, dict] = {}
        self.usage: dict | None = None

    def add(self, chunk: dict) -> None:
        if not self.meta:
            self.meta = {k: chunk.get(k) for k in ("id", "created", "model", "system_fingerprint")}
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for delta_choice in chunk.get("choices") or []:
            index = delta_choice.get("index", 0)
            choice = self.choices.setdefault(
                index, {"index": index, "message": {"role": "assistant", "content": None}, "finish_reason": None}
            )
            delta = delta_choice.get("delta") or {}
            message = choice["message"]
            if delta.get("content"):
                message["content"] = (message["content"] or "") + delta["content"]
            for call_delta in delta.get("tool_calls") or []:
                calls = message.setdefault("tool_calls", [])
                position = call_delta.get("index", len(calls))
                while len(calls) <= position:
                    calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                call = calls[position]
                if call_delta.get("id"):
                    call["id"] = call_delta["id"]
                function = call_delta.get("function") or {}
                if function.get("name"):
                    call["function"]["name"] += function["name"]
                if function.get("arguments"):
                    call["function"]["arguments"] += function["arguments"]
            if delta_choice.get("logprobs") and delta_choice["logprobs"].get("content"):
                choice.setdefault("logprobs", {"content": []})["content"].extend(delta_choice["logprobs"]["content"])
            if delta_choice.get("finish_reason"):
                choice["finish_reason"] = delta_choice["finish_reason"]

    def response(self) -> dict:
        return {
            **self.meta,
            "object": "chat.completion",
            "choices": [self.choices[i] for i in sorted(self.choices)],
            "usage": self.usage,
        }
