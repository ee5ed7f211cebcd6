"""Chat chunks re-encoded as Anthropic's stream events."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.protocols.messages.translate import stop_of, usage_of
from gateway.protocols.messages.wire import error_body


class MessagesStream:
    """Chat chunks in, Anthropic stream events out (`(event type, payload)` pairs)."""

    def __init__(self, request: dict, msg_id: str):
        self.request = request
        self.msg_id = msg_id
        self.block = -1  # index of the open content block; -1 before the first
        self.open_kind: str | None = None  # "text" or the chat tool-call index as "tool:N"
        self.finish_reason: str | None = None
        self.stop_reason: object = None  # the engine's: the stop string that ended choice 0, if one did
        self.usage: dict | None = None
        self.started = False

    @staticmethod
    def _event(kind: str, **fields: Any) -> tuple[str, bytes]:
        return kind, orjson.dumps({"type": kind, **fields})

    def start(self) -> list[tuple[str, bytes]]:
        # message_start waits for the first chunk: from an engine with `continuous_usage` its usage
        # holds the prompt's tokens, which Anthropic reports in message_start already.
        return []

    def _started(self) -> list[tuple[str, bytes]]:
        if self.started:
            return []
        self.started = True
        message = {
            "id": self.msg_id,
            "type": "message",
            "role": "assistant",
            "model": self.request.get("model"),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": (self.usage or {}).get("prompt_tokens", 0), "output_tokens": 0},
        }
        return [self._event("message_start", message=message)]

    def _open(self, kind: str, block: dict) -> list[tuple[str, bytes]]:
        events = self._close()
        self.block += 1
        self.open_kind = kind
        return events + [self._event("content_block_start", index=self.block, content_block=block)]

    def _close(self) -> list[tuple[str, bytes]]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [self._event("content_block_stop", index=self.block)]

    def chunk(self, chunk: dict) -> list[tuple[str, bytes]]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events = self._started()
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.open_kind != "text":
                    events += self._open("text", {"type": "text", "text": ""})
                events.append(
                    self._event(
                        "content_block_delta", index=self.block, delta={"type": "text_delta", "text": delta["content"]}
                    )
                )
            for call in delta.get("tool_calls") or []:
                kind = f"tool:{call.get('index', 0)}"
                function = call.get("function") or {}
                if self.open_kind != kind:
                    events += self._open(
                        kind,
                        {"type": "tool_use", "id": call.get("id"), "name": function.get("name") or "", "input": {}},
                    )
                if function.get("arguments"):
                    events.append(
                        self._event(
                            "content_block_delta",
                            index=self.block,
                            delta={"type": "input_json_delta", "partial_json": function["arguments"]},
                        )
                    )
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.stop_reason = choice.get("stop_reason")
        return events

    def finish(self) -> list[tuple[str, bytes]]:
        events = self._started() + self._close()
        stop_reason, stop_sequence = stop_of(self.finish_reason, self.stop_reason, self.request)
        events.append(
            self._event(
                "message_delta",
                delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                usage=usage_of(self.usage),
            )
        )
        events.append(self._event("message_stop"))
        return events

    def error(self, error: dict) -> list[tuple[str, bytes]]:
        body = error.get("error") or {}
        return self._started() + [("error", orjson.dumps(error_body(500, body.get("message", "the stream failed"))))]
