"""Anthropic's Messages request body, its ids and its error body: what the protocol itself defines."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.protocols.chat import MAX_STOPS, Whole

PROTOCOL = "messages"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Tool(_Open):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class Message(_Open):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(_Open):
    """The request body, in the order of Anthropic's reference; unknown fields pass through."""

    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: Whole = Field(ge=1)
    metadata: dict[str, Any] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOPS)
    stream: bool = False
    system: str | list[dict[str, Any]] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    tool_choice: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    top_k: Whole | None = Field(default=None, ge=1)
    top_p: float | None = Field(default=None, gt=0, le=1)


class CountTokensRequest(MessagesRequest):
    """`POST /v1/messages/count_tokens`: a message's body without `max_tokens` (nothing is generated)."""

    max_tokens: Whole | None = Field(default=None, ge=1)


# Anthropic's error types by HTTP status (its reference's table).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def error_body(status: int, message: str) -> dict:
    # A 4xx outside the table (405, 415) is still the request's fault: invalid_request_error.
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def message_id(request_id: str) -> str:
    return "msg_" + request_id.removeprefix("req_")
