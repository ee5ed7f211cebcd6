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
- `GET /v1/models` (adapters listed with `parent`), `GET /health`;
- `--uds PATH`: on that Unix socket instead of a port; `VLLM_API_KEY`: every route but
  `/health` needs it as a bearer (401 otherwise).

Stricter where vLLM is: sampling fields a request leaves out come from the model's generation
config (`MODEL_GENERATION_CONFIG`, Qwen2.5-Instruct's) unless started with `--generation-config
vllm`; logprobs are raw (`log_softmax` of the logits, whatever the sampling fields) unless
`--logprobs-mode processed_logprobs` (then penalties, temperature, min_p, top-k, top-p as vLLM's
sampler applies them, over `FAKE_LOGITS` or a test's `FakeState.logits`), and the `*_logits`
modes return the logits themselves; a choice that stops ends with EOS in `token_ids` and `logprobs` (not
in the text); `top_logprobs` need not hold the sampled token; `/sleep` and `/wake_up` answer
JSON, and `/sleep` aborts in-flight streams; loading an adapter while asleep is refused (500);
a rank above `--max-lora-rank` is a 500, and so is a LoRA on `lm_head` or `embed_tokens`
(as the real CPU vLLM answered); the adapter routes exist with
VLLM_ALLOW_RUNTIME_LORA_UPDATING alone (loading then needs `--enable-lora`).

Made for tests: every completion's text names the model that answered (`[agent@1] ...`), so a
test sees which adapter served it; `/fake/state` shows the event log (load, unload, sleep,
wake_up, chat with the `priority` and `request_id` it was sent with — and any chat that arrived while asleep), argv and
the vLLM env vars;
`POST /fake/script` sets a per-token delay, a parser that holds text back (chunks with an
empty delta that carry only token ids), or a crash after N chunks (the process exits, as a
dying vLLM would; in-thread servers drop the connection instead).

Everything a CPU vLLM can show is tested against the real one (tests/test_vllm_real.py); this
stand-in stays for what it cannot: sleep mode, GPU memory, scripted crashes at a chosen chunk.

Run as a process with vLLM's CLI shape: `python tests/fake_vllm.py serve MODEL --port P ...`.
`--answer-delay S` (not vLLM's) holds each non-streamed answer S seconds, as a generating vLLM
would be busy (bench/router_cost.py).
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
    lora_enabled: bool = True  # --enable-lora
    logprobs_mode: str = "raw_logprobs"  # vLLM's default; rlproxy starts it with processed_logprobs
    generation_config: str = "auto"  # vLLM's default: sampling defaults from the model's files
    logits: tuple[float, ...] | None = None  # the candidates' logits at every position; None: FAKE_LOGITS
    argv: list[str] = field(default_factory=list)
    env: dict[str, str | None] = field(default_factory=dict)
    loaded: dict[str, str] = field(default_factory=dict)
    asleep: bool = False
    events: list[dict] = field(default_factory=list)
    chats_while_asleep: int = 0
    token_delay: float = 0.0
    answer_delay: float = 0.0  # a non-streamed answer's wait, as a vLLM generating it would (benches)
    parser_holds: bool = False
    crash_after_chunks: int | None = None
    # A proxy in front of vLLM that quotes the request's Authorization header in its errors.
    echo_auth_in_errors: bool = False
    in_flight: int = 0
    sampling: list[dict] = field(default_factory=list)  # what each chat sampled with
    aborts: int = 0  # bumped by /sleep: vLLM aborts in-flight requests when it goes to sleep
    lock: threading.Lock = field(default_factory=threading.Lock)

    def event(self, kind: str, **data) -> None:
        with self.lock:
            self.events.append({"kind": kind, "at": time.time(), **data})

    def snapshot(self) -> dict:
        with self.lock:
            return {
                "base_model": self.base_model,
                "loaded": dict(self.loaded),
                "asleep": self.asleep,
                "events": list(self.events),
                "chats_while_asleep": self.chats_while_asleep,
                "argv": self.argv,
                "env": self.env,
                "sampling": list(self.sampling),
                "in_flight": self.in_flight,
                "pid": os.getpid(),
            }


def _error(status: int, message: str, err_type: str, param: str | None = None) -> JSONResponse:
    # vLLM's ErrorResponse: {"error": {"message", "type", "param", "code"}}
    return JSONResponse(
        {"error": {"message": message, "type": err_type, "param": param, "code": status}}, status_code=status
    )


# The model's generation_config.json (Qwen2.5-Instruct's): applied to fields a request leaves out
# unless vLLM runs with --generation-config vllm.
MODEL_GENERATION_CONFIG = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
VLLM_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
}
# Logits over 8 candidates at every position; candidate 0 is the token the fake's text shows.
FAKE_LOGITS = (3.0, 2.6, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0)
EOS_ID = 151645  # <|im_end|>: in token_ids (and logprobs) when a choice stops, never in the text


def effective_sampling(body: dict, state: FakeState) -> dict:
    """What vLLM samples with: the request's fields, else the model's generation config (unless
    --generation-config vllm), else vLLM's own defaults."""
    out = dict(VLLM_DEFAULTS)
    if state.generation_config != "vllm":
        out.update(MODEL_GENERATION_CONFIG)
    out.update({k: body[k] for k in VLLM_DEFAULTS if body.get(k) is not None})
    return out


def candidate_logprobs(params: dict, mode: str, raw: tuple[float, ...] | None = None) -> list[float]:
    """Logprobs of the candidates (logits `raw`, else FAKE_LOGITS) as vLLM returns them in `mode`
    (its sampler's order: penalties on the raw logits - candidate 0 counts as already seen -,
    temperature, min_p, top-k, top-p); the logits themselves in the `*_logits` modes."""
    import math

    def log_softmax(xs):
        finite = [x for x in xs if x != -math.inf]
        top = max(finite)
        z = top + math.log(sum(math.exp(x - top) for x in finite))
        return [x - z if x != -math.inf else -math.inf for x in xs]

    logits = list(raw or FAKE_LOGITS)
    if mode == "raw_logprobs":
        return log_softmax(logits)
    if mode == "raw_logits":
        return logits
    rep = params["repetition_penalty"]
    logits[0] = logits[0] / rep if logits[0] > 0 else logits[0] * rep
    logits[0] -= params["frequency_penalty"] + params["presence_penalty"]
    temperature = params["temperature"]
    if temperature < 1e-5:
        # the all-greedy path: penalised logits at T = 1
        return logits if mode == "processed_logits" else log_softmax(logits)
    logits = [x / temperature for x in logits]
    probs = [math.exp(lp) for lp in log_softmax(logits)]
    if params["min_p"] > 0:
        cut = params["min_p"] * max(probs)
        logits = [x if p >= cut else -math.inf for x, p in zip(logits, probs, strict=False)]
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    k = params["top_k"]
    if k and k > 0:
        for i in order[k:]:
            logits[i] = -math.inf
    if params["top_p"] < 1:
        probs = [math.exp(lp) for lp in log_softmax(logits)]
        total = 0.0
        for rank, i in enumerate(order):
            if total >= params["top_p"] and rank > 0:
                logits[i] = -math.inf
            total += probs[i]
    return logits if mode == "processed_logits" else log_softmax(logits)


def prompt_ids_for(messages: list[dict]) -> list[int]:
    """A stand-in tokenizer: one id per character of a simple chat rendering."""
    text = (
        "".join(f"<{m.get('role')}>{m.get('content') if isinstance(m.get('content'), str) else ''}" for m in messages)
        + "<assistant>"
    )
    return [ord(ch) % 4096 for ch in text]


def completion_tokens(
    model: str, max_tokens: int, choice: int, lps: list[float] | None = None, stop: bool = False
) -> list[tuple[int, str, float, list[float]]]:
    """(id, text, logprob, candidates' logprobs) per sampled token; the first names the model.
    Odd positions sample candidate 1 where it survives top-k/top-p (so `top_logprobs` need not
    hold the sampled token); a choice that stops ends with EOS (empty text, its own logprob)."""
    import math

    lps = lps or [-0.25] * len(FAKE_LOGITS)
    pieces = [f"[{model}]", *[" " + w for w in WORDS]][:max_tokens]
    out = []
    for i, text in enumerate(pieces):
        pick = 1 if i % 2 and lps[1] != -math.inf else 0
        out.append((5000 + 10 * i + choice, text, lps[pick], lps))
    if stop:
        pick = 1 if len(pieces) % 2 and lps[1] != -math.inf else 0
        out.append((EOS_ID, "", lps[pick], lps))
    return out


def logprob_entry(text: str, logprob: float, top: int, candidates: list[float] | None = None) -> dict:
    values = list(candidates or [logprob - j for j in range(25)])
    pick = values.index(logprob) if logprob in values else 0  # which candidate was sampled
    names = [f"alt{j}" for j in range(len(values))]
    names[pick] = text or "<|im_end|>"
    tops = sorted(
        (
            {"token": names[j], "logprob": v, "bytes": list(names[j].encode())}
            for j, v in enumerate(values)
            if v != float("-inf")
        ),
        key=lambda e: -e["logprob"],
    )
    return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": tops[:top]}


def create_fake_vllm(state: FakeState) -> FastAPI:
    app = FastAPI()
    app.state.fake = state

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        data = [
            {
                "id": state.base_model,
                "object": "model",
                "owned_by": "vllm",
                "root": state.base_model,
                "parent": None,
                "max_model_len": state.max_model_len,
            }
        ]
        data += [
            {
                "id": name,
                "object": "model",
                "owned_by": "vllm",
                "root": path,
                "parent": state.base_model,
                "max_model_len": state.max_model_len,
            }
            for name, path in state.loaded.items()
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        model = body.get("model") or state.base_model
        state.event(
            "chat",
            model=model,
            stream=bool(body.get("stream")),
            asleep=state.asleep,
            priority=body.get("priority"),
            request_id=body.get("request_id"),  # vLLM logs the call under it (chatcmpl-ID)
        )
        if state.asleep:
            with state.lock:
                state.chats_while_asleep += 1
            return _error(503, "the engine is sleeping", "ServiceUnavailable")
        if state.echo_auth_in_errors:
            return _error(400, f"refused the request with {request.headers.get('authorization')}", "BadRequestError")
        if model != state.base_model and model not in state.loaded:
            return _error(
                404, f"The model `{model}` does not exist. Valid aliases: {state.base_model}.", "NotFoundError", "model"
            )
        if body.get("top_logprobs") and not body.get("logprobs"):
            return _error(400, "when using `top_logprobs`, `logprobs` must be set to true.", "BadRequestError")
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 6)
        prompt_length = len(prompt_ids_for(body.get("messages") or []))
        if max_tokens > state.max_model_len:  # what vLLM 0.32 (CPU build) answered
            return _error(
                400,
                f"max_tokens={max_tokens} cannot be greater than max_model_len={state.max_model_len}. "
                f"Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})",
                "BadRequestError",
                "max_tokens",
            )
        if prompt_length >= state.max_model_len:  # what vLLM 0.32 (CPU build) answered
            return _error(
                400,
                f"This model's maximum context length is {state.max_model_len} tokens. However, your "
                f"prompt contains at least {prompt_length} input tokens, which exceeds this limit even "
                "without any output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={prompt_length})",
                "BadRequestError",
            )
        max_tokens = min(max_tokens, state.max_model_len - prompt_length)  # vLLM cuts a completion to what fits
        n = int(body.get("n") or 1)
        want_ids = bool(body.get("return_token_ids"))
        top = int(body.get("top_logprobs") or 0)
        want_lp = bool(body.get("logprobs"))
        prompt_ids = prompt_ids_for(body.get("messages") or [])
        finish = "length" if max_tokens < len(WORDS) + 1 else "stop"
        params = effective_sampling(body, state)
        state.sampling.append(params)
        lps = candidate_logprobs(params, state.logprobs_mode, state.logits)
        choices = [completion_tokens(model, max_tokens, i, lps, stop=finish == "stop") for i in range(n)]
        created, cid = int(time.time()), "chatcmpl-" + uuid.uuid4().hex
        if body.get("stream"):
            return StreamingResponse(
                _stream(
                    state,
                    cid,
                    created,
                    model,
                    prompt_ids,
                    choices,
                    finish,
                    want_ids,
                    want_lp,
                    top,
                    bool((body.get("stream_options") or {}).get("include_usage")),
                    bool((body.get("stream_options") or {}).get("continuous_usage_stats")),
                ),
                media_type="text/event-stream",
            )
        if state.crash_after_chunks is not None:
            _crash(state)
        if state.answer_delay:
            await asyncio.sleep(state.answer_delay)
        out_choices = []
        for i, tokens in enumerate(choices):
            out_choices.append(
                {
                    "index": i,
                    "message": {
                        "role": "assistant",
                        "content": "".join(t for _, t, _, _ in tokens),
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "reasoning": None,
                    },
                    "logprobs": {"content": [logprob_entry(t, lp, top, c) for _, t, lp, c in tokens]}
                    if want_lp
                    else None,
                    "finish_reason": finish,
                    "stop_reason": None,
                    "token_ids": [tid for tid, _, _, _ in tokens] if want_ids else None,
                }
            )
        completion = sum(len(t) for t in choices)
        return JSONResponse(
            {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": out_choices,
                "service_tier": None,
                "system_fingerprint": None,
                "usage": {
                    "prompt_tokens": len(prompt_ids),
                    "total_tokens": len(prompt_ids) + completion,
                    "completion_tokens": completion,
                    "prompt_tokens_details": None,
                },
                "prompt_logprobs": None,
                "prompt_token_ids": prompt_ids if want_ids else None,
                "kv_transfer_params": None,
            }
        )

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        """vLLM's /tokenize with `messages`: the chat rendering's ids (the stand-in tokenizer's)."""
        body = await request.json()
        if body.get("model") != state.base_model:
            return JSONResponse({"error": {"message": f"The model `{body.get('model')}` does not exist."}}, 404)
        ids = prompt_ids_for(body.get("messages") or [])
        return JSONResponse({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids})

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
                return _error(
                    400,
                    f"The lora adapter '{name}' has already been loaded. If you want to load the "
                    "adapter in place, set 'load_inplace' to True.",
                    "InvalidUserInput",
                )
            if not state.lora_enabled:
                return _error(400, "LoRA is not enabled. Start vLLM with --enable-lora.", "BadRequestError")
            if state.asleep:
                # Its LoRA slots are unmapped at sleep level 1: a real vLLM fails or corrupts here.
                state.event("load_refused_asleep", name=name)
                return _error(500, "cannot load a LoRA adapter while the engine is sleeping", "InternalServerError")
            config = Path(path) / "adapter_config.json"
            if not config.exists():
                return _error(404, f"Loading lora {name} failed: No adapter found for <path>", "NotFoundError")
            adapter = json.loads(config.read_text())
            targets = adapter.get("target_modules") or []
            if any(t.rsplit(".", 1)[-1] in ("lm_head", "embed_tokens") for t in targets):
                # What vLLM 0.32 (CPU build) answered to a LoRA on the built-in model's head.
                return _error(
                    500,
                    "While loading " + path + ", expected target modules in {q_proj, k_proj, v_proj, "
                    "o_proj, gate_proj, up_proj, down_proj} but received " + str(targets),
                    "InternalServerError",
                )
            rank = adapter.get("r", 8)
            if rank > state.max_lora_rank:
                return _error(
                    500,
                    f"Call to add_lora method failed: Worker failed with error 'LoRA rank {rank} is "
                    f"greater than max_lora_rank {state.max_lora_rank}.', please check the stack trace "
                    "above for the root cause",
                    "InternalServerError",
                )
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
                return _error(
                    500, "Sleep mode is not enabled. Enable it with --enable-sleep-mode.", "InternalServerError"
                )
            level = int(request.query_params.get("level", "1"))
            state.event("sleep", level=level, in_flight=state.in_flight)
            with state.lock:
                state.aborts += 1  # vLLM's /sleep aborts whatever is still generating
            state.asleep = True
            return JSONResponse({"status": "ok", "is_sleeping": True})

        @app.post("/wake_up")
        async def wake_up() -> Response:
            state.event("wake_up")
            state.asleep = False
            return JSONResponse({"status": "ok", "is_sleeping": False})

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


async def _stream(
    state: FakeState,
    cid: str,
    created: int,
    model: str,
    prompt_ids: list[int],
    choices: list[list[tuple[int, str, float]]],
    finish: str,
    want_ids: bool,
    want_lp: bool,
    top: int,
    include_usage: bool,
    continuous: bool = False,
):
    def sse(data: dict) -> bytes:
        if include_usage and continuous and data.get("choices"):  # vLLM's usage so far, in every chunk
            data["usage"] = {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": sent,
                "total_tokens": len(prompt_ids) + sent,
            }
        return b"data: " + json.dumps(data).encode() + b"\n\n"

    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
    sent = 0
    aborts = state.aborts
    with state.lock:
        state.in_flight += 1
    try:
        for i in range(len(choices)):
            first = {
                **base,
                "choices": [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                ],
            }
            if want_ids:
                first["prompt_token_ids"] = prompt_ids
            yield sse(first)
        for i, tokens in enumerate(choices):
            held = ""
            for position, (tid, text, lp, cands) in enumerate(tokens):
                if state.aborts != aborts:
                    return  # /sleep aborted this request: the stream ends without [DONE]
                if state.crash_after_chunks is not None and sent >= state.crash_after_chunks:
                    _crash(state)
                if state.token_delay:
                    await asyncio.sleep(state.token_delay)
                last = position == len(tokens) - 1
                if state.parser_holds and position == 0 and not last:
                    delta, held = {}, text  # a tool/reasoning parser held the text back
                else:
                    delta, held = {"content": held + text}, ""
                choice = {
                    "index": i,
                    "delta": delta,
                    "logprobs": {"content": [logprob_entry(text, lp, top, cands)]} if want_lp else None,
                    "finish_reason": finish if last else None,
                }
                if last:
                    choice["stop_reason"] = None
                if want_ids:
                    choice["token_ids"] = [tid]
                yield sse({**base, "choices": [choice]})
                sent += 1
        if include_usage:
            completion = sum(len(t) for t in choices)
            yield sse(
                {
                    **base,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": len(prompt_ids),
                        "completion_tokens": completion,
                        "total_tokens": len(prompt_ids) + completion,
                    },
                }
            )
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
    serve.add_argument("--uds", default=None)
    serve.add_argument("--enable-lora", action="store_true")
    serve.add_argument("--max-lora-rank", type=int, default=16)
    serve.add_argument("--max-loras", type=int, default=1)
    serve.add_argument("--enable-sleep-mode", action="store_true")
    serve.add_argument("--generation-config", default="auto")
    serve.add_argument(
        "--logprobs-mode",
        default="raw_logprobs",
        choices=("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"),
    )
    serve.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    serve.add_argument("--quantization", default=None)
    serve.add_argument(
        "--answer-delay", type=float, default=0.0, help="not vLLM's: seconds each non-streamed answer waits"
    )
    args, _unknown = serve.parse_known_args(argv[1:]) if argv and argv[0] == "serve" else parser.parse_known_args(argv)
    env_names = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_SERVER_DEV_MODE", "CUDA_VISIBLE_DEVICES")
    state = FakeState(
        base_model=args.model,
        max_lora_rank=args.max_lora_rank,
        sleep_mode=args.enable_sleep_mode,
        lora_updating=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("true", "1"),
        lora_enabled=args.enable_lora,
        logprobs_mode=args.logprobs_mode,
        generation_config=args.generation_config,
        dev_mode=os.environ.get("VLLM_SERVER_DEV_MODE") == "1",
        exit_on_crash=True,
        answer_delay=args.answer_delay,
        argv=argv,
        env={name: os.environ.get(name) for name in env_names},
    )
    import uvicorn

    app = create_fake_vllm(state)
    if os.environ.get("VLLM_API_KEY"):
        app = require_key(app, os.environ["VLLM_API_KEY"])
    if args.uds:
        # As vLLM binds it (create_server_unix_socket): a file already there, even a dead
        # server's socket, makes the start fail (uvicorn's own `uds` would replace it).
        import socket

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(args.uds)
        uvicorn.run(app, fd=sock.fileno(), log_level="warning")
    else:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


def require_key(app, key: str):
    """vLLM's --api-key (or VLLM_API_KEY): every route but /health (and the tests' /fake/ ones)
    needs `Authorization: Bearer KEY`."""

    async def guarded(scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health" and not scope["path"].startswith("/fake/"):
            headers = dict(scope["headers"])
            if headers.get(b"authorization") != b"Bearer " + key.encode():
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await app(scope, receive, send)

    return guarded


if __name__ == "__main__":
    main()
