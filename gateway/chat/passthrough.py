"""Protocols relayed as they are to an upstream that speaks them (`--upstream-protocol`).

By default every protocol is translated to chat completions, so any chat upstream serves
it. With the `openai` engine, an upstream that speaks Responses, Messages or completions
itself may be given the client's body unchanged (only `model` and rlproxy's metadata keys
change), so nothing a translation cannot express is lost. The call is recorded as any
other: the protocol, the client's request and response, and the chat form of both (the
response translated back by the protocol's `to_chat_response`) for the trainer. A stream's
last event (or `[DONE]`) is held until the call row is committed, as for chat.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from types import ModuleType

import orjson

from gateway.chat.identity import Identity
from gateway.chat.service import ChatService
from gateway.chat.stream import prepend_first
from gateway.errors import ClientGone, RLProxyError, UpstreamError
from gateway.protocols import Wire
from gateway.protocols.completions import relay as completions_relay
from gateway.protocols.completions import wire as completions_wire
from gateway.protocols.messages import relay as messages_relay
from gateway.protocols.messages import wire as messages_wire
from gateway.protocols.responses import relay as responses_relay
from gateway.protocols.responses import wire as responses_wire

log = logging.getLogger("rlproxy.chat")

PATHS = {
    responses_wire.PROTOCOL: "/responses",
    messages_wire.PROTOCOL: "/messages",
    completions_wire.PROTOCOL: "/completions",
}
MODULES: dict[str, ModuleType] = {
    responses_wire.PROTOCOL: responses_relay,
    messages_wire.PROTOCOL: messages_relay,
    completions_wire.PROTOCOL: completions_relay,
}
_IDENTITY_KEYS = ("session_id", "group_id", "split")


def upstream_body(raw: dict, model: str) -> dict:
    body = {**raw, "model": model}
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and any(key in metadata for key in _IDENTITY_KEYS):
        rest = {k: v for k, v in metadata.items() if k not in _IDENTITY_KEYS}
        body.pop("metadata")
        if rest:
            body["metadata"] = rest
    return body


class PassThrough:
    def __init__(self, chat: ChatService, protocols: list[str]):
        self.chat = chat
        self.protocols = frozenset(protocols)

    def serves(self, protocol: str) -> bool:
        return protocol in self.protocols

    def _record(
        self, protocol, raw, chat_body, identity, request_id, target, stream, started, wire_response, error=None
    ):
        module = MODULES[protocol]
        chat_response = module.to_chat_response(wire_response) if wire_response is not None else None
        wire = Wire(protocol, raw, lambda _chat: wire_response)
        return self.chat.record(
            request_id=request_id,
            identity=identity,
            raw=chat_body,
            target=target,
            stream=stream,
            started=started,
            response=chat_response,
            tokens=None,
            error=error,
            wire=wire,
        )

    async def complete(
        self,
        protocol: str,
        raw: dict,
        chat_body: dict,
        identity: Identity,
        request_id: str,
        client_left: Callable[[], bool] | None = None,
    ):
        """As `ChatService.complete`: a client that left (`client_left()` once the answer is
        ready, or the route's cancellation) is recorded as 499."""
        started, target = time.perf_counter(), None
        try:
            async with self.chat.gate.passage(), self.chat.registry.use(raw["model"]) as target:
                answer = await self.chat.engine.relay(PATHS[protocol], upstream_body(raw, target.model))
            if client_left is not None and client_left():
                raise ClientGone()
        except RLProxyError as exc:
            await self.chat._commit(
                self._record(protocol, raw, chat_body, identity, request_id, target, False, started, None, exc)
            )
            raise
        except asyncio.CancelledError:
            await asyncio.shield(
                self.chat._commit(
                    self._record(
                        protocol, raw, chat_body, identity, request_id, target, False, started, None, ClientGone()
                    )
                )
            )
            raise
        answer["model"] = raw["model"]  # the client sees the name it asked for
        await self.chat._commit(
            self._record(protocol, raw, chat_body, identity, request_id, target, False, started, answer)
        )
        return answer, target

    async def count_tokens(self, raw: dict) -> dict:
        """Anthropic's `count_tokens`, asked of the upstream as it is: no model call, nothing recorded."""
        target = self.chat.registry.resolve(raw["model"])
        path = PATHS[messages_wire.PROTOCOL] + "/count_tokens"
        return await self.chat.engine.relay(path, upstream_body(raw, target.model))

    async def open_stream(self, protocol: str, raw: dict, chat_body: dict, identity: Identity, request_id: str):
        await self.chat.gate.wait()
        target = self.chat.registry.resolve(raw["model"])
        events = self._stream(protocol, raw, chat_body, identity, request_id, target, time.perf_counter())
        first = await events.__anext__()  # the upstream's refusal becomes the HTTP status, not a 200 stream
        return prepend_first(first, events), target

    async def _stream(self, protocol, raw, chat_body, identity, request_id, target, started) -> AsyncIterator[bytes]:
        """SSE frames; the last one only after the call row is committed."""
        accumulator = MODULES[protocol].Accumulator()
        held: bytes | None = None
        error: RLProxyError | None = None
        finished = False
        try:
            async with self.chat.registry.use(raw["model"]) as target:
                async for payload in self.chat.engine.relay_stream(PATHS[protocol], upstream_body(raw, target.model)):
                    kind = None
                    if payload != b"[DONE]":
                        event = _event(payload, PATHS[protocol])
                        kind = event.get("type") if protocol != completions_wire.PROTOCOL else None
                        accumulator.add(event)
                    if held is not None:
                        yield held
                    held = (b"event: " + kind.encode() + b"\n" if kind else b"") + b"data: " + payload + b"\n\n"
            finished = True
            if held is None:
                raise UpstreamError(f"the upstream's {PATHS[protocol]} stream ended without an event")
        except RLProxyError as exc:
            error = exc
        except Exception:  # a bug, not the client's leaving: a 500, recorded and told as one
            log.exception("unexpected error in a relayed stream")
            error = RLProxyError("internal error; see the gateway log")
        finally:
            if not finished and error is None:  # the client left: still record what was sent
                gone = ClientGone("stream ended early: the client disconnected")
                await asyncio.shield(
                    self.chat._commit(
                        self._record(
                            protocol,
                            raw,
                            chat_body,
                            identity,
                            request_id,
                            target,
                            True,
                            started,
                            accumulator.response,
                            gone,
                        )
                    )
                )
        await self.chat._commit(
            self._record(
                protocol,
                raw,
                chat_body,
                identity,
                request_id,
                target,
                True,
                started,
                accumulator.response if error is None else None,
                error,
            )
        )
        if error is not None:
            if held is None:
                raise error
            yield held
            body = (
                messages_wire.error_body(error.status_code, error.message)
                if protocol == messages_wire.PROTOCOL
                else error.to_openai()
            )
            yield b"event: error\ndata: " + orjson.dumps(body) + b"\n\n"
            return
        if held is not None:
            yield held


def _event(payload: bytes, path: str) -> dict:
    """One relayed event's JSON object; anything else is the upstream's fault, a 502 (it broke
    the stream with no error event, recorded as the client's leaving, when it went unchecked)."""
    try:
        event = orjson.loads(payload)
    except orjson.JSONDecodeError:
        event = None
    if not isinstance(event, dict):
        raise UpstreamError(
            f"the upstream's {path} stream sent an event that is not a JSON object ({len(payload)} bytes)"
        )
    return event
