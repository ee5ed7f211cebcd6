"""The local engine: transformers + peft in the gateway process.

`LocalEngine` is the asyncio face of the engine: it loads the model
(gateway/engines/local/model.py), validates requests, renders them with the chat template and
tokenises them on a thread beside the event loop (gateway/engines/local/request.py), queues them for the
worker thread (gateway/engines/local/worker.py, which owns the model and runs the continuous
batch, the sampling and the adapter loads), and turns what the worker sends back into OpenAI
responses, stream chunks and token records (gateway/engines/local/response.py).

The logprob recorded for each sampled token is its behaviour logprob: under the processed
distribution it was sampled from (penalties, temperature, min_p, top-k, top-p; see
sampling.py), with the sampling parameters in force (`TokenRecord.sampling`). A client
that asks for `logprobs` gets those same numbers (as vLLM's `processed_logprobs` mode gives
them), not the raw model's. vLLM's `top_k`, `min_p` and `repetition_penalty` are accepted as
extra body fields. Streaming sends content as it is decoded: text that could
still become a stop string, an incomplete UTF-8 character or (with tools) a `<tool_call>`
block is held back. A stop string cuts the text right before it, inside a token if need be,
and the token record keeps the tokens the client saw whole (text.py). A choice that a stop
string ended carries it as `stop_reason`, as vLLM's do (Anthropic's `stop_sequence` is made
of it). `response_format` is accepted and ignored (no constrained decoding); `tool_choice`
"required" or a named function is treated as "auto". With `parallel_tool_calls` false a choice
answers with its first tool call only, as vLLM's do (the record keeps what the model wrote).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

from gateway.engines.base import Completion, Engine, EngineRequest, StreamChunk, StreamEnd
from gateway.engines.local.jobs import BASE_ADAPTER, ChoiceResult, Control, Job
from gateway.engines.local.model import LocalModel
from gateway.engines.local.request import completion_room, parse_request, render_prompt, sampling_of
from gateway.engines.local.response import (
    Chunks,
    LogprobEntries,
    assistant_message,
    completion_id,
    end_of,
    token_record,
    usage,
)
from gateway.engines.local.worker import Worker
from gateway.errors import ConfigError, Conflict, EngineUnavailable, InvalidRequest, NotFound, RLProxyError
from gateway.models.special_text import SpecialText
from gateway.protocols.chat import ChatCompletionRequest
from gateway.protocols.toolcalls import ToolCallStream

log = logging.getLogger(__name__)


class LocalEngine(Engine):
    kind = "local"
    supports_adapters = True
    continuous_usage = True

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
        chat_template: str | None = None,
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
        self.chat_template = chat_template  # --chat-template: a Jinja file, 'original', None for the model's own
        self.loaded: LocalModel | None = None  # the model, its tokenizer and adapters, once started
        self.tokenizer = None
        self._chat: SpecialText | None = None  # renders and tokenizes prompts with the tokenizer
        self._unloading: set[str] = set()
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # Job | Control | None (stop), for the worker
        self._thread: threading.Thread | None = None
        self._context = 0
        self._logprobs: LogprobEntries | None = None

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
            loaded = await asyncio.to_thread(
                LocalModel.load,
                self.model_path,
                device=self.device,
                dtype=self.dtype,
                threads=self.threads,
                chat_template=self.chat_template,
            )
        except RLProxyError:
            raise
        except Exception as error:  # a missing directory, an unknown model id offline, a bad config...
            raise ConfigError(f"cannot load the model '{self.model_path}': {error}") from error
        self.loaded, self.tokenizer, self._context = loaded, loaded.tokenizer, loaded.context
        self._chat = SpecialText(loaded.tokenizer)
        self._logprobs = LogprobEntries(loaded.tokenizer)
        self.worker = Worker(loaded, self.inbox, self.max_batch_size)  # read by tests (its counters)
        self._thread = threading.Thread(target=self.worker.run, name="rlproxy-local-engine", daemon=True)
        self._thread.start()

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
        if name in self.loaded.adapters:
            raise Conflict(f"adapter '{name}' is already loaded; unload it first")
        if not (Path(path) / "adapter_config.json").is_file():
            raise NotFound(f"no PEFT adapter at {path} (adapter_config.json is missing)")
        await self._control("load", name, Path(path))

    async def unload_adapter(self, name: str) -> None:
        self._require_started()
        if name not in self.loaded.adapters:
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
        req, job, parse_tools = await self._submit(request, stream=False)
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
            message, has_calls = assistant_message(result.text, parse_tools, req.parallel_tool_calls is not False)
            choices.append(
                {
                    "index": result.index,
                    "message": message,
                    "logprobs": {"content": self._logprobs.entries(result.completion_ids, result.logprobs, result.top)}
                    if req.logprobs
                    else None,
                    **end_of(result, has_calls),
                }
            )
        response = {
            "id": completion_id(request.request_id),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": choices,
            "usage": usage(job.prompt_ids, results),
        }
        return Completion(response=response, tokens=token_record(job, results))

    async def stream(self, request: EngineRequest) -> AsyncIterator[StreamChunk | StreamEnd]:
        req, job, parse_tools = await self._submit(request, stream=True)
        head = {
            "id": completion_id(request.request_id),
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": req.model,
        }
        chunk = Chunks(head, req.stream_options, len(job.prompt_ids))
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
                        chunk.produced += len(ids)
                        if req.logprobs:
                            pending_logprobs[index] += self._logprobs.entries(ids, logprobs, top)
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
                    calls = calls if req.parallel_tool_calls is not False else calls[:1]
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
                    end_of(result, bool(calls)),
                )
        except BaseException:
            job.cancelled.set()
            raise
        if chunk.include_usage:
            yield StreamChunk({**head, "choices": [], "usage": usage(job.prompt_ids, results)})
        yield StreamEnd(token_record(job, results))

    async def _submit(self, request: EngineRequest, *, stream: bool) -> tuple[ChatCompletionRequest, Job, bool]:
        """Validate, render and tokenise; queue the job for the worker."""
        self._require_started()
        req = parse_request(request.body)
        adapter = request.adapter
        if adapter is not None and (adapter not in self.loaded.adapters or adapter in self._unloading):
            raise NotFound(f"adapter '{adapter}' is not loaded in the local engine", param="model")
        prompt_ids = await self._render(req)
        limit, room = completion_room(req, prompt_ids, self._context)
        sampling = sampling_of(req, limit if limit is not None else min(self.default_max_tokens, room))
        job = Job(prompt_ids, req.n, adapter, sampling, req.seed, stream, self.device, request.background)
        self.inbox.put(job)
        parse_tools = bool(req.tools) and req.tool_choice != "none"
        return req, job, parse_tools

    async def count_tokens(self, body: dict) -> int:
        self._require_started()
        return len(await self._render(parse_request(body)))  # as _submit renders it

    async def check_fits(self, body: dict) -> None:
        self._require_started()
        req = parse_request(body)
        completion_room(req, await self._render(req), self._context)  # as _submit refuses it

    async def _render(self, req: ChatCompletionRequest) -> list[int]:
        """The prompt's ids: the chat template over messages (+ tools), tokenised on a thread, beside
        the event loop: megabytes of prompt take seconds (the tokenizer lets go of the GIL)."""
        assert self._chat is not None  # set when the model is loaded, before any request
        return await asyncio.to_thread(render_prompt, self._chat, req)

    def health(self) -> str | None:
        if self._thread is None:
            return "the local engine is not started"
        if not self._thread.is_alive():
            return "the local engine's worker thread has stopped; see the gateway log"
        return None

    def _require_started(self) -> None:
        if self._thread is None:
            raise EngineUnavailable("the local engine is not started")
