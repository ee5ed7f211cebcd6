"""A completion an upstream gave in this protocol itself (`--upstream-protocol completions`),
read back: its chat form for the record, and the whole completion from a relayed stream."""

from __future__ import annotations


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
