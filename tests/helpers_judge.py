"""A loopback OpenAI-compatible judge for RULER tests: records what it is sent, answers as scripted.

`answers` are used in order, one per request (a string is the message content, a
callable gets the request body and returns the content); once they run out the
judge answers well on its own: one score per `<trajectory id="...">` it was shown,
the first best. Point litellm at it with `judge_api_base=judge.url`, or with
`OPENAI_BASE_URL=judge.url` for a plain `openai/<model>` judge id. A gateway calls only the
judges it was started with: one started before its judge gives `--judge-api-base judge_url(port)`
and the judge that `port`.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from tests.helpers import ThreadServer

# An opening tag on its own line: the instructions mention `<trajectory id="...">` inline.
TRAJECTORY_ID = re.compile(r'^<trajectory id="([^"]+)">$', re.MULTILINE)


def shown_ids(body: dict) -> list[str]:
    """The trajectory ids in the judge prompt: the first message with opening tags (litellm may
    have turned the system message into a user one for some models, so roles are no guide)."""
    for message in body["messages"]:
        ids = TRAJECTORY_ID.findall(message.get("content") or "")
        if ids:
            return ids
    return []


def good_answer(body: dict) -> str:
    ids = shown_ids(body)
    return json.dumps(
        {
            "scores": [
                {
                    "trajectory_id": i,
                    "explanation": f"trajectory {i} ranked {rank + 1} of {len(ids)}",
                    "score": round(1.0 - rank / max(len(ids), 1), 4),
                }
                for rank, i in enumerate(ids)
            ]
        }
    )


def judge_url(port: int) -> str:
    """The base URL of a FakeJudge on `port` (what a gateway allows with --judge-api-base)."""
    return f"http://127.0.0.1:{port}/v1"


async def _endless_spaces():
    while True:  # ends when the client hangs up (Starlette cancels a stream on disconnect)
        yield b" "
        await asyncio.sleep(0.2)


class FakeJudge:
    def __init__(
        self,
        answers: list[str | Callable[[dict], str]] | None = None,
        status: int = 200,
        port: int | None = None,
        stall: bool = False,
    ):
        self.port = port
        self.answers = list(answers or [])
        # `stall`: answer 200 and then a space every 0.2 s, never the JSON (a stalled proxy).
        self.stall = stall
        # A non-200 status makes every answer an OpenAI-shaped error that quotes the key it got,
        # as some providers do, so tests can check the gateway does not pass it on.
        self.status = status
        self.requests: list[dict] = []  # {"path", "headers", "body"}
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/chat/completions", self._chat, methods=["POST"]),
            ]
        )
        self._server: ThreadServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return self._server.url + "/v1"

    @property
    def bodies(self) -> list[dict]:
        return [r["body"] for r in self.requests]

    async def _chat(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.requests.append({"path": request.url.path, "headers": dict(request.headers), "body": body})
        if self.stall:
            return StreamingResponse(_endless_spaces(), media_type="application/json")
        if self.status != 200:
            key = request.headers.get("authorization", "").removeprefix("Bearer ")
            return JSONResponse(
                {"error": {"message": f"the fake judge refuses the key {key}", "type": "invalid_request_error"}},
                status_code=self.status,
            )
        answer: Any = self.answers.pop(0) if self.answers else good_answer
        content = answer(body) if callable(answer) else answer
        return JSONResponse(
            {
                "id": f"judge-{len(self.requests)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", "judge"),
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20},
            }
        )

    def __enter__(self) -> FakeJudge:
        self._server = ThreadServer(self.app, port=self.port).__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.__exit__(*exc)
