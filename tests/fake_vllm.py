"""A loopback stand-in for `vllm serve`, following vLLM's documented HTTP contract.

What it serves, as vLLM does:
- `POST /v1/chat/completions`, streamed and not: `return_token_ids` puts `prompt_token_ids` on
  the response (first chunk when streaming) and `token_ids` on each choice (each chunk);
  `logprobs`/`top_logprobs` give `logprobs.content[i]` with `top_logprobs` lists; `n`;
  `stream_options.include_usage`; unknown model -> 404 `{"error": {...}}`.
- `POST /v1/load_lora_adapter {"lora_name", "lora_path"}`, `POST /v1/unload_lora_adapter
  {"lora_name"}`: registered only with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`; loading a
  loaded name -> 400 "has already been loaded"; unknown name on unload -> 404; a path without
  `adapter_config.json` -> 404; a LoRA rank above `--max-lora-rank` -> 400.
- `POST /sleep?level=1`, `POST /wake_up`, `GET /is_sleeping`: registered only with
  `VLLM_SERVER_DEV_MODE=1`, and need `--enable-sleep-mode`.
- `GET /v1/models` (adapters listed with `parent`), `GET /health`.

Made for tests: every completion's text names the model that answered (`[agent@1] ...`), so a
test sees which adapter served it; `/fake/state` shows the event log (load, unload, sleep,
wake_up, chat — and any chat that arrived while asleep), argv and the vLLM env vars;
`POST /fake/script` sets a per-token delay, a parser that holds text back (chunks with an
empty delta that carry only token ids), or a crash after N chunks (the process exits, as a
dying vLLM would; in-thread servers drop the connection instead).

Run as a process with vLLM's CLI shape: `python tests/fake_vllm.py serve MODEL --port P ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

WORDS = ("hello", "from", "the", "fake", "vllm", "server", "with", "lora")


@dataclass
class FakeState:
    base_model: str = "Qwen/Qwen2.5-0.5B-Instruct"
    max_lora_rank: int = 16
    max_model_len: int = 4096  # on every model card, as vLLM's are
    sleep_mode: bool = True
    lora_updating: bool = True  # VLLM_ALLOW_RUNTIME_LORA_UPDATING
    dev_mode: bool = True  # VLLM_SERVER_DEV_MODE
    exit_on_crash: bool = False  # True in a subprocess: a crash ends the process
    argv: list[str] = field(default_factory=list)
    env: dict[str, str | None] = field(default_factory=dict)
    loaded: dict[str, str] = field(default_factory=dict)
    asleep: bool = False
    events: list[dict] = field(default_factory=list)
    chats_while_asleep: int = 0
    token_delay: float = 0.0
    parser_holds: bool = False
    crash_after_chunks: int | None = None
    in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def event(self, kind: str, **data) -> None:
        with self.lock:
            self.events.append({"kind": kind, "at": time.time(), **data})

    def snapshot(self) -> dict:
        with self.lock:
            return {
                "base_model": self.base_model, "loaded": dict(self.loaded), "asleep": self.asleep,
                "events": list(self.events), "chats_while_asleep": self.chats_while_asleep,
                "argv": self.argv, "env": self.env, "in_flight": self.in_flight, "pid": os.getpid(),
            }


def _error(status: int, message: str, err_type: str, param: str | None = None) -> JSONResponse:
    # vLLM's ErrorResponse: {"error": {"message", "type", "param", "code"}}
    return JSONResponse({"error": {"message": message, "type": err_type, "param": param, "code": status}},
                        status_code=status)


def prompt_ids_for(messages: list[dict]) -> list[int]:
    """A stand-in tokenizer: one id per character of a simple chat rendering."""
    text = "".join(f"<{m.get('role')}>{m.get('content') if isinstance(m.get('content'), str) else ''}"
                   for m in messages) + "<assistant>"
    return [ord(ch) % 4096 for ch in text]


def completion_tokens(model: str, max_tokens: int, choice: int) -> list[tuple[int, str, float]]:
    """(id, text, logprob) per sampled token; the first names the model that answered."""
    pieces = [f"[{model}]", *[" " + w for w in WORDS]][:max_tokens]
    return [(5000 + 10 * i + choice, text, -0.25 * (i + 1) - 0.01 * choice) for i, text in enumerate(pieces)]


def logprob_entry(text: str, logprob: float, top: int) -> dict:
    tops = [{"token": text, "logprob": logprob, "bytes": list(text.encode())}]
    tops += [{"token": f"alt{j}", "logprob": logprob - j, "bytes": list(f"alt{j}".encode())} for j in range(1, 25)]
    return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": tops[:top]}


def create_fake_vllm(state: FakeState) -> FastAPI:
    app = FastAPI()
    app.state.fake = state

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        data = [{"id": state.base_model, "object": "model", "owned_by": "vllm", "root": state.base_model,
                 "parent": None, "max_model_len": state.max_model_len}]
        data += [{"id": name, "object": "model", "owned_by": "vllm", "root": path, "parent": state.base_model,
                  "max_model_len": state.max_model_len}
                 for name, path in state.loaded.items()]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        model = body.get("model") or state.base_model
        state.event("chat", model=model, stream=bool(body.get("stream")), asleep=state.asleep)
        if state.asleep:
            with state.lock:
                state.chats_while_asleep += 1
            return _error(503, "the engine is sleeping", "ServiceUnavailable")
        if model != state.base_model and model not in state.loaded:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        if body.get("top_logprobs") and not body.get("logprobs"):
            return _error(400, "when using `top_logprobs`, `logprobs` must be set to true.", "BadRequestError")
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 6)
        prompt_length = len(prompt_ids_for(body.get("messages") or []))
        if prompt_length + max_tokens > state.max_model_len:  # as vLLM: prompt and completion together
            return _error(400, f"This model's maximum context length is {state.max_model_len} tokens. However, "
                               f"you requested {max_tokens} output tokens and your prompt contains {prompt_length} "
                               "input tokens.", "BadRequestError")
        n = int(body.get("n") or 1)
        want_ids = bool(body.get("return_token_ids"))
        top = int(body.get("top_logprobs") or 0)
        want_lp = bool(body.get("logprobs"))
        prompt_ids = prompt_ids_for(body.get("messages") or [])
        choices = [completion_tokens(model, max_tokens, i) for i in range(n)]
        finish = "length" if max_tokens < len(WORDS) + 1 else "stop"
        created, cid = int(time.time()), "chatcmpl-" + uuid.uuid4().hex
        if body.get("stream"):
            return StreamingResponse(
                _stream(state, cid, created, model, prompt_ids, choices, finish, want_ids, want_lp, top,
                        bool((body.get("stream_options") or {}).get("include_usage"))),
                media_type="text/event-stream")
        if state.crash_after_chunks is not None:
            _crash(state)
        out_choices = []
        for i, tokens in enumerate(choices):
            out_choices.append({
                "index": i,
                "message": {"role": "assistant", "content": "".join(t for _, t, _ in tokens), "refusal": None,
                            "annotations": None, "audio": None, "function_call": None, "reasoning": None},
                "logprobs": {"content": [logprob_entry(t, lp, top) for _, t, lp in tokens]} if want_lp else None,
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": [tid for tid, _, _ in tokens] if want_ids else None,
            })
        completion = sum(len(t) for t in choices)
        return JSONResponse({
            "id": cid, "object": "chat.completion", "created": created, "model": model, "choices": out_choices,
            "service_tier": None, "system_fingerprint": None,
            "usage": {"prompt_tokens": len(prompt_ids), "total_tokens": len(prompt_ids) + completion,
                      "completion_tokens": completion, "prompt_tokens_details": None},
            "prompt_logprobs": None, "prompt_token_ids": prompt_ids if want_ids else None,
            "kv_transfer_params": None,
        })

    @app.post("/fake/script")
    async def script(request: Request) -> JSONResponse:
        body = await request.json()
        for key in ("token_delay", "parser_holds", "crash_after_chunks"):
            if key in body:
                setattr(state, key, body[key])
        return JSONResponse({"ok": True})

    @app.get("/fake/state")
    async def fake_state() -> JSONResponse:
        return JSONResponse(state.snapshot())

    if state.lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load(request: Request) -> Response:
            body = await request.json()
            name, path = body.get("lora_name"), body.get("lora_path")
            if not name or not path:
                return _error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
            if name in state.loaded and not body.get("load_inplace"):
                return _error(400, f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                   "adapter in place, set 'load_inplace' to True.", "InvalidUserInput")
            config = Path(path) / "adapter_config.json"
            if not config.exists():
                return _error(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
            rank = json.loads(config.read_text()).get("r", 8)
            if rank > state.max_lora_rank:
                return _error(400, f"LoRA rank {rank} is greater than max_lora_rank {state.max_lora_rank}.",
                              "BadRequestError")
            state.loaded[name] = path
            state.event("load", name=name, path=path, asleep=state.asleep)
            return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload(request: Request) -> Response:
            body = await request.json()
            name = body.get("lora_name")
            if name not in state.loaded:
                return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
            del state.loaded[name]
            state.event("unload", name=name)
            return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    if state.dev_mode:
        @app.post("/sleep")
        async def sleep(request: Request) -> Response:
            if not state.sleep_mode:
                return _error(500, "Sleep mode is not enabled. Enable it with --enable-sleep-mode.",
                              "InternalServerError")
            level = int(request.query_params.get("level", "1"))
            state.event("sleep", level=level, in_flight=state.in_flight)
            state.asleep = True
            return Response(status_code=200)

        @app.post("/wake_up")
        async def wake_up() -> Response:
            state.event("wake_up")
            state.asleep = False
            return Response(status_code=200)

        @app.get("/is_sleeping")
        async def is_sleeping() -> JSONResponse:
            return JSONResponse({"is_sleeping": state.asleep})

    return app


def _crash(state: FakeState) -> None:
    state.event("crash")
    if state.exit_on_crash:
        sys.stdout.flush()
        os._exit(17)  # die like a GPU process killed mid-request: no response, sockets reset
    raise ConnectionAbortedError("fake vLLM crash")


async def _stream(state: FakeState, cid: str, created: int, model: str, prompt_ids: list[int],
                  choices: list[list[tuple[int, str, float]]], finish: str, want_ids: bool, want_lp: bool,
                  top: int, include_usage: bool):
    def sse(data: dict) -> bytes:
        return b"data: " + json.dumps(data).encode() + b"\n\n"

    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
    sent = 0
    with state.lock:
        state.in_flight += 1
    try:
        for i in range(len(choices)):
            first = {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]}
            if want_ids:
                first["prompt_token_ids"] = prompt_ids
            yield sse(first)
        for i, tokens in enumerate(choices):
            held = ""
            for position, (tid, text, lp) in enumerate(tokens):
                if state.crash_after_chunks is not None and sent >= state.crash_after_chunks:
                    _crash(state)
                if state.token_delay:
                    await asyncio.sleep(state.token_delay)
                last = position == len(tokens) - 1
                if state.parser_holds and position == 0 and not last:
                    delta, held = {}, text  # a tool/reasoning parser held the text back
                else:
                    delta, held = {"content": held + text}, ""
                choice = {"index": i, "delta": delta,
                          "logprobs": {"content": [logprob_entry(text, lp, top)]} if want_lp else None,
                          "finish_reason": finish if last else None}
                if last:
                    choice["stop_reason"] = None
                if want_ids:
                    choice["token_ids"] = [tid]
                yield sse({**base, "choices": [choice]})
                sent += 1
        if include_usage:
            completion = sum(len(t) for t in choices)
            yield sse({**base, "choices": [], "usage": {"prompt_tokens": len(prompt_ids),
                                                        "completion_tokens": completion,
                                                        "total_tokens": len(prompt_ids) + completion}})
        yield b"data: [DONE]\n\n"
    finally:
        with state.lock:
            state.in_flight -= 1


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="fake-vllm")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve")
    serve.add_argument("model")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--enable-lora", action="store_true")
    serve.add_argument("--max-lora-rank", type=int, default=16)
    serve.add_argument("--max-loras", type=int, default=1)
    serve.add_argument("--enable-sleep-mode", action="store_true")
    args, _unknown = serve.parse_known_args(argv[1:]) if argv and argv[0] == "serve" else parser.parse_known_args(argv)
    env_names = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_SERVER_DEV_MODE", "CUDA_VISIBLE_DEVICES")
    state = FakeState(
        base_model=args.model, max_lora_rank=args.max_lora_rank, sleep_mode=args.enable_sleep_mode,
        lora_updating=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("true", "1")
        and args.enable_lora,
        dev_mode=os.environ.get("VLLM_SERVER_DEV_MODE") == "1", exit_on_crash=True, argv=argv,
        env={name: os.environ.get(name) for name in env_names},
    )
    import uvicorn

    uvicorn.run(create_fake_vllm(state), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
