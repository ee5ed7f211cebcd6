"""The internal chat form: OpenAI Chat Completions' wire models, in the order of OpenAI's
API reference. Every other protocol translates to and from it.

Free of torch and engine imports. Unknown OpenAI fields pass through
(`extra="allow"`) so a newer client never gets a 400 for a field we do not know.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictFloat, field_validator, model_validator


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


def _not_a_bool(value: Any) -> Any:
    # pydantic reads true as 1: {"max_tokens": true} was answered with one token, {"n": false} refused as 0
    if isinstance(value, bool):
        raise ValueError(f"expected a whole number, not {str(value).lower()}")
    return value


Whole = Annotated[int, BeforeValidator(_not_a_bool)]
"""A count or a seed in a request body: an integer, never `true` or `false` read as one."""


# ---------------------------------------------------------------- chat requests


class FunctionCall(_Open):
    name: str
    arguments: str = "{}"


class ToolCall(_Open):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_hold_text(cls, content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        # Other parts (images, audio) are the engine's to take or refuse; a text part's text is ours to read.
        for j, part in enumerate(content if isinstance(content, list) else []):
            text = part.get("text", "")
            if part.get("type", "text") == "text" and not isinstance(text, str):
                raise ValueError(f"part {j}'s 'text' must be a string, not {type(text).__name__}")
        return content

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs 'tool_call_id' (the id of the tool call it answers)")
        if self.role in ("system", "developer", "user") and self.content is None:
            raise ValueError(f"a message with role '{self.role}' needs 'content'")
        return self

    def text(self) -> str:
        """Content as plain text (text parts joined), for templates and judges."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.get("text", "") for part in self.content if part.get("type", "text") == "text")


class FunctionDefinition(_Open):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(_Open):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class StreamOptions(_Open):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (engines with `continuous_usage`)


# OpenAI's limit on `stop`, kept where clients speak OpenAI's chat or completions; the engines take
# more (vLLM has no limit, the local engine looks for each at every token), and Anthropic's
# stop_sequences have no limit of 4, so the chat form a protocol is translated into takes up to MAX_STOPS.
OPENAI_MAX_STOPS = 4
MAX_STOPS = 64


class ChatCompletionRequest(_Open):
    max_stops: ClassVar[int] = OPENAI_MAX_STOPS

    messages: list[ChatMessage] = Field(min_length=1)
    model: str
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logprobs: bool = False
    max_completion_tokens: Whole | None = Field(default=None, ge=1)
    max_tokens: Whole | None = Field(default=None, ge=1)
    metadata: dict[str, Any] | None = None
    n: Whole = Field(default=1, ge=1, le=128)
    parallel_tool_calls: bool | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    response_format: dict[str, Any] | None = None
    seed: Whole | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    tool_choice: str | dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    top_logprobs: Whole | None = Field(default=None, ge=0, le=20)
    top_p: float | None = Field(default=None, gt=0, le=1)
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > cls.max_stops:
            raise ValueError(f"'stop' takes at most {cls.max_stops} sequences")
        return stops

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("'top_logprobs' needs 'logprobs': true")
        if isinstance(self.tool_choice, str) and self.tool_choice not in ("none", "auto", "required"):
            raise ValueError("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', ...}")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("'tool_choice' needs 'tools'")
        if isinstance(self.tool_choice, dict):
            named = self.tool_choice.get("function")
            name = named.get("name") if isinstance(named, dict) else None
            if self.tool_choice.get("type") != "function" or not isinstance(name, str):
                raise ValueError("'tool_choice' as an object is {'type': 'function', 'function': {'name': ...}}")
            offered = [tool.function.name for tool in self.tools or []]
            if name not in offered:
                raise ValueError(f"'tool_choice' names '{name[:64]}', which is not in 'tools' ({', '.join(offered)})")
        return self

    def token_limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class EngineChatRequest(ChatCompletionRequest):
    """The chat form as the gateway hands it on: another protocol's request translated (its
    limits are its own), or the body an engine takes. Up to MAX_STOPS stop strings."""

    max_stops: ClassVar[int] = MAX_STOPS


# ---------------------------------------------------------------- rlproxy's own

# Bounds on what rlproxy's own routes keep: a reward's metrics are stored with its session and
# returned by every list page that holds it, and a rubric goes into every judge prompt. Room for
# any real use (a few dozen named numbers, a page of criteria), nothing like megabytes.
MAX_METRICS = 64  # a session keeps as many, rewards merged (MAX_SESSION_METRICS in gateway/store/rows.py)
MAX_METRIC_NAME_CHARS = 128
MAX_RUBRIC_CHARS = 32 * 1024
# GRPO uses only a reward's place within its group; beyond this a group's variance overflows a float.
MAX_ABS_REWARD = 1e6


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: StrictFloat  # a number: true or "1.0" is a client's bug, not a reward
    metrics: dict[str, StrictFloat] = Field(default_factory=dict, max_length=MAX_METRICS)  # true is no metric

    @field_validator("reward")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("'reward' must be a finite number (not NaN or infinity)")
        if abs(value) > MAX_ABS_REWARD:
            raise ValueError(
                f"'reward' {value:g} is beyond +-{MAX_ABS_REWARD:g}: training uses only how rewards in a group "
                "compare, so scale them down (to 0..1, say)"
            )
        return value

    @field_validator("metrics", mode="before")
    @classmethod
    def _few_metrics(cls, value: Any) -> Any:
        if isinstance(value, dict) and len(value) > MAX_METRICS:
            raise ValueError(
                f"'metrics' has {len(value)} metrics, over the limit of {MAX_METRICS}: "
                "send the few that matter (aggregate the rest, or log them elsewhere)"
            )
        return value

    @field_validator("metrics")
    @classmethod
    def _finite_metrics(cls, value: dict[str, float]) -> dict[str, float]:
        for name, metric in value.items():
            if len(name) > MAX_METRIC_NAME_CHARS:
                raise ValueError(
                    f"metric name '{name[:40]}...' is {len(name)} characters, over the limit of "
                    f"{MAX_METRIC_NAME_CHARS}: use a shorter name"
                )
            if not math.isfinite(metric):
                raise ValueError(f"metric '{name}' must be a finite number")
        return value


class GroupCloseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    expected_sessions: Whole | None = Field(default=None, ge=1)


class DiscardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str | None = Field(default=None, max_length=2000)


class RulerRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    judge_model: str = Field(min_length=1)
    rubric: str | None = Field(default=None, max_length=MAX_RUBRIC_CHARS)
    judge_api_base: str | None = None


class TriggerRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None


class StepDecisionRequest(BaseModel):
    """POST /v1/training/steps/{n}/promote or /reject: the model the step is of, and why."""

    model_config = ConfigDict(extra="forbid")
    model: str
    reason: str | None = Field(None, max_length=2000)
