"""The legacy completions request body and its ids: what the protocol itself defines."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.protocols.chat import OPENAI_MAX_STOPS, Whole

PROTOCOL = "completions"


class CompletionRequest(BaseModel):
    """The request body, in the order of OpenAI's reference; unknown fields pass through."""

    model_config = ConfigDict(extra="allow")

    model: str
    prompt: str | list[str] = Field(description="a string, or a list of strings answered one by one")
    best_of: Whole | None = Field(default=None, ge=1)
    echo: bool = False
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logprobs: Whole | None = Field(default=None, ge=0, le=5)
    max_tokens: Whole | None = Field(default=16, ge=1)
    metadata: dict[str, Any] | None = None
    n: Whole = Field(default=1, ge=1, le=128)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    seed: Whole | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    suffix: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        # OpenAI's reference gives completions chat's limit of 4; the chat form it is translated
        # into takes up to MAX_STOPS (for Anthropic's), so the limit is held here, as chat holds its own.
        if isinstance(value, list) and len(value) > OPENAI_MAX_STOPS:
            raise ValueError(f"'stop' takes at most {OPENAI_MAX_STOPS} sequences")
        return value

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError(
                "'echo' is not supported: rlproxy answers completions through the chat form, which "
                "does not return the prompt; drop 'echo' and prepend the prompt yourself"
            )
        if self.suffix:
            raise ValueError("'suffix' (insertion) is not supported: rlproxy's models only continue a prompt")
        if self.best_of not in (None, self.n):
            raise ValueError("'best_of' other than 'n' is not supported: ask for 'n' choices and pick yourself")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("'prompt' is an empty list: give a string or at least one string")
        if isinstance(self.prompt, list) and len(self.prompt) > 1 and self.stream:
            raise ValueError("a stream takes one prompt: send a string, or one request per prompt")
        return self

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


def completion_id(request_id: str) -> str:
    return "cmpl-" + request_id.removeprefix("req_")
