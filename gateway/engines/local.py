"""The local engine: transformers + peft in the gateway process.

One worker thread owns the model. Requests are rendered with the chat template and
tokenised on the event loop, then queued; the worker runs a continuous batch:

- every step it admits waiting requests while the batch has room (`max_batch_size`
  sequences; a request with `n` choices is `n` sequences), prefills them together (left
  padding, one prompt row per request, then repeated `n` times), and merges their KV
  cache into the running one;
- one decode step feeds every sequence its last token; rows that finish leave the batch;
- requests for different adapters share a batch through peft's mixed-adapter forward
  (`adapter_names=[...]`, "__base__" for the base model);
- adapter loads and unloads run on the worker between steps; an unload waits until no
  queued or running request uses the adapter.

Sampling is per request (temperature, top_p, presence/frequency penalties, its own
`torch.Generator` from `seed`); the logprob recorded for each sampled token is the raw
model's (log_softmax of the logits at temperature 1, before penalties, temperature and
top_p), as vLLM's default logprobs are, and it is what the trainer uses as old logprobs.
Completion ids include the final `<|im_end|>` when the model stops by itself, so
prompt + completion is a prefix of the next turn's rendering.

Streaming sends content as it is decoded: text that could still become a stop string,
an incomplete UTF-8 character or (with tools) a `<tool_call>` block is held back.
`response_format` is accepted and ignored (no constrained decoding); `tool_choice`
"required" or a named function is treated as "auto".
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import time
import uuid
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from pydantic import ValidationError

from gateway.engines.base import ChoiceTokens, Completion, Engine, EngineRequest, StreamChunk, StreamEnd, TokenRecord
from gateway.errors import ConfigError, Conflict, EngineUnavailable, InvalidRequest, NotFound, RLProxyError, UpstreamError
from gateway.protocol import ChatCompletionRequest
from gateway.toolcalls import ToolCallStream, parse_tool_calls

log = logging.getLogger(__name__)

_BASE = "__base__"  # peft's name for "no adapter" in a mixed-adapter batch


# ---------------------------------------------------------------- jobs and rows


@dataclass
class _Sampling:
    max_new_tokens: int
    temperature: float
    top_p: float
    presence_penalty: float
    frequency_penalty: float
    stops: list[str]
    top_logprobs: int  # top entries to record per token (0: none)


@dataclass
class _ChoiceResult:
    """One finished choice, sent from the worker to the request's coroutine."""

    index: int
    text: str  # decode(completion_ids, skip_special_tokens=True), cut at a stop string
    completion_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # per token, (id, logprob) best first; empty lists if not asked
    finish_reason: str  # "stop" | "length"


class _Job:
    """One request on the worker: `n` rows, a generator, a queue of events back to its coroutine."""

    def __init__(self, prompt_ids: list[int], n: int, adapter: str | None, sampling: _Sampling,
                 seed: int | None, stream: bool, device: Any):
        import torch

        self.prompt_ids = prompt_ids
        self.n = n
        self.adapter = adapter
        self.sampling = sampling
        self.stream = stream
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed if seed is not None else random.getrandbits(63))
        self.cancelled = threading.Event()
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()  # ("delta" | "finish" | "error", payload)


@dataclass
class _Row:
    """One sequence (one choice of one job) in the running batch."""

    job: _Job
    index: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    # Text, tracked incrementally when streaming or watching for stop strings (vLLM's
    # detokenizer: decode a short window ids[prefix:] and keep what lies past ids[prefix:read]).
    text: str = ""
    prefix: int = 0
    read: int = 0
    offsets: list[int] = field(default_factory=list)  # len(text) after each token
    sent: int = 0  # characters of `text` already streamed
    sent_tokens: int = 0  # tokens whose logprobs were already streamed
    finish_reason: str | None = None


@dataclass
class _Control:
    """An adapter load or unload, run on the worker between steps."""

    kind: str  # "load" | "unload"
    name: str
    path: Path | None
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop

    def resolve(self, error: BaseException | None) -> None:
        def _set() -> None:
            if self.future.done():
                return
            if error is None:
                self.future.set_result(None)
            else:
                self.future.set_exception(error)

        try:
            self.loop.call_soon_threadsafe(_set)
        except RuntimeError:  # the caller's loop is closed; nobody is waiting
            pass


# ---------------------------------------------------------------- the engine


class LocalEngine(Engine):
    kind = "local"
    supports_adapters = True

    def __init__(self, model_path: str, served_base_id: str, *, device: str = "cpu", max_batch_size: int = 16,
                 default_max_tokens: int = 256, dtype: str | None = None, threads: int | None = None):
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
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._eos_ids: set[int] = set()
        self._pad_id = 0
        self._context = 0
        self._token_cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_decoder = _byte_decoder()

    # ------------------------------------------------------------ lifecycle

    @property
    def base_model_id(self) -> str:
        return self.served_base_id

    async def start(self) -> None:
        if self._thread is not None:
            return
        try:
            await asyncio.to_thread(self._load)
        except RLProxyError:
            raise
        except Exception as error:  # a missing directory, an unknown model id offline, a bad config...
            raise ConfigError(f"cannot load the model '{self.model_path}': {error}") from error
        self._thread = threading.Thread(target=_Worker(self).run, name="rlproxy-local-engine", daemon=True)
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
        self._eos_ids = set(eos)
        self._pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos[0]
        self._context = int(getattr(model.config, "max_position_embeddings", 0) or self.tokenizer.model_max_length)

    async def close(self) -> None:
        if self._thread is None:
            return
        self._inbox.put(None)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    # ------------------------------------------------------------ adapters

    async def load_adapter(self, name: str, path: Path) -> None:
        self._require_started()
        if name == _BASE or not name:
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
        control = _Control(kind, name, path, loop.create_future(), loop)
        self._inbox.put(control)
        await control.future

    # ------------------------------------------------------------ requests

    async def complete(self, request: EngineRequest) -> Completion:
        req, job, parse_tools = self._submit(request, stream=False)
        results: list[_ChoiceResult | None] = [None] * job.n
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
            choices.append({
                "index": result.index,
                "message": message,
                "logprobs": {"content": self._logprob_entries(result.completion_ids, result.logprobs, result.top)}
                if req.logprobs else None,
                "finish_reason": "tool_calls" if has_calls else result.finish_reason,
            })
        response = {
            "id": _completion_id(request.request_id),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": choices,
            "usage": _usage(job.prompt_ids, results),
        }
        return Completion(response=response, tokens=_token_record(job.prompt_ids, results))

    async def stream(self, request: EngineRequest) -> AsyncIterator[StreamChunk | StreamEnd]:
        req, job, parse_tools = self._submit(request, stream=True)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        head = {"id": _completion_id(request.request_id), "object": "chat.completion.chunk",
                "created": int(time.time()), "model": req.model}

        def chunk(index: int, delta: dict, logprobs: list | None = None, finish_reason: str | None = None):
            data = {**head, "choices": [{"index": index, "delta": delta,
                                         "logprobs": {"content": logprobs} if logprobs is not None else None,
                                         "finish_reason": finish_reason}]}
            if include_usage:
                data["usage"] = None
            return StreamChunk(data)

        streamed = [""] * job.n  # raw text received per choice
        tool_streams = [ToolCallStream() for _ in range(job.n)] if parse_tools else None
        pending_logprobs: list[list] = [[] for _ in range(job.n)]
        results: list[_ChoiceResult | None] = [None] * job.n
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
                result: _ChoiceResult = payload  # kind == "finish"
                index = result.index
                results[index] = result
                finished += 1
                calls: list[dict] = []
                if tool_streams:
                    content, calls = tool_streams[index].finish(result.text)
                else:
                    if not result.text.startswith(streamed[index]):
                        log.warning("stream of %s diverged from its final text", request.request_id)
                    content = result.text[len(streamed[index]):]
                entries, pending_logprobs[index] = pending_logprobs[index], []
                if content:
                    yield chunk(index, {"content": content}, entries if req.logprobs else None)
                    entries = []
                for position, call in enumerate(calls):
                    yield chunk(index, {"tool_calls": [{"index": position, **call}]})
                yield chunk(index, {}, entries if (req.logprobs and entries) else None,
                            "tool_calls" if calls else result.finish_reason)
        except BaseException:
            job.cancelled.set()
            raise
        if include_usage:
            yield StreamChunk({**head, "choices": [], "usage": _usage(job.prompt_ids, results)})
        yield StreamEnd(_token_record(job.prompt_ids, results))

    def _submit(self, request: EngineRequest, *, stream: bool) -> tuple[ChatCompletionRequest, _Job, bool]:
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
                param="messages", code="context_length_exceeded")
        sampling = _Sampling(
            max_new_tokens=limit if limit is not None else min(self.default_max_tokens, room),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            stops=[s for s in (req.stop or []) if s],
            top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
        )
        job = _Job(prompt_ids, req.n, adapter, sampling, req.seed, stream, self.device)
        self._inbox.put(job)
        parse_tools = bool(req.tools) and req.tool_choice != "none"
        return req, job, parse_tools

    def render(self, req: ChatCompletionRequest) -> list[int]:
        """Prompt token ids: the chat template over messages (+ tools), with the generation prompt."""
        messages = [_template_message(m) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as error:  # jinja raises its own types, templates raise exceptions by design
            raise InvalidRequest(f"the model's chat template rejected these messages: {error}",
                                 param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

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
        for position, (token_id, logprob) in enumerate(zip(ids, logprobs)):
            token, token_bytes = self._token_text(token_id)
            alternatives = []
            for alt_id, alt_logprob in (top[position] if position < len(top) else []):
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


# ---------------------------------------------------------------- the worker


class _Worker:
    """Runs on the engine's thread; the only code that touches the model."""

    def __init__(self, engine: LocalEngine):
        import torch

        self.torch = torch
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._backend = getattr(engine.tokenizer, "backend_tokenizer", None)
        if getattr(engine.tokenizer, "clean_up_tokenization_spaces", False):
            self._backend = None  # the Python side would change spaces the backend keeps
        self.device = engine.device
        self.pending: deque[_Job] = deque()
        self.controls: list[_Control] = []
        self.rows: list[_Row] = []
        self.cache = None  # DynamicCache over `rows`, left-padded to a common length
        self.mask_BT = None  # 1 for real tokens, 0 for padding
        self.next_B = None  # each row's last sampled token, not yet in the cache
        self.outbox: list[tuple[_Job, str, Any]] = []  # events of this step, sent together
        self.stopping = False

    def run(self) -> None:
        while not self.stopping or self.rows or self.pending:
            idle = not self.rows and not self.pending and not self.controls
            self._drain(block=idle and not self.stopping)
            if self.stopping:
                self._fail_everything(EngineUnavailable("the local engine is shutting down"))
                break
            self._run_controls()
            try:
                with self.torch.inference_mode():
                    self._admit()
                    if self.rows:
                        self._decode_step()
            except Exception as error:  # keep serving: fail what was running, start clean
                log.exception("local engine step failed")
                self._fail_running(UpstreamError(f"the local model failed while generating: {error}"))
            self._send()
        self._send()
        for control in self.controls:
            control.resolve(EngineUnavailable("the local engine is shutting down"))

    def _post(self, job: _Job, kind: str, payload: Any) -> None:
        self.outbox.append((job, kind, payload))

    def _send(self) -> None:
        """Hand this step's events to their event loops: one wake-up per loop, not per event."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for job, kind, payload in self.outbox:
            by_loop.setdefault(job.loop, []).append((job, (kind, payload)))
        self.outbox = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop is closed: nobody is listening
                for job, _ in items:
                    job.cancelled.set()

    def _drain(self, block: bool) -> None:
        while True:
            try:
                item = self.engine._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if item is None:
                self.stopping = True
            elif isinstance(item, _Control):
                self.controls.append(item)
            else:
                self.pending.append(item)

    # ------------------------------------------------------------ adapters

    def _run_controls(self) -> None:
        waiting = []
        for control in self.controls:
            if control.kind == "unload" and self._in_use(control.name):
                waiting.append(control)  # unload once no queued or running request needs it
                continue
            try:
                if control.kind == "load":
                    self._load(control)
                else:
                    self._unload(control.name)
            except RLProxyError as error:
                control.resolve(error)
            except Exception as error:
                control.resolve(InvalidRequest(f"cannot {control.kind} adapter '{control.name}': {error}"))
            else:
                control.resolve(None)
        self.controls = waiting

    def _in_use(self, name: str) -> bool:
        return any(row.job.adapter == name for row in self.rows) or any(job.adapter == name for job in self.pending)

    def _load(self, control: _Control) -> None:
        from peft import PeftModel

        engine = self.engine
        if control.name in engine._adapters:
            raise Conflict(f"adapter '{control.name}' is already loaded")
        device = str(self.device)
        if not engine._peft:
            engine.model = PeftModel.from_pretrained(engine.model, str(control.path), adapter_name=control.name,
                                                     is_trainable=False, torch_device=device)
            engine._peft = True
        else:
            engine.model.load_adapter(str(control.path), adapter_name=control.name, is_trainable=False,
                                      torch_device=device)
        engine.model.eval()
        engine._adapters.add(control.name)

    def _unload(self, name: str) -> None:
        engine = self.engine
        if name not in engine._adapters:
            raise NotFound(f"adapter '{name}' is not loaded")
        if len(engine._adapters) == 1:
            engine.model = engine.model.unload().eval()  # drop the LoRA layers: back to the plain base model
            engine._peft = False
        else:
            with warnings.catch_warnings():  # "adapter X was active": we never use the active adapter
                warnings.simplefilter("ignore")
                engine.model.delete_adapter(name)
        engine._adapters.discard(name)

    # ------------------------------------------------------------ batching

    def _admit(self) -> None:
        torch = self.torch
        new: list[_Job] = []
        rows = len(self.rows)
        while self.pending:
            job = self.pending[0]
            if job.cancelled.is_set():
                self.pending.popleft()
                continue
            if job.adapter is not None and job.adapter not in self.engine._adapters:
                self.pending.popleft()
                self._post(job, "error", NotFound(f"adapter '{job.adapter}' is not loaded in the local engine"))
                continue
            if rows and rows + job.n > self.engine.max_batch_size:
                break
            new.append(self.pending.popleft())
            rows += job.n
        if not new:
            return
        # prefill: one row per job, left-padded
        width = max(len(job.prompt_ids) for job in new)
        ids_JT = torch.full((len(new), width), self.engine._pad_id, dtype=torch.long)
        mask_JT = torch.zeros((len(new), width), dtype=torch.long)
        for j, job in enumerate(new):
            ids_JT[j, width - len(job.prompt_ids):] = torch.tensor(job.prompt_ids)
            mask_JT[j, width - len(job.prompt_ids):] = 1
        ids_JT, mask_JT = ids_JT.to(self.device), mask_JT.to(self.device)
        cache = self._new_cache()
        logits_JV = self._forward(ids_JT, mask_JT, cache, [job.adapter for job in new], logits_to_keep=1)
        # n choices of a job share its prompt: repeat its row n times
        repeat_R = torch.tensor([j for j, job in enumerate(new) for _ in range(job.n)], device=self.device)
        cache.batch_select_indices(repeat_R)
        new_rows = [_Row(job, index) for job in new for index in range(job.n)]
        tokens_R, chosen_R, top = self._sample(logits_JV[repeat_R], new_rows)
        mask_RT = mask_JT[repeat_R]
        keep = self._record(new_rows, tokens_R, chosen_R, top)
        if not keep:
            return
        keep_R = torch.tensor(keep, device=self.device)
        cache.batch_select_indices(keep_R)
        self._merge([new_rows[i] for i in keep], cache, mask_RT[keep_R], tokens_R[keep_R])

    def _merge(self, rows: list[_Row], cache, mask_RT, next_R) -> None:
        """Add prefilled rows to the running batch, left-padding the shorter side's cache."""
        torch = self.torch
        if not self.rows:
            self.rows, self.cache, self.mask_BT, self.next_B = rows, cache, mask_RT, next_R
            return
        width = max(self.mask_BT.shape[1], mask_RT.shape[1])

        def pad(t, dim_from_end: int):
            missing = width - t.shape[-dim_from_end]
            if missing == 0:
                return t
            spec = [0, 0] * (dim_from_end - 1) + [missing, 0]
            return torch.nn.functional.pad(t, spec)

        layers = []
        for old, new in zip(self.cache.layers, cache.layers):
            layers.append((torch.cat([pad(old.keys, 2), pad(new.keys, 2)]),
                           torch.cat([pad(old.values, 2), pad(new.values, 2)])))
        self.cache = self._new_cache(layers)
        self.mask_BT = torch.cat([pad(self.mask_BT, 1), pad(mask_RT, 1)])
        self.next_B = torch.cat([self.next_B, next_R])
        self.rows = self.rows + rows

    def _decode_step(self) -> None:
        torch = self.torch
        alive = [i for i, row in enumerate(self.rows) if not row.job.cancelled.is_set()]
        if len(alive) < len(self.rows):
            self._select(alive)
            if not self.rows:
                return
        self.mask_BT = torch.cat([self.mask_BT, torch.ones_like(self.mask_BT[:, :1])], dim=1)
        logits_BV = self._forward(self.next_B[:, None], self.mask_BT, self.cache,
                                  [row.job.adapter for row in self.rows])
        tokens_B, chosen_B, top = self._sample(logits_BV, self.rows)
        keep = self._record(self.rows, tokens_B, chosen_B, top)
        self.next_B = tokens_B
        if len(keep) < len(self.rows):
            self._select(keep)

    def _select(self, keep: list[int]) -> None:
        """Keep only these rows; drop cache columns that are padding in every remaining row."""
        if not keep:
            self.rows, self.cache, self.mask_BT, self.next_B = [], None, None, None
            return
        keep_K = self.torch.tensor(keep, device=self.device)
        self.rows = [self.rows[i] for i in keep]
        self.cache.batch_select_indices(keep_K)
        self.mask_BT, self.next_B = self.mask_BT[keep_K], self.next_B[keep_K]
        first = int(self.mask_BT.any(dim=0).nonzero()[0])
        if first > 0:
            self.mask_BT = self.mask_BT[:, first:]
            self.cache = self._new_cache([(layer.keys[:, :, first:], layer.values[:, :, first:])
                                          for layer in self.cache.layers])

    def _new_cache(self, layers: list | None = None):
        from transformers import DynamicCache

        return DynamicCache(layers) if layers is not None else DynamicCache()

    def _forward(self, ids_BT, mask_BT, cache, adapters: list[str | None], logits_to_keep: int = 1):
        """Logits of the last position of every row, float32: [B, V]."""
        torch = self.torch
        position_BT = (mask_BT.cumsum(-1) - 1).clamp(min=0)[:, -ids_BT.shape[1]:]
        kwargs = {}
        if self.engine._peft:
            kwargs["adapter_names"] = [name or _BASE for name in adapters]
        self.engine.step_batch_sizes.append(ids_BT.shape[0])
        out = self.engine.model(input_ids=ids_BT, attention_mask=mask_BT, position_ids=position_BT,
                                past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep, **kwargs)
        return out.logits[:, -1, :].to(torch.float32)

    # ------------------------------------------------------------ sampling

    def _sample(self, logits_BV, rows: list[_Row]):
        """Sample one token per row. Returns tokens [B], their raw logprobs [B] and, if any row
        asked for them, the top (id, logprob) pairs of every row."""
        torch = self.torch
        logprobs_BV = torch.log_softmax(logits_BV, dim=-1)  # raw: what the trainer's ratios start from
        scores_BV = logits_BV
        penalised = [i for i, row in enumerate(rows)
                     if row.ids and (row.job.sampling.presence_penalty or row.job.sampling.frequency_penalty)]
        if penalised:
            scores_BV = logits_BV.clone()
            for i in penalised:
                counts_V = torch.bincount(torch.tensor(rows[i].ids, device=self.device),
                                          minlength=scores_BV.shape[1])[: scores_BV.shape[1]].to(scores_BV.dtype)
                sampling = rows[i].job.sampling
                scores_BV[i] -= sampling.frequency_penalty * counts_V + sampling.presence_penalty * (counts_V > 0)
        temperature_B = torch.tensor([row.job.sampling.temperature for row in rows], device=self.device)
        probs_BV = torch.softmax(scores_BV / temperature_B.clamp(min=1e-6)[:, None], dim=-1)
        top_p = [row.job.sampling.top_p for row in rows]
        if min(top_p) < 1.0:
            probs_BV = _top_p(probs_BV, torch.tensor([p if p < 1.0 else float("inf") for p in top_p],
                                                     device=self.device))
        # inverse-CDF sampling, vectorised; each job draws its uniforms from its own generator,
        # so what a seed samples does not depend on the rest of the batch
        uniform_B = torch.zeros(len(rows), device=self.device)
        members: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            members.setdefault(id(row.job), []).append(i)
        for group in members.values():
            job = rows[group[0]].job
            if job.sampling.temperature > 0:
                uniform_B[group] = torch.rand(len(group), generator=job.generator, device=self.device)
        cdf_BV = probs_BV.cumsum(dim=-1)
        tokens_B = torch.searchsorted(cdf_BV, (uniform_B * cdf_BV[:, -1])[:, None], right=True).squeeze(1)
        tokens_B = tokens_B.clamp(max=probs_BV.shape[1] - 1)
        greedy = [i for i, row in enumerate(rows) if row.job.sampling.temperature == 0]
        if greedy:
            tokens_B[greedy] = scores_BV[greedy].argmax(dim=-1)
        chosen_B = logprobs_BV.gather(1, tokens_B[:, None]).squeeze(1)
        top = None
        want_top = max(row.job.sampling.top_logprobs for row in rows)
        if want_top:
            values_BK, indices_BK = logprobs_BV.topk(want_top, dim=-1)
            top = [list(zip(ids, values)) for ids, values in zip(indices_BK.tolist(), values_BK.tolist())]
        return tokens_B, chosen_B, top

    def _record(self, rows: list[_Row], tokens_B, chosen_B, top) -> list[int]:
        """Append the sampled tokens; finish rows that stop; stream deltas. Returns the rows that go on."""
        tokens, logprobs = tokens_B.tolist(), chosen_B.tolist()
        keep: list[int] = []
        deltas: dict[int, tuple[_Job, list]] = {}
        for i, row in enumerate(rows):
            job, sampling = row.job, row.job.sampling
            row.ids.append(tokens[i])
            row.logprobs.append(logprobs[i])
            if sampling.top_logprobs:
                row.top.append(top[i][: sampling.top_logprobs])
            track_text = job.stream or bool(sampling.stops)
            if tokens[i] in self.engine._eos_ids:
                row.finish_reason = "stop"
            elif track_text:
                self._advance_text(row)
                if sampling.stops and self._cut_at_stop(row):
                    row.finish_reason = "stop"
            if row.finish_reason is None and len(row.ids) >= sampling.max_new_tokens:
                row.finish_reason = "length"
            if row.finish_reason is not None:
                row.text = self._decode(row.ids)  # the whole text, including any held-back bytes
                if job.stream and row.sent_tokens < len(row.ids):  # logprobs not streamed yet
                    deltas.setdefault(id(job), (job, []))[1].append(self._delta(row, "", len(row.ids)))
                self._flush(deltas.pop(id(job), None))  # keep this job's events in order
                self._post(job, "finish", _ChoiceResult(row.index, row.text, row.ids, row.logprobs,
                                                 row.top or [[] for _ in row.ids], row.finish_reason))
                continue
            keep.append(i)
            if job.stream:
                chars, count = self._streamable(row)
                text = row.text[row.sent:chars] if chars > row.sent else ""
                row.sent = max(row.sent, chars)
                if text or count > row.sent_tokens:
                    deltas.setdefault(id(job), (job, []))[1].append(self._delta(row, text, count))
        for entry in deltas.values():
            self._flush(entry)
        return keep

    def _delta(self, row: _Row, text: str, upto: int) -> tuple:
        """A stream event for one row: new text, and the tokens [sent_tokens, upto) with their logprobs."""
        start, row.sent_tokens = row.sent_tokens, max(row.sent_tokens, upto)
        return (row.index, text, row.ids[start:upto], row.logprobs[start:upto], row.top[start:upto])

    def _flush(self, entry) -> None:
        if entry is not None:
            job, items = entry
            self._post(job, "delta", items)

    def _advance_text(self, row: _Row) -> None:
        """Extend `row.text` by the newest token, holding back an incomplete UTF-8 character."""
        before = self._decode(row.ids[row.prefix:row.read])
        after = self._decode(row.ids[row.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            row.text += after[len(before):]
            row.prefix, row.read = row.read, len(row.ids)
        row.offsets.append(len(row.text))

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:  # the Rust tokenizer directly: half the cost, same text
            return self._backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _cut_at_stop(self, row: _Row) -> bool:
        """If the text holds a stop string, cut text and tokens before it. Returns whether it did."""
        stops = row.job.sampling.stops
        longest = max(len(s) for s in stops)
        previous = row.offsets[-2] if len(row.offsets) > 1 else 0
        search_from = max(0, previous - longest + 1)
        hits = [p for p in (row.text.find(s, search_from) for s in stops) if p >= 0]
        if not hits:
            return False
        cut = min(hits)
        # keep the tokens whose text ends at or before the stop string
        kept = 0
        for k, offset in enumerate(row.offsets, start=1):
            if offset <= cut:
                kept = k
        del row.ids[kept:], row.logprobs[kept:], row.top[kept:], row.offsets[kept:]
        row.text = self._decode(row.ids)
        row.sent = min(row.sent, len(row.text))
        return True

    def _streamable(self, row: _Row) -> tuple[int, int]:
        """How much of the row can be streamed now, as (characters, tokens): never part of a
        possible stop string (with stop strings, only whole tokens before the held-back tail,
        so a later cut never takes back what was sent)."""
        limit = len(row.text)
        stops = row.job.sampling.stops
        if not stops:
            return limit, len(row.ids)
        limit = min(limit, len(row.text) - (max(len(s) for s in stops) - 1))
        chars = count = 0
        for k, offset in enumerate(row.offsets, start=1):
            if offset <= limit:
                chars, count = max(chars, offset), k
        return chars, count

    # ------------------------------------------------------------ failure

    def _fail_running(self, error: RLProxyError) -> None:
        for job in {id(row.job): row.job for row in self.rows}.values():
            self._post(job, "error", error)
        self.rows, self.cache, self.mask_BT, self.next_B = [], None, None, None

    def _fail_everything(self, error: RLProxyError) -> None:
        self._fail_running(error)
        while self.pending:
            self._post(self.pending.popleft(), "error", error)


# ---------------------------------------------------------------- helpers


def _top_p(probs_BV, top_p_B):
    """Per row, zero the tail outside the smallest set of tokens whose mass reaches top_p
    (the best token always stays; top_p = inf keeps everything)."""
    import torch

    sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
    before_BV = sorted_BV.cumsum(dim=-1) - sorted_BV  # mass of the better tokens
    sorted_BV = sorted_BV.masked_fill(before_BV >= top_p_B[:, None], 0.0)
    return torch.zeros_like(probs_BV).scatter(-1, order_BV, sorted_BV)


def _deliver(items: list) -> None:
    """On a request's event loop: put the worker's events in their jobs' queues."""
    for job, event in items:
        job.events.put_nowait(event)


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
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
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


def _usage(prompt_ids: list[int], results: list[_ChoiceResult]) -> dict:
    completion = sum(len(r.completion_ids) for r in results)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion}


def _token_record(prompt_ids: list[int], results: list[_ChoiceResult]) -> TokenRecord:
    return TokenRecord(prompt_ids=list(prompt_ids),
                       choices=[ChoiceTokens(list(r.completion_ids), list(r.logprobs)) for r in results])


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable character → byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes)}
