"""The Responses API's request body, its ids and its error body: what the protocol itself defines."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.protocols.chat import Whole

PROTOCOL = "responses"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionTool(_Open):
    type: str = "function"
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextConfig(_Open):
    format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}


class ResponsesRequest(_Open):
    """The request body, in the order of OpenAI's reference; unknown fields pass through."""

    model: str
    input: str | list[dict[str, Any]] = Field(description="a string (one user message) or a list of input items")
    include: list[str] | None = None
    instructions: str | None = None
    max_output_tokens: Whole | None = Field(default=None, ge=1)
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=2)
    text: TextConfig | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[FunctionTool] | None = None
    top_logprobs: Whole | None = Field(default=None, ge=0, le=20)
    top_p: float | None = Field(default=None, gt=0, le=1)
    user: str | None = None


LOGPROBS = "message.output_text.logprobs"  # what `include` names to get each output token's logprob


# ------------------------------------------------------------------ ids


def response_id(request_id: str) -> str:
    """The response's id is the call row's key with another prefix, so the store finds it."""
    return "resp_" + request_id.removeprefix("req_")


def call_id_of(response_id_: str) -> str | None:
    """The call row key a response id names, or None if it is not one of ours."""
    if not response_id_.startswith("resp_") or len(response_id_) > 140:
        return None
    return "req_" + response_id_.removeprefix("resp_")


def error_body(message: str, error_type: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
