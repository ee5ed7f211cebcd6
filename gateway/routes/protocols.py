"""Routes for the protocols other than chat: Responses, Anthropic Messages, legacy completions.

Thin: parse the body (its model is the route's request schema in /openapi.json), translate
to the chat form (`gateway.protocols.*`), hand it to the chat service with a `Wire` so the
call row keeps what the client sent and got, and translate the answer (or the stream)
back. Errors leave in each protocol's own shape (`gateway.http.errors.error_response`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from gateway.chat.identity import Identity, identify
from gateway.errors import ClientGone, InvalidRequest, MethodNotAllowed, NotFound
from gateway.http.errors import invalid_body
from gateway.http.limits import check_prompt_list, prompt_of_list
from gateway.protocols import Wire, in_client_terms
from gateway.protocols.chat import ChatCompletionRequest, EngineChatRequest
from gateway.protocols.completions import stream as completions_stream
from gateway.protocols.completions import translate as completions_translate
from gateway.protocols.completions import wire as completions_wire
from gateway.protocols.messages import stream as messages_stream
from gateway.protocols.messages import translate as messages_translate
from gateway.protocols.messages import wire as messages_wire
from gateway.protocols.responses import stream as responses_stream
from gateway.protocols.responses import translate as responses_translate
from gateway.protocols.responses import wire as responses_wire
from gateway.routes.client_watch import ClientWatch
from gateway.routes.openai import read_json
from gateway.store.waits import read_within

router = APIRouter()

_IDENTITY_HEADERS = ("x-session-id", "x-group-id", "x-task-id", "x-split", "x-request-id")
_UPSTREAM_ID = re.compile(r"[A-Za-z0-9_-]{1,200}")


def _json(data: Any, status_code: int = 200, headers: dict | None = None) -> Response:
    """JSON by orjson (a tenth of the stdlib's cost, as on the chat route)."""
    return Response(orjson.dumps(data), status_code=status_code, headers=headers, media_type="application/json")


def _headers(session_id: str, step: int | None) -> dict[str, str]:
    headers = {"X-Session-Id": session_id}
    if step is not None:
        headers["X-Model-Step"] = str(step)
    return headers


def _identity(request: Request, raw: dict) -> Identity:
    return identify({name: request.headers[name] for name in _IDENTITY_HEADERS if name in request.headers}, raw)


def _reparsed(model: type[BaseModel], raw: dict) -> Any:
    """The body again, from the orjson parse the record is made of: FastAPI's stdlib parse keeps
    integers past 64 bits, which no JSON encoder downstream (orjson, the store) can write back."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise invalid_body(exc.errors(), raw) from None


_CHAT_FIELDS = {
    responses_wire.PROTOCOL: responses_translate.CHAT_FIELDS,
    messages_wire.PROTOCOL: messages_translate.CHAT_FIELDS,
    completions_wire.PROTOCOL: completions_translate.CHAT_FIELDS,
}


@contextlib.contextmanager
def _client_terms(protocol: str) -> Iterator[None]:
    """A 400 about the translated chat request names the client's fields, not chat's: a Responses
    client sent `max_output_tokens`, and an error about `max_tokens` would send it looking for a
    field it never wrote."""
    try:
        yield
    except InvalidRequest as exc:
        in_client_terms(exc, _CHAT_FIELDS[protocol])
        raise


def _chat_request(body: dict) -> ChatCompletionRequest:
    try:
        return EngineChatRequest.model_validate(body)  # the translated form: the protocol's own limits held
    except ValidationError as exc:
        raise invalid_body(exc.errors(), body) from None  # named in the client's terms by _client_terms


class _Encoder:
    """What a protocol's stream encoder offers (`ResponsesStream`, `MessagesStream`, `CompletionsStream`)."""

    start: Callable[[], list]
    chunk: Callable[[dict], list]
    finish: Callable[[], list]
    error: Callable[[dict], list]


def _frame(kind: str | None, data: bytes) -> bytes:
    return (b"event: " + kind.encode() + b"\n" if kind else b"") + b"data: " + data + b"\n\n"


async def _encode(events: AsyncIterator[bytes], encoder: _Encoder) -> AsyncIterator[bytes]:
    """Chat SSE payloads (the chat service's, `[DONE]` last and only once recorded) re-encoded."""
    failed = False
    try:
        for kind, data in encoder.start():
            yield _frame(kind, data)
        async for payload in events:
            if payload == b"[DONE]":
                if not failed:
                    for kind, data in encoder.finish():
                        yield _frame(kind, data)
                continue
            chunk = orjson.loads(payload)
            if "error" in chunk and "choices" not in chunk:
                failed = True
                produced = encoder.error(chunk)
            else:
                produced = encoder.chunk(chunk)
            for kind, data in produced:
                yield _frame(kind, data)
    finally:
        await events.aclose()  # records a stream the client left early


def _relayed(request: Request, protocol: str) -> bool:
    """Whether an upstream that speaks `protocol` itself answers it (`--upstream-protocol`)."""
    relay = request.app.state.services.extras.get("passthrough")
    return relay is not None and relay.serves(protocol)


async def _serve(
    request: Request,
    chat_body: dict,
    identity: Identity,
    wire: Wire,
    to_wire: Callable[[dict], dict],
    encoder: Callable[[], _Encoder],
    stream: bool,
) -> Response:
    services = request.app.state.services
    request_id = request.scope["state"]["request_id"]
    relay = services.extras.get("passthrough")
    if relay is not None and relay.serves(wire.protocol):  # --upstream-protocol: the upstream speaks it
        if not stream:
            watch = ClientWatch(request.receive)
            try:
                answer, target = await watch.run(
                    relay.complete(wire.protocol, wire.request, chat_body, identity, request_id, client_left=watch.left)
                )
            except ClientGone:
                return Response(status_code=499)  # recorded as 499; nobody reads this
            return _json(answer, headers=_headers(identity.session_id, target.step))
        frames, target = await relay.open_stream(wire.protocol, wire.request, chat_body, identity, request_id)
        return StreamingResponse(
            frames,
            media_type="text/event-stream",
            headers={**_headers(identity.session_id, target.step), "Cache-Control": "no-cache"},
        )
    if stream:
        options = {"include_usage": True}
        if wire.protocol == messages_wire.PROTOCOL and services.engine.continuous_usage:
            options["continuous_usage_stats"] = True  # message_start reports the prompt's tokens
        chat_body = {**chat_body, "stream": True, "stream_options": options}
    with _client_terms(wire.protocol):
        chat_request = _chat_request(chat_body)
        if not stream:
            watch = ClientWatch(request.receive)
            try:
                response, target = await watch.run(
                    services.chat.complete(chat_request, chat_body, identity, request_id, wire, client_left=watch.left)
                )
            except ClientGone:
                return Response(status_code=499)  # recorded as 499; nobody reads this

            return _json(to_wire(response), headers=_headers(identity.session_id, target.step))
        events, target = await services.chat.open_stream(chat_request, chat_body, identity, request_id, wire)
    return StreamingResponse(
        _encode(events, encoder()),
        media_type="text/event-stream",
        headers={**_headers(identity.session_id, target.step), "Cache-Control": "no-cache"},
    )


# ------------------------------------------------------------------ OpenAI Responses


def _stored_response(store: Any, resp_id: str) -> dict:
    call_id = responses_wire.call_id_of(resp_id)
    row = store.get_call(call_id) if call_id else None
    if row is None or row.get("protocol") != responses_wire.PROTOCOL or row.get("status") != "ok":
        raise NotFound(
            f"response '{resp_id[:80]}' not found: use the id of a completed response from this gateway",
            param="response_id",
        )
    return row


@router.post("/v1/responses", summary="Create a model response (OpenAI Responses API)")
async def create_response(request: Request) -> Response:
    raw = await read_json(request)
    body = _reparsed(responses_wire.ResponsesRequest, raw)
    identity = _identity(request, raw)
    history = None
    # Relayed (--upstream-protocol responses), response ids are the upstream's: it serves the chain.
    if body.previous_response_id and not _relayed(request, responses_wire.PROTOCOL):
        store = request.app.state.services.store
        previous = await read_within(store, _stored_response, store, body.previous_response_id)
        history = responses_translate.history_of(previous["request"], previous["wire_request"], previous["response"])
        if identity.minted:  # a conversation continued by id stays in its session
            identity = dataclasses.replace(
                identity,
                session_id=previous["session_id"],
                group_id=identity.group_id or previous["group_id"],
                minted=False,
            )
    resp_id = responses_wire.response_id(request.scope["state"]["request_id"])

    def to_wire(chat_response: dict) -> dict:
        return responses_translate.from_chat(chat_response, raw, resp_id)

    wire = Wire(responses_wire.PROTOCOL, raw, to_wire)
    return await _serve(
        request,
        responses_translate.to_chat(body, history),
        identity,
        wire,
        to_wire,
        lambda: responses_stream.ResponsesStream(raw, resp_id),
        body.stream,
    )


@router.get("/v1/responses/{response_id}", summary="Retrieve a stored response")
async def get_response(response_id: str, request: Request) -> Response:
    services = request.app.state.services
    relay = services.extras.get("passthrough")
    try:
        row = await read_within(services.store, _stored_response, services.store, response_id)
        return _json(row["wire_response"])
    except NotFound:
        # --upstream-protocol responses: the ids are the upstream's, so ask it (the id is
        # checked before it becomes part of a URL)
        if relay is None or not relay.serves(responses_wire.PROTOCOL) or not _UPSTREAM_ID.fullmatch(response_id):
            raise
    return _json(await services.engine.relay(f"/responses/{response_id}", None))


@router.delete("/v1/responses/{response_id}", summary="Delete a stored response (an upstream's, when relayed)")
async def delete_response(response_id: str, request: Request) -> Response:
    """Relayed (`--upstream-protocol responses`), the response is the upstream's: it deletes it.
    Otherwise the response is a call of a session, kept as training data: a 405 that says how
    to keep it out of training instead (a 404 for an id that is not a response of this gateway)."""
    services = request.app.state.services
    relay = services.extras.get("passthrough")
    if relay is not None and relay.serves(responses_wire.PROTOCOL) and _UPSTREAM_ID.fullmatch(response_id):
        return _json(await services.engine.relay(f"/responses/{response_id}", None, method="DELETE"))
    row = await read_within(services.store, _stored_response, services.store, response_id)
    raise MethodNotAllowed(
        f"response '{response_id}' is not deleted: rlproxy keeps every call as its session's training data. "
        f"To keep it out of training, discard its session: POST /v1/sessions/{row['session_id']}/discard",
        param="response_id",
        code="response_not_deletable",
    )


# ------------------------------------------------------------------ Anthropic Messages


@router.post("/v1/messages", summary="Create a message (Anthropic Messages API)")
async def create_message(request: Request) -> Response:
    raw = await read_json(request)
    body = _reparsed(messages_wire.MessagesRequest, raw)
    if not _relayed(request, messages_wire.PROTOCOL):
        messages_translate.refuse_builtin_tools(body)
    identity = _identity(request, raw)
    msg_id = messages_wire.message_id(request.scope["state"]["request_id"])

    def to_wire(chat_response: dict) -> dict:
        return messages_translate.from_chat(chat_response, raw, msg_id)

    wire = Wire(messages_wire.PROTOCOL, raw, to_wire)
    return await _serve(
        request,
        messages_translate.to_chat(body),
        identity,
        wire,
        to_wire,
        lambda: messages_stream.MessagesStream(raw, msg_id),
        body.stream,
    )


@router.post("/v1/messages/count_tokens", summary="Count a message's input tokens (Anthropic Messages API)")
async def count_message_tokens(request: Request) -> Response:
    """The input tokens `POST /v1/messages` with this body would take: the served model's chat
    template and tokenizer over it, tools included. Not a model call: nothing is recorded."""
    raw = await read_json(request)
    body = _reparsed(messages_wire.CountTokensRequest, raw)
    services = request.app.state.services
    if _relayed(request, messages_wire.PROTOCOL):
        return _json(await services.extras["passthrough"].count_tokens(raw))
    messages_translate.refuse_builtin_tools(body)
    services.registry.resolve(body.model)  # a model this gateway does not serve is a 404, as on /v1/messages
    chat_body = {key: value for key, value in messages_translate.to_chat(body).items() if value is not None}
    with _client_terms(messages_wire.PROTOCOL):
        _chat_request(chat_body)
        count = await services.engine.count_tokens(chat_body)
    return _json({"input_tokens": count})


# ------------------------------------------------------------------ legacy completions


@router.post("/v1/completions", summary="Create a completion (legacy completions)")
async def create_completion(request: Request) -> Response:
    raw = await read_json(request)
    body = _reparsed(completions_wire.CompletionRequest, raw)
    identity = _identity(request, raw)
    request_id = request.scope["state"]["request_id"]
    cmpl_id = completions_wire.completion_id(request_id)
    prompts = body.prompts()
    services = request.app.state.services
    if len(prompts) > 1:
        check_prompt_list(len(prompts), body.n, services.chat.limits)
    if len(prompts) == 1:

        def to_wire(chat_response: dict) -> dict:
            return completions_translate.from_chat(chat_response, raw, cmpl_id)

        wire = Wire(completions_wire.PROTOCOL, raw, to_wire)
        return await _serve(
            request,
            completions_translate.to_chat(body, prompts[0]),
            identity,
            wire,
            to_wire,
            lambda: completions_stream.CompletionsStream(raw, cmpl_id),
            body.stream,
        )
    # Every prompt fits, or none is answered: one refused after those before it were answered and
    # recorded would leave answers the client never got in its session, trained with its reward.
    for i, prompt in enumerate(prompts):
        with _client_terms(completions_wire.PROTOCOL):
            chat_body = completions_translate.to_chat(body, prompt)
            _chat_request(chat_body)  # the body's own errors first, named as a single prompt's are
            with prompt_of_list(i):
                await services.chat.engine.check_fits(chat_body)
    # Several prompts: one call row each (the first under the request's id), choices numbered across them.
    # Each call is watched like a single one, and its answer ends in a look at the client, so a
    # client that left cancels the call in flight (recorded as 499) and no later prompt starts.
    answers, step = [], None
    for i, prompt in enumerate(prompts):
        first = i * body.n

        def to_wire(chat_response: dict, first: int = first) -> dict:
            return completions_translate.from_chat(chat_response, raw, cmpl_id, first_index=first)

        chat_body = completions_translate.to_chat(body, prompt)
        call_id = request_id if i == 0 else f"{request_id}.{i}"
        watch = ClientWatch(request.receive)
        try:
            with _client_terms(completions_wire.PROTOCOL):
                response, target = await watch.run(
                    services.chat.complete(
                        _chat_request(chat_body),
                        chat_body,
                        identity,
                        call_id,
                        Wire(completions_wire.PROTOCOL, raw, to_wire),
                        client_left=watch.left,
                    )
                )
        except ClientGone:
            return Response(status_code=499)  # recorded as 499; nobody reads this
        answers.append(to_wire(response))
        step = target.step
    return _json(completions_translate.merge(answers), headers=_headers(identity.session_id, step))
