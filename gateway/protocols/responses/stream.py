"""Chat chunks re-encoded as the Responses API's event sequence."""

from __future__ import annotations

import time
from typing import Any

import orjson

from gateway.protocols.responses.translate import envelope, function_call_item, message_item, usage_of
from gateway.protocols.responses.wire import LOGPROBS


class ResponsesStream:
    """Chat chunks in, Responses events out (`(event type, payload)` pairs)."""

    def __init__(self, request: dict, resp_id: str):
        self.request = request
        self.resp_id = resp_id
        self.created = time.time()
        self.sequence = 0
        self.text: str | None = None  # the message item's text so far; None until it opens
        asked = request.get("top_logprobs") or LOGPROBS in (request.get("include") or [])
        self.logprobs: list | None = [] if asked else None  # the message's token logprobs so far, if asked
        self.calls: dict[int, dict] = {}  # chat tool-call index -> {"id", "function": {"name", "arguments"}}
        self.open_item: tuple[str, int] | None = None  # ("message", output_index) or ("call", chat index)
        self.output: list[dict] = []  # finished items
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    def _event(self, kind: str, **fields: Any) -> tuple[str, bytes]:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return kind, orjson.dumps(payload)

    def start(self) -> list[tuple[str, bytes]]:
        snapshot = envelope(self.request, self.resp_id, self.created, "in_progress")
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def _close_open(self) -> list[tuple[str, bytes]]:
        events = []
        if self.open_item is None:
            return events
        kind, key = self.open_item
        index = len(self.output)
        if kind == "message":
            item = message_item(self.resp_id, self.text or "", logprobs=self.logprobs)
            part = item["content"][0]
            events += [
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=self.logprobs or [],
                ),
                self._event(
                    "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
                ),
            ]
        else:
            item = function_call_item(self.resp_id, key, self.calls[key])
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            )
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        self.open_item = None
        return events

    def chunk(self, chunk: dict) -> list[tuple[str, bytes]]:
        events: list[tuple[str, bytes]] = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            entries = (choice.get("logprobs") or {}).get("content") or []
            if self.logprobs is not None:
                self.logprobs += entries
            if delta.get("content"):
                if self.open_item is None or self.open_item[0] != "message":
                    events += self._close_open()
                    self.text = ""
                    self.open_item = ("message", len(self.output))
                    item = message_item(self.resp_id, "", status="in_progress")
                    events += [
                        self._event("response.output_item.added", output_index=len(self.output), item=item),
                        self._event(
                            "response.content_part.added",
                            item_id=item["id"],
                            output_index=len(self.output),
                            content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []},
                        ),
                    ]
                self.text += delta["content"]
                events.append(
                    self._event(
                        "response.output_text.delta",
                        item_id="msg_" + self.resp_id[5:],
                        output_index=len(self.output),
                        content_index=0,
                        delta=delta["content"],
                        logprobs=entries,
                    )
                )
            for call_delta in delta.get("tool_calls") or []:
                key = call_delta.get("index", len(self.calls))
                function = call_delta.get("function") or {}
                if key not in self.calls:
                    events += self._close_open()
                    self.calls[key] = {
                        "id": call_delta.get("id"),
                        "function": {"name": function.get("name") or "", "arguments": ""},
                    }
                    self.open_item = ("call", key)
                    item = function_call_item(self.resp_id, key, self.calls[key], status="in_progress")
                    events.append(self._event("response.output_item.added", output_index=len(self.output), item=item))
                elif function.get("name"):
                    self.calls[key]["function"]["name"] += function["name"]
                if function.get("arguments"):
                    self.calls[key]["function"]["arguments"] += function["arguments"]
                    events.append(
                        self._event(
                            "response.function_call_arguments.delta",
                            item_id=f"fc_{self.resp_id[5:]}_{key}",
                            output_index=len(self.output),
                            delta=function["arguments"],
                        )
                    )
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[tuple[str, bytes]]:
        events = self._close_open()
        response = envelope(self.request, self.resp_id, self.created, "completed")
        response["output"] = self.output
        response["usage"] = usage_of(self.usage)
        kind = "response.completed"
        if self.finish_reason == "length":
            response["status"], response["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
            kind = "response.incomplete"
        events.append(self._event(kind, response=response))
        return events

    def error(self, error: dict) -> list[tuple[str, bytes]]:
        """The documented failure: an `error` event, then `response.failed` with the response
        as far as it got."""
        body = error.get("error") or {}
        code, message = body.get("code") or body.get("type") or "server_error", body.get("message", "")
        response = envelope(self.request, self.resp_id, self.created, "failed")
        response["output"], response["error"] = self.output, {"code": code, "message": message}
        return [
            self._event("error", code=code, message=message, param=body.get("param")),
            self._event("response.failed", response=response),
        ]
