"""A small, fast OpenAI-compatible upstream on loopback, for tests and the bench.

`POST /v1/chat/completions` echoes the last user message (stream or not, `n`
choices), `GET /v1/models` lists two models and `GET /health` answers 200 (as vLLM's). It is a raw asyncio protocol on
httptools, not a web framework, so in the bench it is never the bottleneck.

Scripted behaviour, chosen by a magic token in the last user message (the
gateway forwards bodies, not headers, so the body is what reaches us):

    [[status=503]]      answer with that status and an OpenAI-shaped error
    [[delay=1.5]]       wait that many seconds before answering
    [[malformed]]       answer 200 with a body that is not JSON
    [[stream_error]]    stream: one chunk, then an error event
    [[bad_chunk]]       stream: one chunk, then one that is JSON but no chat.completion.chunk
    [[truncate]]        stream: one chunk, then drop the connection (no [DONE])
    [[hold]]            stream: one chunk, then wait for `release()` before the rest
    [[reasoning]]       stream: think aloud first, in `reasoning_content` deltas (as vLLM's reasoning parsers)
    [[tool_call]]       answer with a call to the request's first tool (in words after a tool result)

In-process: `with FakeUpstream() as upstream:` (a thread with its own loop);
`upstream.url` is the base URL an OpenAI client would use and
`upstream.requests` what arrived (method, path, headers, body).
As a process (the bench): `python tests/fake_upstream.py --port 0` prints
`listening on PORT` once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import re
import sys
import threading
import time
from dataclasses import dataclass

import httptools
import orjson

_MAGIC = re.compile(
    rb"\[\[(status|delay|malformed|stream_error|bad_chunk|truncate|hold|tool_call|reasoning)(?:=([0-9.]+))?\]\]"
)
_REASONS = {
    200: b"OK",
    400: b"Bad Request",
    401: b"Unauthorized",
    404: b"Not Found",
    405: b"Method Not Allowed",
    429: b"Too Many Requests",
    500: b"Internal Server Error",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
}
MODELS = ("fake-model", "fake-model-large")


@dataclass
class ReceivedRequest:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: dict | None


def _last_user_text(body: dict) -> str:
    for message in reversed(body.get("messages") or []):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return "".join(part.get("text", "") for part in content if isinstance(part, dict))
            return str(content or "")
    return ""


def _script(text: str) -> dict[str, float | bool]:
    return {name.decode(): (float(value) if value else True) for name, value in _MAGIC.findall(text.encode())}


def _error_body(status: int) -> bytes:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return orjson.dumps(
        {
            "error": {
                "message": f"scripted failure {status} from the fake upstream",
                "type": kind,
                "param": "messages",
                "code": f"fake_{status}",
            }
        }
    )


class _Connection(asyncio.Protocol):
    def __init__(self, upstream: FakeUpstream):
        self.upstream = upstream
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.served = 0  # requests read on this connection
        self._reset()

    def _reset(self) -> None:
        self.url = b""
        self.headers: dict[str, str] = {}
        self.body = bytearray()

    # -- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._respond(400, b'{"error": {"message": "malformed HTTP request"}}', close=True)

    def connection_lost(self, exc) -> None:
        self.transport = None

    # -- httptools callbacks
    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode()
        path = self.url.split(b"?", 1)[0].decode()
        keep_alive = self.parser.should_keep_alive()
        raw_body, headers = bytes(self.body), self.headers
        self._reset()
        self.served += 1
        if self.upstream.drop_reused and self.served > 1 and self.transport is not None:
            self.transport.close()  # as if its idle timeout closed it as the request came
            return
        body = None
        if raw_body:
            try:
                body = orjson.loads(raw_body)
            except orjson.JSONDecodeError:
                self._respond(400, b'{"error": {"message": "body is not JSON"}}', close=not keep_alive)
                return
        if self.upstream.record:
            self.upstream.requests.append(ReceivedRequest(method, path, headers, body))
        self.upstream.handle(self, method, path, headers, body, keep_alive)

    # -- writing
    def _respond(
        self, status: int, body: bytes, *, close: bool = False, content_type: bytes = b"application/json"
    ) -> None:
        if self.transport is None:
            return
        head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n" % (
            status,
            _REASONS.get(status, b"Status"),
            content_type,
            len(body),
        )
        if status in (429, 503):  # as OpenAI's rate limit (and an overloaded server) says when to come back
            head += b"retry-after: 7\r\n"
        self.transport.write(head + (b"connection: close\r\n\r\n" if close else b"\r\n") + body)
        if close:
            self.transport.close()

    def _start_stream(self) -> None:
        if self.transport is not None:
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
            )

    def _event(self, payload: bytes) -> None:
        if self.transport is not None:
            data = b"data: " + payload + b"\n\n"
            self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _end_stream(self, close: bool) -> None:
        if self.transport is not None:
            self.transport.write(b"0\r\n\r\n")
            if close:
                self.transport.close()


class FakeUpstream:
    def __init__(
        self,
        *,
        api_key: str | None = None,
        record: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
        echo_key: bool = False,
        drop_reused: bool = False,
    ):
        self.api_key = api_key  # when set, requests without `Authorization: Bearer <api_key>` get a 401
        self.echo_key = echo_key  # a careless upstream: that 401 repeats the Authorization it got
        self.record = record
        # A server whose keep-alive timeout closes each connection just as its next request
        # arrives: every request but a connection's first is dropped unanswered.
        self.drop_reused = drop_reused
        self.requests: list[ReceivedRequest] = []
        self.host, self.port = host, port
        self._ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._released: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    # ---------------------------------------------------------------- lifecycle

    async def serve(self) -> None:
        """Start listening on the running loop (sets `port` when it was 0)."""
        self._loop = asyncio.get_running_loop()
        self._released = asyncio.Event()
        self._server = await self._loop.create_server(
            lambda: _Connection(self), self.host, self.port, backlog=1024, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    def __enter__(self) -> FakeUpstream:
        started = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            loop.run_until_complete(self.serve())
            started.set()
            loop.run_forever()
            self._server.close()
            loop.run_until_complete(self._server.wait_closed())
            loop.close()

        self._thread = threading.Thread(target=run, name="fake-upstream", daemon=True)
        self._thread.start()
        if not started.wait(30):
            raise RuntimeError("the fake upstream did not start")
        return self

    def __exit__(self, *exc) -> None:
        assert self._loop is not None and self._thread is not None
        self._loop.call_soon_threadsafe(self._close_everything)
        self._thread.join(timeout=30)

    def _close_everything(self) -> None:
        assert self._loop is not None and self._server is not None
        self._server.close()
        for task in asyncio.all_tasks(self._loop):
            task.cancel()
        self._loop.call_later(0.05, self._loop.stop)

    def release(self) -> None:
        """Let streams waiting at `[[hold]]` go on (and later ones pass straight through)."""
        assert self._loop is not None and self._released is not None
        self._loop.call_soon_threadsafe(self._released.set)

    def chat_requests(self) -> list[ReceivedRequest]:
        return [r for r in self.requests if r.path.endswith("/chat/completions")]

    # ---------------------------------------------------------------- handling

    def handle(
        self, conn: _Connection, method: str, path: str, headers: dict[str, str], body: dict | None, keep_alive: bool
    ) -> None:
        close = not keep_alive
        if self.api_key is not None and headers.get("authorization") != f"Bearer {self.api_key}":
            told = f" (got Authorization: {headers.get('authorization')})" if self.echo_key else ""
            message = f"fake upstream: wrong API key{told}"
            conn._respond(
                401, orjson.dumps({"error": {"message": message, "type": "authentication_error"}}), close=close
            )
            return
        if path == "/health" and method == "GET":  # as vLLM answers it (rLLM's gateway polls it)
            conn._respond(200, b"", close=close)
            return
        if path == "/v1/models" and method == "GET":
            data = [{"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in MODELS]
            conn._respond(200, orjson.dumps({"object": "list", "data": data}), close=close)
            return
        if path != "/v1/chat/completions":
            conn._respond(
                404, orjson.dumps({"error": {"message": f"no route {path}", "type": "not_found"}}), close=close
            )
            return
        if method != "POST" or not isinstance(body, dict):
            conn._respond(
                400,
                orjson.dumps({"error": {"message": "POST a JSON object", "type": "invalid_request_error"}}),
                close=close,
            )
            return
        text = _last_user_text(body)
        script = _script(text) if "[[" in text else {}
        if not script and not body.get("stream"):
            conn._respond(200, orjson.dumps(self._completion(body, text)), close=close)  # the fast path
            return
        # Slow path: no new request on this connection until this one is answered.
        if conn.transport is not None:
            conn.transport.pause_reading()
        asyncio.get_running_loop().create_task(self._answer(conn, body, text, script, close))

    async def _answer(self, conn: _Connection, body: dict, text: str, script: dict, close: bool) -> None:
        try:
            if "delay" in script:
                await asyncio.sleep(float(script["delay"]))
            if "status" in script:
                conn._respond(int(script["status"]), _error_body(int(script["status"])), close=close)
            elif "malformed" in script and body.get("stream"):
                conn._start_stream()
                conn._event(b'{"id": "chatcmpl-broken", "choices": [')
                conn._end_stream(close)
            elif "malformed" in script:
                conn._respond(200, b'{"id": "chatcmpl-broken", "choices": [', close=close)
            elif body.get("stream"):
                await self._stream(conn, body, text, script, close)
            else:
                conn._respond(200, orjson.dumps(self._completion(body, text, script)), close=close)
        finally:
            if conn.transport is not None and not close:
                conn.transport.resume_reading()

    # ---------------------------------------------------------------- bodies

    def _choice_texts(self, body: dict, text: str) -> list[str]:
        n = int(body.get("n") or 1)
        return [text] if n == 1 else [f"{text} ({i})" for i in range(n)]

    def _tool_call(self, body: dict, index: int) -> dict | None:
        tools = body.get("tools") or []
        messages = body.get("messages") or []
        if not tools or (messages and messages[-1].get("role") == "tool"):
            return None  # a tool's result is answered in words, so an agent's loop ends
        name = tools[0].get("function", {}).get("name", "tool")
        return {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": '{"x": 1}'}}

    def _completion(self, body: dict, text: str, script: dict | None = None) -> dict:
        choices = []
        for i, content in enumerate(self._choice_texts(body, text)):
            message: dict = {"role": "assistant", "content": content}
            finish = "stop"
            if script and "tool_call" in script and (call := self._tool_call(body, i)):
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                finish = "tool_calls"
            choices.append({"index": i, "message": message, "logprobs": None, "finish_reason": finish})
        prompt_words = sum(len(str(m.get("content") or "").split()) for m in body.get("messages") or [])
        completion_words = len(text.split()) * len(choices)
        return {
            "id": f"chatcmpl-fake-{next(self._ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", MODELS[0]),
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_words,
                "completion_tokens": completion_words,
                "total_tokens": prompt_words + completion_words,
            },
        }

    async def _stream(self, conn: _Connection, body: dict, text: str, script: dict, close: bool) -> None:
        base = {
            "id": f"chatcmpl-fake-{next(self._ids)}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": body.get("model", MODELS[0]),
        }

        def chunk(index: int, delta: dict, finish: str | None = None) -> bytes:
            return orjson.dumps(
                {**base, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]}
            )

        conn._start_stream()
        texts = self._choice_texts(body, text)
        for i in range(len(texts)):
            conn._event(chunk(i, {"role": "assistant", "content": ""}))
        if "stream_error" in script:
            conn._event(orjson.dumps({"error": {"message": "scripted mid-stream failure", "type": "server_error"}}))
            conn._end_stream(close)
            return
        if "bad_chunk" in script:  # JSON, but not a chat.completion.chunk's shape
            conn._event(orjson.dumps({**base, "choices": [{"index": 0, "delta": "oops"}]}))
            conn._event(b"[DONE]")
            conn._end_stream(close)
            return
        if "truncate" in script:
            if conn.transport is not None:
                conn.transport.close()
            return
        if "hold" in script:
            await self._released.wait()
        for i, content in enumerate(texts):
            if "tool_call" in script and (call := self._tool_call(body, i)):
                conn._event(
                    chunk(
                        i,
                        {
                            "tool_calls": [
                                {
                                    "index": 0,
                                    "id": call["id"],
                                    "type": "function",
                                    "function": {"name": call["function"]["name"], "arguments": ""},
                                }
                            ]
                        },
                    )
                )
                conn._event(
                    chunk(i, {"tool_calls": [{"index": 0, "function": {"arguments": call["function"]["arguments"]}}]})
                )
                conn._event(chunk(i, {}, "tool_calls"))
                continue
            if "reasoning" in script:
                for piece in ("Let me ", "think."):
                    conn._event(chunk(i, {"reasoning_content": piece}))
            for piece in re.findall(r"\S+\s*|\s+", content):
                conn._event(chunk(i, {"content": piece}))
            conn._event(chunk(i, {}, "stop"))
        if (body.get("stream_options") or {}).get("include_usage"):
            words = len(text.split()) * len(texts)
            conn._event(
                orjson.dumps(
                    {
                        **base,
                        "choices": [],
                        "usage": {"prompt_tokens": 1, "completion_tokens": words, "total_tokens": words + 1},
                    }
                )
            )
        conn._event(b"[DONE]")
        conn._end_stream(close)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="fake OpenAI-compatible upstream")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--record", action="store_true", help="keep every request in memory (tests only)")
    args = parser.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    async def run() -> None:
        upstream = FakeUpstream(record=args.record, host=args.host, port=args.port)
        await upstream.serve()
        print(f"listening on {upstream.port}", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
