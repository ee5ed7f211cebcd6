"""The demo's scripted judge: a loopback OpenAI-compatible server that answers RULER.

`rlproxy demo --live shadows` learns with no reward posted at all: the gateway samples
shadow completions beside each live call and RULER ranks the live answer and its shadows.
A real LLM judge needs a key and the network; this one stands in for it on loopback, reached
through litellm exactly as a real one is (`--shadow-judge-model openai/scripted-judge
--shadow-judge-api-base URL`). It reads RULER's prompt (`gateway.ruler.scoring.build_prompt`:
each distinct trajectory's messages, one JSON object a line, under its own
`<trajectory id="...">` tag on a line of its own), takes each trajectory's final assistant
message and scores it with the task's `reward(reply)` (SHOUT's share of capitals), and
answers RULER's schema: `{"scores": [{"trajectory_id", "explanation", "score"}]}`.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable

from gateway.demo.processes import free_socket
from gateway.errors import RLProxyError

# An opening tag on its own line: RULER's instructions mention `<trajectory id="...">` inline.
_OPEN = re.compile(r'^<trajectory id="([^"]+)">$')
_CLOSE = "</trajectory>"

ReplyScore = Callable[[str | None], float]


def final_replies(content: str) -> dict[str, str | None]:
    """trajectory id -> the text of its last assistant message (None when it said nothing),
    from the user message of a RULER prompt; in the prompt's order."""
    replies: dict[str, str | None] = {}
    current: str | None = None
    for line in content.splitlines():
        opened = _OPEN.match(line)
        if opened:
            current = opened.group(1)
            replies[current] = None
            continue
        if line == _CLOSE:
            current = None
            continue
        if current is None or not line.startswith("{"):
            continue  # the shared context, a tools block, anything not a message line
        try:
            message = json.loads(line)
        except ValueError:
            continue
        if isinstance(message, dict) and message.get("role") == "assistant":
            text = message.get("content")
            replies[current] = text if isinstance(text, str) else None
    return replies


def judge_answer(messages: list[dict], score: ReplyScore) -> dict:
    """RULER's answer to `messages`: one score per trajectory, from its final reply."""
    for message in messages:  # litellm may turn the system message into a user one: roles are no guide
        content = message.get("content")
        replies = final_replies(content) if isinstance(content, str) else {}
        if replies:
            break
    else:
        raise ValueError("no <trajectory id=...> blocks in the prompt")
    scores = []
    for trajectory_id, reply in replies.items():
        value = min(max(float(score(reply)), 0.0), 1.0)
        scores.append(
            {
                "trajectory_id": trajectory_id,
                "explanation": f"scored by the task's own reward function: {value:.3f}",
                "score": round(value, 4),
            }
        )
    return {"scores": scores}


class ScriptedJudge:
    """The judge under uvicorn in a thread of this process; `url` is its OpenAI base URL
    (`.../v1`, litellm's `api_base`). `judged` counts the prompts it answered."""

    def __init__(self, score: ReplyScore):
        from starlette.applications import Starlette
        from starlette.routing import Route

        self.score = score
        self.judged = 0
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/chat/completions", self._chat, methods=["POST"]),
            ]
        )
        self._server = None
        self._thread: threading.Thread | None = None
        self._port: int | None = None

    @property
    def url(self) -> str:
        if self._port is None:
            raise RLProxyError("the scripted judge is not running")
        return f"http://127.0.0.1:{self._port}/v1"

    async def _chat(self, request):
        from starlette.responses import JSONResponse

        body = await request.json()
        try:
            answer = judge_answer(body.get("messages") or [], self.score)
        except ValueError as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error"}}, status_code=400)
        self.judged += 1
        return JSONResponse(
            {
                "id": f"judge-{self.judged}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.get("model", "scripted-judge"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": json.dumps(answer)},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            }
        )

    def __enter__(self) -> ScriptedJudge:
        import uvicorn

        sock = free_socket()
        self._port = sock.getsockname()[1]
        self._sock = sock
        config = uvicorn.Config(self.app, log_level="warning", log_config=None, access_log=False, lifespan="off")
        self._server = server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="rlproxy-demo-judge", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RLProxyError("the scripted judge failed to start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._sock.close()
        self._port = None
