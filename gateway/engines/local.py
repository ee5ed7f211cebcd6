"""The local engine: transformers + peft in the gateway process.

`LocalEngine` is the asyncio face of the engine: it loads the model, validates requests,
renders them with the chat template and tokenises them on the event loop, queues them for
the worker thread (gateway/engines/local_worker.py, which owns the model and runs the
continuous batch, the sampling and the adapter loads), and turns what the worker sends back
into OpenAI responses, stream chunks and token records.

The logprob recorded for each sampled token is its behaviour logprob: under the processed
distribution it was sampled from (penalties, temperature, min_p, top-k, top-p; see
local_worker.py), with the sampling parameters in force (`TokenRecord.sampling`). A client
that asks for `logprobs` gets those same numbers (as vLLM's `processed_logprobs` mode gives
them), not the raw model's. vLLM's `top_k`, `min_p` and `repetition_penalty` are accepted as
extra body fields. Streaming sends content as it is decoded: text that could
still become a stop string, an incomplete UTF-8 character or (with tools) a `<tool_call>`
block is held back. `response_format` is accepted and ignored (no constrained decoding);
`tool_choice` "required" or a named function is treated as "auto".
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gateway.chat.toolcalls import ToolCallStream, parse_tool_calls
from gateway.engines.base import ChoiceTokens, Completion, Engine, EngineRequest, StreamChunk, StreamEnd, TokenRecord
from gateway.engines.local_worker import BASE_ADAPTER, ChoiceResult, Control, Job, Sampling, Worker
from gateway.errors import ConfigError, Conflict, EngineUnavailable, InvalidRequest, NotFound, RLProxyError
from gateway.protocols.chat import ChatCompletionRequest

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- the engine


class LocalEngine(Engine):
    kind = "local"
    supports_adapters = True

    def __init__(
        self,
        model_path: str,
        served_base_id: str,
        *,
        device: str = "cpu",
        max_batch_size: int = 16,
        default_max_tokens: int = 256,
        dtype: str | None = None,
        threads: int | None = None,
    ):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        self.model_path = str(model_path)
        self.served_base_id = served_base_id
        self.device = device
        self.max_batch_size = max_batch_size
        self.default_max_tokens = default_max_tokens
        self.dtype = dtype  # None: float32 on CPU, bfloat16 elsewhere
        # torch intra-op threads on CPU (process-wide). None: 1 for small models, whose ops are too
        # small to split (on a busy 2-core machine 2 threads made the tiny model's steps 10x slower),
        # torch's default otherwise.
        self.threads = threads
        self.tokenizer = None
        self.model = None  # what forward calls: the base model, or the PeftModel wrapping it
        self.step_batch_sizes: deque[int] = deque(maxlen=100_000)  # rows per forward (instrumentation)
        self._peft = False
        self._adapters: set[str] = set()  # loaded, written on the worker only
        self._unloading: set[str] = set()
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # Job | Control | None (stop), for the worker
        self._thread: threading.Thread | None = None
        self.eos_ids: set[int] = set()
        self.pad_id = 0
        self._context = 0
        self._token_cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_decoder = _byte_decoder()

    # ------------------------------------------------------------ lifecycle

    @property
    def base_model_id(self) -> str:
        return self.served_base_id

    @property
    def context_length(self) -> int | None:
        return self._context or None

    async def start(self) -> None:
        if self._thread is not None:
            return
        try:
            await asyncio.to_thread(self._load)
        except RLProxyError:
            raise
        except Exception as error:  # a missing directory, an unknown model id offline, a bad config...
            raise ConfigError(f"cannot load the model '{self.model_path}': {error}") from error
        self._thread = threading.Thread(target=Worker(self).run, name="rlproxy-local-engine", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        dtype = self.dtype or ("float32" if self.device == "cpu" else "bfloat16")
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=getattr(torch, dtype))
        self.model = model.to(self.device).eval()
        if self.device == "cpu":
            small = sum(p.numel() for p in model.parameters()) < 100_000_000
            threads = self.threads or (1 if small else None)
            if threads:
                torch.set_num_threads(threads)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        if not eos:
            raise ConfigError(f"the model at {self.model_path} defines no eos token (generation_config or tokenizer)")
        self.eos_ids = set(eos)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos[0]
        self._context = int(getattr(model.config, "max_position_embeddings", 0) or self.tokenizer.model_max_length)

    async def close(self) -> None:
        if self._thread is None:
            return
        self.inbox.put(None)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    # ------------------------------------------------------------ adapters

    async def load_adapter(self, name: str, path: Path) -> None:
        self._require_started()
        if name == BASE_ADAPTER or not name:
            raise InvalidRequest(f"'{name}' cannot be an adapter name")
        if name in self._adapters:
            raise Conflict(f"adapter '{name}' is already loaded; unload it first")
        if not (Path(path) / "adapter_config.json").is_file():
            raise NotFound(f"no PEFT adapter at {path} (adapter_config.json is missing)")
        await self._control("load", name, Path(path))

    async def unload_adapter(self, name: str) -> None:
        self._require_started()
        if name not in self._adapters:
            raise NotFound(f"adapter '{name}' is not loaded")
        self._unloading.add(name)
        try:
            await self._control("unload", name, None)
        finally:
            self._unloading.discard(name)

    async def _control(self, kind: str, name: str, path: Path | None) -> None:
        loop = asyncio.get_running_loop()
        control = Control(kind, name, path, loop.create_future(), loop)
        self.inbox.put(control)
        await control.future

    # ------------------------------------------------------------ requests

    async def complete(self, request: EngineRequest) -> Completion:
        req, job, parse_tools = self._submit(request, stream=False)
        results: list[ChoiceResult | None] = [None] * job.n
        try:
            for _ in range(job.n):
                kind, payload = await job.events.get()
                if kind == "error":
                    raise payload
                results[payload.index] = payload
        except BaseException:
            job.cancelled.set()
            raise
        choices = []
        for result in results:
            message, has_calls = self._message(result.text, parse_tools)
            choices.append(
                {
                    "index": result.index,
                    "message": message,
                    "logprobs": {"content": self._logprob_entries(result.completion_ids, result.logprobs, result.top)}
                    if req.logprobs
                    else None,
                    "finish_reason": "tool_calls" if has_calls else result.finish_reason,
                }
            )
        response = {
            "id": _completion_id(request.request_id),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": choices,
            "usage": _usage(job.prompt_ids, results),
        }
        return Completion(response=response, tokens=_token_record(job, results))

    async def stream(self, request: EngineRequest) -> AsyncIterator[StreamChunk | StreamEnd]:
        req, job, parse_tools = self._submit(request, stream=True)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = {
            "id": _completion_id(request.request_id),
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": req.model,
        }

        def chunk(index: int, delta: dict, logprobs: list | None = None, finish_reason: str | None = None):
            data = {
                **head,
                "choices": [
                    {
                        "index": index,
                        "delta": delta,
                        "logprobs": {"content": logprobs} if logprobs is not None else None,
                        "finish_reason": finish_reason,
                    }
                ],
            }
            if include_usage:
                data["usage"] = None
            return StreamChunk(data)

        streamed = [""] * job.n  # raw text received per choice
        tool_streams = [ToolCallStream() for _ in range(job.n)] if parse_tools else None
        pending_logprobs: list[list] = [[] for _ in range(job.n)]
        results: list[ChoiceResult | None] = [None] * job.n
        finished = 0
        try:
            for index in range(job.n):
                yield chunk(index, {"role": "assistant", "content": ""})
            while finished < job.n:
                kind, payload = await job.events.get()
                if kind == "error":
                    raise payload
                if kind == "delta":
                    for index, text, ids, logprobs, top in payload:
                        if req.logprobs:
                            pending_logprobs[index] += self._logprob_entries(ids, logprobs, top)
                        streamed[index] += text
                        content = tool_streams[index].push(streamed[index]) if tool_streams else text
                        if content:
                            entries, pending_logprobs[index] = pending_logprobs[index], []
                            yield chunk(index, {"content": content}, entries if req.logprobs else None)
                    continue
                result: ChoiceResult = payload  # kind == "finish"
                index = result.index
                results[index] = result
                finished += 1
                calls: list[dict] = []
                if tool_streams:
                    content, calls = tool_streams[index].finish(result.text)
                else:
                    if not result.text.startswith(streamed[index]):
                        log.warning("stream of %s diverged from its final text", request.request_id)
                    content = result.text[len(streamed[index]) :]
                entries, pending_logprobs[index] = pending_logprobs[index], []
                if content:
                    yield chunk(index, {"content": content}, entries if req.logprobs else None)
                    entries = []
                for position, call in enumerate(calls):
                    yield chunk(index, {"tool_calls": [{"index": position, **call}]})
                yield chunk(
                    index,
                    {},
                    entries if (req.logprobs and entries) else None,
                    "tool_calls" if calls else result.finish_reason,
                )
        except BaseException:
            job.cancelled.set()
            raise
        if include_usage:
            yield StreamChunk({**head, "choices": [], "usage": _usage(job.prompt_ids, results)})
        yield StreamEnd(_token_record(job, results))

    def _submit(self, request: EngineRequest, *, stream: bool) -> tuple[ChatCompletionRequest, Job, bool]:
        """Validate, render and tokenise on the event loop; queue the job for the worker."""
        self._require_started()
        try:
            req = ChatCompletionRequest.model_validate(request.body)
        except ValidationError as error:
            raise InvalidRequest(_validation_message(error)) from None
        adapter = request.adapter
        if adapter is not None and (adapter not in self._adapters or adapter in self._unloading):
            raise NotFound(f"adapter '{adapter}' is not loaded in the local engine", param="model")
        prompt_ids = self.render(req)
        limit = req.max_completion_tokens or req.max_tokens
        room = self._context - len(prompt_ids)
        if room < 1 or (limit is not None and limit > room):
            asked = f" + {limit} completion tokens" if limit is not None else ""
            raise InvalidRequest(
                f"this model's context is {self._context} tokens; the messages take {len(prompt_ids)} tokens{asked}. "
                "Shorten the messages or lower max_completion_tokens / max_tokens.",
                param="messages",
                code="context_length_exceeded",
            )
        extra = _extra_sampling(req.model_extra or {})
        sampling = Sampling(
            max_new_tokens=limit if limit is not None else min(self.default_max_tokens, room),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            stops=[s for s in (req.stop or []) if s],
            top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
            seed=req.seed,
            **extra,
        )
        job = Job(prompt_ids, req.n, adapter, sampling, req.seed, stream, self.device)
        self.inbox.put(job)
        parse_tools = bool(req.tools) and req.tool_choice != "none"
        return req, job, parse_tools

    def render(self, req: ChatCompletionRequest) -> list[int]:
        """Prompt token ids: the chat template over messages (+ tools), with the generation prompt."""
        messages = [_template_message(m) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as error:  # jinja raises its own types, templates raise exceptions by design
            raise InvalidRequest(
                f"the model's chat template rejected these messages: {error}", param="messages"
            ) from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def health(self) -> str | None:
        if self._thread is None:
            return "the local engine is not started"
        if not self._thread.is_alive():
            return "the local engine's worker thread has stopped; see the gateway log"
        return None

    def _require_started(self) -> None:
        if self._thread is None:
            raise EngineUnavailable("the local engine is not started")

    # ------------------------------------------------------------ response pieces

    def _message(self, text: str, parse_tools: bool) -> tuple[dict, bool]:
        if not parse_tools:
            return {"role": "assistant", "content": text}, False
        content, calls = parse_tool_calls(text)
        message: dict = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return message, bool(calls)

    def _logprob_entries(self, ids: list[int], logprobs: list[float], top: list[list[tuple[int, float]]]) -> list[dict]:
        entries = []
        for position, (token_id, logprob) in enumerate(zip(ids, logprobs, strict=False)):
            token, token_bytes = self._token_text(token_id)
            alternatives = []
            for alt_id, alt_logprob in top[position] if position < len(top) else []:
                alt_token, alt_bytes = self._token_text(alt_id)
                alternatives.append({"token": alt_token, "logprob": alt_logprob, "bytes": alt_bytes})
            entries.append({"token": token, "logprob": logprob, "bytes": token_bytes, "top_logprobs": alternatives})
        return entries

    def _token_text(self, token_id: int) -> tuple[str, list[int]]:
        """A token's text and its raw bytes (a byte-level token may be part of a UTF-8 character)."""
        cached = self._token_cache.get(token_id)
        if cached is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            added = self.tokenizer.added_tokens_decoder.get(token_id)
            if added is None and piece is not None and all(c in self._byte_decoder for c in piece):
                raw = bytes(self._byte_decoder[c] for c in piece)
            else:
                raw = (added.content if added is not None else self.tokenizer.decode([token_id])).encode()
            cached = (raw.decode("utf-8", errors="replace"), list(raw))
            self._token_cache[token_id] = cached
        return cached


# ---------------------------------------------------------------- helpers


def _template_message(message) -> dict:
    """A protocol message as chat templates expect it (text content, arguments as objects)."""
    import json

    role = {"developer": "system", "function": "tool"}.get(message.role, message.role)
    out: dict = {"role": role, "content": message.text()}
    if message.name:
        out["name"] = message.name
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            arguments: Any = call.function.arguments
            try:
                parsed = json.loads(arguments)
                if isinstance(parsed, dict):
                    arguments = parsed  # templates write `arguments | tojson`, as vLLM passes them
            except ValueError:
                pass
            calls.append(
                {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}
            )
        out["tool_calls"] = calls
    return out


def _validation_message(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"]) or "body"
        parts.append(f"{where}: {item['msg']}")
    return "invalid request: " + "; ".join(parts)


def _completion_id(request_id: str) -> str:
    return request_id if request_id.startswith("chatcmpl-") else f"chatcmpl-{request_id or uuid.uuid4().hex}"


def _usage(prompt_ids: list[int], results: list[ChoiceResult]) -> dict:
    completion = sum(len(r.completion_ids) for r in results)
    return {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": completion,
        "total_tokens": len(prompt_ids) + completion,
    }


def _token_record(job: Job, results: list[ChoiceResult]) -> TokenRecord:
    return TokenRecord(
        prompt_ids=list(job.prompt_ids),
        choices=[ChoiceTokens(list(r.completion_ids), list(r.logprobs)) for r in results],
        sampling=job.sampling.in_force(),
    )


# vLLM's sampling fields beyond OpenAI's, accepted as extra body fields: (name, type, check, hint)
_EXTRA_SAMPLING = (
    ("top_k", int, lambda v: v == -1 or v >= 0, "-1 or 0 (off), or a positive number of tokens"),
    ("min_p", float, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]"),
    ("repetition_penalty", float, lambda v: v > 0, "a number > 0 (1 is off)"),
)


def _extra_sampling(extra: dict) -> dict:
    """top_k, min_p and repetition_penalty from the request's extra fields, checked."""
    out = {}
    for name, kind, valid, hint in _EXTRA_SAMPLING:
        value = extra.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
            raise InvalidRequest(f"'{name}' must be {hint}; got {value!r}", param=name)
        value = kind(value)
        if not valid(value):
            raise InvalidRequest(f"'{name}' must be {hint}; got {value!r}", param=name)
        out[name] = value
    return out


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable character → byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes, strict=False)}
