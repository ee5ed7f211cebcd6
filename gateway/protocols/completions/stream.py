"""Chat chunks re-encoded as `text_completion` chunks."""

from __future__ import annotations

import time

import orjson

from gateway.protocols.completions.translate import logprobs_of


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
                    "logprobs": logprobs_of(choice.get("logprobs")),
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
