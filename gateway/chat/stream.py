"""Streams: the first chunk awaited before the response starts, and the chat.completion a
stream amounts to, rebuilt for the record."""

from __future__ import annotations

from collections.abc import AsyncIterator


async def prepend_first(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`first` (already awaited, so errors before it became HTTP errors), then the rest."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()  # a client that left mid-stream still gets its call recorded, now


# A delta's text, in pieces to join: the answer, a reasoning model's thinking (vLLM's and
# DeepSeek's `reasoning_content`, newer vLLM's `reasoning`) and a refusal. The unstreamed
# message keeps them all, so the streamed call's record must too.
_TEXT_FIELDS = ("content", "reasoning_content", "reasoning", "refusal")


class StreamAccumulator:
    """Rebuilds the chat.completion a stream amounts to, for the record."""

    def __init__(self) -> None:
        self.meta: dict = {}
        self.choices: dict[int, dict] = {}
        self.usage: dict | None = None

    def add(self, chunk: dict) -> None:
        if not self.meta:
            self.meta = {k: chunk.get(k) for k in ("id", "created", "model", "system_fingerprint")}
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for delta_choice in chunk.get("choices") or []:
            index = delta_choice.get("index", 0)
            choice = self.choices.setdefault(
                index, {"index": index, "message": {"role": "assistant", "content": None}, "finish_reason": None}
            )
            delta = delta_choice.get("delta") or {}
            message = choice["message"]
            for field in _TEXT_FIELDS:
                piece = delta.get(field)
                if piece and isinstance(piece, str):
                    message[field] = (message.get(field) or "") + piece
            for call_delta in delta.get("tool_calls") or []:
                calls = message.setdefault("tool_calls", [])
                position = call_delta.get("index", len(calls))
                while len(calls) <= position:
                    calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                call = calls[position]
                if call_delta.get("id"):
                    call["id"] = call_delta["id"]
                function = call_delta.get("function") or {}
                if function.get("name"):
                    call["function"]["name"] += function["name"]
                if function.get("arguments"):
                    call["function"]["arguments"] += function["arguments"]
            if delta_choice.get("logprobs") and delta_choice["logprobs"].get("content"):
                choice.setdefault("logprobs", {"content": []})["content"].extend(delta_choice["logprobs"]["content"])
            if delta_choice.get("finish_reason"):
                choice["finish_reason"] = delta_choice["finish_reason"]
                if delta_choice.get("stop_reason") is not None:  # vLLM's: the stop string that ended it
                    choice["stop_reason"] = delta_choice["stop_reason"]

    def response(self) -> dict:
        return {
            **self.meta,
            "object": "chat.completion",
            "choices": [self.choices[i] for i in sorted(self.choices)],
            "usage": self.usage,
        }
