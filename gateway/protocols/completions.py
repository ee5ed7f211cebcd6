"""Legacy completions (`POST /v1/completions`) in terms of chat completions.

The prompt goes in as one user message: the engines and the trainer know only the chat
form, and a chat-only upstream has nothing else. So the model sees the prompt through its
chat template, not as raw text to continue; `echo` and `suffix` cannot be honoured that
way and are refused with a 400. A list of prompts is answered prompt by prompt (one call
row each), choices numbered across them as OpenAI does; a stream takes one prompt.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.protocols import text_of

PROTOCOL = "completions"


class CompletionRequest(BaseModel):
    """The request body, in the order of OpenAI's reference; unknown fields pass through."""

    model_config = ConfigDict(extra="allow")

    model: str
    prompt: str | list[str] = Field(description="a string, or a list of strings answered one by one")
    best_of: int | None = Field(default=None, ge=1)
    echo: bool = False
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    max_tokens: int | None = Field(default=16, ge=1)
    metadata: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=128)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    suffix: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    user: str | None = None

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


def to_chat(request: CompletionRequest, prompt: str) -> dict:
    body: dict[str, Any] = {"model": request.model, "messages": [{"role": "user", "content": prompt}], "n": request.n}
    for name in (
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "metadata",
    ):
        if (value := getattr(request, name)) is not None:
            body[name] = value
    if request.logprobs is not None:
        body["logprobs"] = True
        body["top_logprobs"] = request.logprobs
    return body


def _logprobs(chat_logprobs: dict | None) -> dict | None:
    """Chat's per-token logprobs in the legacy layout (tokens, token_logprobs, top_logprobs, text_offset)."""
    if not chat_logprobs or chat_logprobs.get("content") is None:
        return None
    tokens, values, tops, offsets, offset = [], [], [], [], 0
    for entry in chat_logprobs["content"]:
        tokens.append(entry.get("token", ""))
        values.append(entry.get("logprob"))
        tops.append({top.get("token", ""): top.get("logprob") for top in entry.get("top_logprobs") or []})
        offsets.append(offset)
        offset += len(entry.get("token", ""))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def from_chat(chat_response: dict, request: dict, cmpl_id: str, first_index: int = 0) -> dict:
    choices = [
        {
            "text": text_of((choice.get("message") or {}).get("content")),
            "index": first_index + choice.get("index", 0),
            "logprobs": _logprobs(choice.get("logprobs")),
            "finish_reason": choice.get("finish_reason"),
        }
        for choice in chat_response.get("choices") or []
    ]
    return {
        "id": cmpl_id,
        "object": "text_completion",
        "created": chat_response.get("created") or int(time.time()),
        "model": request.get("model"),
        "choices": choices,
        "usage": chat_response.get("usage"),
    }


def merge(responses: list[dict]) -> dict:
    """One response for a list of prompts: choices in prompt order, usage summed."""
    merged = dict(responses[0])
    merged["choices"] = [choice for response in responses for choice in response["choices"]]
    if all(r.get("usage") for r in responses):
        merged["usage"] = {
            k: sum(r["usage"].get(k, 0) for r in responses)
            for k in ("prompt_tokens", "completion_tokens", "total_tokens")
        }
    return merged


class CompletionsStream:
    """Chat chunks in, `text_completion` chunks out (`data:` only, then `[DONE]`)."""

    def __init__(self, request: dict, cmpl_id: str):
        self.request = request
        self.cmpl_id = cmpl_id
        self.created = int(time.time())

    def start(self) -> list[tuple[str | None, bytes]]:
        return []

    def chunk(self, chunk: dict) -> list[tuple[str | None, bytes]]:
        choices = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content") is None and not choice.get("finish_reason") and not choice.get("logprobs"):
                continue
            choices.append(
                {
                    "text": delta.get("content") or "",
                    "index": choice.get("index", 0),
                    "logprobs": _logprobs(choice.get("logprobs")),
                    "finish_reason": choice.get("finish_reason"),
                }
            )
        if not choices and not chunk.get("usage"):
            return []
        out = {
            "id": self.cmpl_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.request.get("model"),
            "choices": choices,
        }
        if chunk.get("usage"):
            out["usage"] = chunk["usage"]
        return [(None, orjson.dumps(out))]

    def finish(self) -> list[tuple[str | None, bytes]]:
        return [(None, b"[DONE]")]

    def error(self, error: dict) -> list[tuple[str | None, bytes]]:
        return [(None, orjson.dumps(error))]


# ------------------------------------------------------------------ completion -> chat (pass-through)


def to_chat_response(completion: dict) -> dict:
    """The chat.completion a text completion amounts to, for the record of a call an upstream
    answered in this protocol itself (`--upstream-protocol completions`)."""
    return {
        "id": completion.get("id"),
        "object": "chat.completion",
        "created": completion.get("created"),
        "model": completion.get("model"),
        "usage": completion.get("usage"),
        "choices": [
            {
                "index": c.get("index", 0),
                "message": {"role": "assistant", "content": c.get("text", "")},
                "finish_reason": c.get("finish_reason"),
            }
            for c in completion.get("choices") or []
        ],
    }


class Accumulator:
    """The completion a relayed chunk stream amounts to."""

    def __init__(self) -> None:
        self.response: dict | None = None

    def add(self, chunk: dict) -> None:
        if self.response is None:
            self.response = {k: chunk.get(k) for k in ("id", "object", "created", "model")} | {"choices": []}
        if chunk.get("usage"):
            self.response["usage"] = chunk["usage"]
        for piece in chunk.get("choices") or []:
            index = piece.get("index", 0)
            while len(self.response["choices"]) <= index:
                self.response["choices"].append(
                    {"index": len(self.response["choices"]), "text": "", "finish_reason": None}
                )
            choice = self.response["choices"][index]
            choice["text"] += piece.get("text") or ""
            if piece.get("finish_reason"):
                choice["finish_reason"] = piece["finish_reason"]
