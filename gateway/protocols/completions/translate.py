"""A completions request to a chat request body (`to_chat`), a chat.completion back to a
`text_completion` (`from_chat`), and the answers to a list of prompts as one (`merge`): pure functions."""

from __future__ import annotations

import time
from typing import Any

from gateway.protocols import text_of
from gateway.protocols.completions.wire import CompletionRequest

# The chat fields to_chat fills from another field of the request: an error about one names the client's.
CHAT_FIELDS = {"messages": "prompt", "top_logprobs": "logprobs", "logprobs": "logprobs"}


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


def logprobs_of(chat_logprobs: dict | None) -> dict | None:
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
            "logprobs": logprobs_of(choice.get("logprobs")),
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
