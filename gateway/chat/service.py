"""The chat service: identify the session, route to an adapter, call the engine, record.

Routes stay thin; everything a chat completion does lives here. A response is
handed back only after its call row is committed (the stream's `[DONE]` too).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from gateway.adapters import AdapterRegistry, Target
from gateway.chat.gate import RequestGate
from gateway.chat.identity import IDENTITY_KEYS, Identity, canary_key
from gateway.chat.record import SplitGuard, call_record
from gateway.chat.stream import StreamAccumulator, prepend_first
from gateway.engines.base import Engine, EngineRequest, StreamEnd, TokenRecord
from gateway.errors import ClientGone, RLProxyError, StoreUnavailable
from gateway.http.limits import Limits, check_chat_limits
from gateway.protocols import Wire
from gateway.protocols.chat import ChatCompletionRequest
from gateway.store import CallRecord, Store
from gateway.store.waits import recheck

log = logging.getLogger("rlproxy.chat")


def engine_body(request: ChatCompletionRequest, raw: dict, target: Target) -> dict:
    """The body the engine sees: the client's, minus rlproxy's metadata keys, with the target model."""
    body = dict(raw)
    body["model"] = target.model
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and any(key in metadata for key in IDENTITY_KEYS):
        rest = {k: v for k, v in metadata.items() if k not in IDENTITY_KEYS}
        if rest:
            body["metadata"] = rest
        else:
            body.pop("metadata")
    if request.stop is not None:
        body["stop"] = request.stop
    return body


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
        self.splits = SplitGuard()

    def record(self, **fields: Any) -> CallRecord:
        # Called with every field spelt out, never through a closure made per request: one
        # closure in `complete` cost ~10 % of the gateway's throughput at c=16 (bench/proxy.py).
        """The call's row (`call_record`), as this service's engine answered it. Its error is
        marked recorded: raised only once the row is committed, it is no refusal."""
        if fields.get("error") is not None:
            fields["error"].recorded = True
        return call_record(engine_kind=self.engine.kind, **fields)

    async def _commit(self, record: CallRecord) -> None:
        # No call in the engine: nobody to share a group commit with, so commit at once.
        await self.store.record_call(record, alone=self.gate.in_flight == 0)
        self.splits.remember(record)
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
        await recheck(self.store)

    async def _recall_step(self, request: ChatCompletionRequest, identity: Identity) -> None:
        """`--promote canary`: the step a session started on, from the store where this gateway
        has not seen the session yet (it restarted, or another replica served its calls)."""
        canary = self.registry.canary
        if canary is not None and request.model == self.registry.name:
            await canary.recall(canary_key(identity))

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
        self.splits.check(identity)

        try:
            async with self.gate.passage():
                await self._recall_step(request, identity)  # inside the gate: it may load a step
                async with self.registry.use(request.model, canary_key(identity)) as target:
                    completion = await self.engine.complete(
                        EngineRequest(
                            body=engine_body(request, raw, target),
                            adapter=target.adapter,
                            request_id=request_id,
                            session=identity.session_id,
                        )
                    )
            if client_left is not None and client_left():
                raise ClientGone()
        except RLProxyError as exc:
            await self._commit(
                self.record(
                    request_id=request_id,
                    identity=identity,
                    raw=raw,
                    target=target,
                    stream=False,
                    started=started,
                    wire=wire,
                    response=None,
                    tokens=None,
                    error=exc,
                )
            )
            raise
        except asyncio.CancelledError:
            # The route gave up on the call because its client left: recorded (499), never trained.
            await asyncio.shield(
                self._commit(
                    self.record(
                        request_id=request_id,
                        identity=identity,
                        raw=raw,
                        target=target,
                        stream=False,
                        started=started,
                        wire=wire,
                        response=None,
                        tokens=None,
                        error=ClientGone(),
                    )
                )
            )
            raise
        response = completion.response
        response["model"] = request.model  # the client sees the name it asked for
        await self._commit(
            self.record(
                request_id=request_id,
                identity=identity,
                raw=raw,
                target=target,
                stream=False,
                started=started,
                wire=wire,
                response=response,
                tokens=completion.tokens,
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
        self.splits.check(identity)
        await self.gate.wait()
        await self.registry.ensure(request.model)  # a pinned step not loaded: load it now
        await self._recall_step(request, identity)
        target = self.registry.resolve(request.model, canary_key(identity))
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

        def call_row(error: RLProxyError | None) -> CallRecord:
            """What was streamed so far, as the call's row (`tokens` once the engine sent them)."""
            return self.record(
                request_id=request_id,
                identity=identity,
                raw=raw,
                target=target,
                stream=True,
                started=started,
                wire=wire,
                response=accumulator.response(),
                tokens=tokens,
                error=error,
            )

        try:
            async with self.gate.passage(), self.registry.hold(resolved):
                body = engine_body(request, raw, target)
                async for item in self.engine.stream(
                    EngineRequest(body=body, adapter=target.adapter, request_id=request_id, session=identity.session_id)
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
        except Exception:
            # A bug, not the client's leaving: recorded as the 500 it is, and the client is told
            # in an error event rather than by a connection cut without one.
            log.exception("unexpected error in a chat stream")
            error = RLProxyError("internal error; see the gateway log")
        finally:
            if not finished and error is None:
                # The client went away (or we were cancelled): still record what was sent.
                error = ClientGone("stream ended early: the client disconnected")
                await asyncio.shield(self._commit(call_row(error)))
        try:
            await self._commit(call_row(error))
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
            # The error event ends the stream, with no `[DONE]` after it: a client that reads
            # `[DONE]` as "the answer is complete" must not take a cut-off answer for a whole one
            # (the other protocols' streams end at their error event too).
            yield orjson.dumps(error.to_openai())
            return
        yield b"[DONE]"
