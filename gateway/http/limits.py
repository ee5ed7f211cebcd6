"""The gateway's limits on what one request may ask for, each refused with an error that
names the limit and the flag that sets it.

- `BodyLimitMiddleware`: the body's size (`--max-body-mb`), from `Content-Length` before a
  byte is read, and counted while a chunked body arrives (413).
- `check_chat_limits`: messages (`--max-messages`), `n` (`--max-n`), and the completion
  tokens asked for against the engine's context (400).
- `check_prompt_list`: legacy completions' prompt list, one engine call per prompt, so its
  prompts times `n` count against `--max-n` (400).
- `check_room`: a prompt of so many tokens, and the completion tokens asked for, against the
  engine's context (400 `context_length_exceeded`), once the engine has counted it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import InvalidRequest, RequestTooLarge
from gateway.http.errors import error_response

_MB = 1024 * 1024


@dataclass(frozen=True)
class Limits:
    max_body_mb: float = 32.0
    max_messages: int = 2048
    max_n: int = 128

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * _MB)

    @classmethod
    def from_settings(cls, settings) -> Limits:
        return cls(max_body_mb=settings.max_body_mb, max_messages=settings.max_messages, max_n=settings.max_n)


def body_too_large(limit_mb: float, size: int | None = None) -> RequestTooLarge:
    got = f"the request body is {size / _MB:.1f} MB" if size is not None else "the request body is larger"
    return RequestTooLarge(
        f"{got}, over the gateway's limit of {limit_mb:g} MB (--max-body-mb): "
        "send less (fewer or shorter messages, smaller images), or raise --max-body-mb",
        code="request_too_large",
    )


class BodyLimitMiddleware:
    """Refuses bodies over `limit_mb` with 413 and OpenAI's error shape.

    A `Content-Length` over the limit is answered before the body is read; a chunked body
    is counted as it arrives, and the app's next `receive()` raises `RequestTooLarge` once
    it passes the limit (the chat endpoint and FastAPI's handler turn that into the 413), so
    a 60 MB upload is never held in memory whole."""

    def __init__(self, app: ASGIApp, limit_mb: float):
        self.app = app
        self.limit_mb = limit_mb
        self.limit = int(limit_mb * _MB)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    size = int(value)
                except ValueError:
                    await error_response(scope["path"], InvalidRequest("the Content-Length header is not a number"))(
                        scope, receive, send
                    )
                    return
                if size > self.limit:  # in the route's protocol's shape; the connection closes (error_response)
                    await error_response(scope["path"], body_too_large(self.limit_mb, size))(scope, receive, send)
                    return
                # Within the limit, and the server will not deliver more than it says.
                await self.app(scope, receive, send)
                return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise body_too_large(self.limit_mb)
            return message

        await self.app(scope, counting_receive, send)


def check_chat_limits(request, limits: Limits, context_length: int | None) -> None:
    """Refuse a chat request over the gateway's limits (400, naming the limit)."""
    if len(request.messages) > limits.max_messages:
        raise InvalidRequest(
            f"'messages' has {len(request.messages)} messages, over the gateway's limit of {limits.max_messages} "
            "(--max-messages): shorten the conversation",
            param="messages",
            code="too_many_messages",
        )
    if request.n > limits.max_n:
        raise InvalidRequest(
            f"'n' is {request.n}, over the gateway's limit of {limits.max_n} choices per request (--max-n): "
            "ask for fewer, or send several requests",
            param="n",
            code="n_too_large",
        )
    asked = request.max_completion_tokens or request.max_tokens
    if context_length and asked is not None and asked >= context_length:
        field = "max_completion_tokens" if request.max_completion_tokens else "max_tokens"
        raise InvalidRequest(
            f"'{field}' is {asked}, but the model's context is {context_length} tokens, prompt included: "
            f"ask for fewer than {context_length} tokens",
            param=field,
            code="context_length_exceeded",
        )


def check_prompt_list(prompts: int, n: int, limits: Limits) -> None:
    """Refuse a legacy completions prompt list whose prompts x `n` choices pass `--max-n`: each
    prompt is an engine call of its own, so a long list is as much work as a large `n`."""
    if prompts * n > limits.max_n:
        raise InvalidRequest(
            f"'prompt' has {prompts} prompts x 'n' {n} = {prompts * n} choices, over the gateway's limit of "
            f"{limits.max_n} choices per request (--max-n): send fewer prompts per request, or raise --max-n",
            param="prompt",
            code="too_many_prompts",
        )


@contextlib.contextmanager
def prompt_of_list(index: int) -> Iterator[None]:
    """A 400 about one prompt of a legacy completions list says which: `'prompt'[2]: ...`."""
    try:
        yield
    except InvalidRequest as exc:
        exc.message = f"'prompt'[{index}]: {exc.message}"
        exc.args = (exc.message,)
        raise


def check_room(prompt_tokens: int, limit: int | None, field: str, context: int) -> int:
    """The room `context` leaves a completion after a prompt of `prompt_tokens`; refuses a prompt
    that leaves none, or less than the `limit` the request asked for in `field`."""
    room = context - prompt_tokens
    if room < 1 or (limit is not None and limit > room):
        asked = f" + {limit} completion tokens" if limit is not None else ""
        lower = f" or lower '{field}'" if limit is not None else ""
        # fields quoted: `in_client_terms` names them as another protocol's client wrote them ('input', 'prompt')
        raise InvalidRequest(
            f"this model's context is {context} tokens; the prompt ('messages') takes {prompt_tokens} "
            f"tokens{asked}. Shorten 'messages'{lower}.",
            param="messages",
            code="context_length_exceeded",
        )
    return room
