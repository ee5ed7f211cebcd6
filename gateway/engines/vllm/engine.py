"""The `vllm` engine: a vLLM OpenAI server (managed or attached) serving LoRA adapters by name.

What it asks vLLM for, and what the client gets:
- every request goes with `return_token_ids: true` and `logprobs: true` (vLLM then returns
  `prompt_token_ids` on the response or first stream chunk, `token_ids` per choice or per
  chunk, and `logprobs.content[i].logprob` per sampled token);
- `top_logprobs` is the client's own number (0 when it asked for none);
- the client's response is stripped back to what it asked for: no token ids, `logprobs: null`
  unless it asked, `top_logprobs` cut to its number; the token record goes to the store.

Behaviour logprobs (what the trainer's importance weights divide by). vLLM runs with
`--logprobs-mode processed_logprobs` and `--generation-config vllm`, and every request carries
every sampling field (`wire.sampling_in_force`: OpenAI's default for what the client left
out). What vLLM's processed logprobs then are, read in vLLM's source (vllm/v1/sample/sampler.py
at 3e342658, `Sampler.forward` / `sample` / `apply_logits_processors`, and
vllm/v1/sample/ops/topk_topp_sampler.py at 3babc05a, `TopKTopPSampler.forward_native`):
  log_softmax of the float32 logits after, in this order: allowed-token mask, bad words, the
  non-argmax-invariant logits processors (min_tokens, logit_bias), the penalties (repetition,
  frequency, presence: on the raw logits, *before* temperature), temperature, the
  argmax-invariant processors (min_p), then top-k and top-p (masked to -inf, renormalised).
  That is the distribution the token was drawn from (`forward_native` samples from the softmax
  of the same tensor); vLLM switches its FlashInfer sampler off in these modes for that reason.
Not covered, and corrected by the trainer's truncated importance sampling min(pi_old/mu, C)
(gateway records them, the trainer weights each token):
  - greedy calls (temperature below 1e-5, sent to vLLM as 0: `wire.vllm_temperature`): the
    all-greedy path returns log_softmax of the penalised logits at T = 1, not the point mass
    it sampled from; rlproxy records no mu for them (`wire.behaviour_logprobs`) and the
    trainer does not train them (`trainer.retries.is_greedy_call`);
  - numerics: vLLM's bf16 forward (and its LoRA kernels, batch-dependent reductions) against
    the trainer's; speculative decoding's bonus tokens; structured output (its grammar bitmask
    is applied outside these modes' tensor). The step metrics show the mismatch.
The client's `logprobs` (when it asks) are these same processed values: the log-probability
of each token under the distribution that produced it, not the model's raw softmax.
Attached (`--vllm-url`): rlproxy cannot set vLLM's flags; that server must run with
`--generation-config vllm --logprobs-mode processed_logprobs` (`vllm_probes` checks at start).

The pieces: `vllm_client` (HTTP to vLLM), `vllm_wire` (the bodies both ways), `vllm_adapters`
(the LoRA adapters vLLM serves), `vllm_supervisor` (health, restarts, sleep for a colocated
GPU), `vllm_probes` (what an attached vLLM serves), `vllm_server` (the managed process).
Failure: vLLM unreachable or gone mid-request is a 503 `EngineUnavailable`; vLLM's own 5xx
a 502, a request it refuses its own 4xx (`wire.status_error`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson

from gateway.engines.base import Completion, Engine, EngineRequest, StreamChunk, StreamEnd, TokenRecord, logged_body
from gateway.engines.sse import sse_data
from gateway.engines.vllm.adapters import VLLMAdapters
from gateway.engines.vllm.client import VLLMClient
from gateway.engines.vllm.probes import check_logprobs_mode, detect_base_model, has_sleep_endpoints
from gateway.engines.vllm.server import (
    VLLMProcess,
)
from gateway.engines.vllm.supervisor import VLLMSupervisor
from gateway.engines.vllm.wire import (
    ClientAsk,
    StreamSplitter,
    error_message,
    loads,
    maybe_json,
    sampling_in_force,
    split_completion,
    status_error,
    vllm_body,
)
from gateway.errors import ConfigError, EngineUnreached, RLProxyError, UpstreamError, UpstreamTimeout
from gateway.redact import redact

log = logging.getLogger("rlproxy.engines.vllm")


def _redacted(hide: list[str], error: UpstreamError) -> UpstreamError:
    """`error` without a secret in its text, before a client, the store or the log sees it."""
    error.message = redact(error.message, hide)
    error.args = (error.message,)
    return error


class VLLMEngine(Engine):
    kind = "vllm"
    supports_adapters = True
    continuous_usage = True

    def __init__(
        self,
        base_model: str,
        *,
        url: str | None = None,
        process: VLLMProcess | None = None,
        timeout: float = 600.0,
        health_interval: float = 2.0,
        max_restarts: int = 5,
        api_key: str | None = None,
        hide: list[str] | None = None,
    ):
        if (url is None) == (process is None):
            raise ConfigError("VLLMEngine needs either url (attach) or process (managed), not both")
        self.process = process
        self.url = (url or process.url).rstrip("/")  # http(s)://HOST:PORT or unix:PATH
        self.managed = process is not None
        self._base_model = base_model
        self._vllm_base = base_model  # what vLLM calls the base model (attached servers may rename it)
        self._max_model_len: int | None = None  # from vLLM's model cards, at start
        self.timeout = timeout
        self.client = VLLMClient(self.url, timeout, api_key=api_key)
        # out of vLLM's error text (or a proxy's in front of it)
        self._hide = [*(hide or []), api_key or "", *self.client.url_secrets]
        self.adapters = VLLMAdapters(self.client)
        self.supervisor = VLLMSupervisor(
            self.client, process, self.adapters, health_interval=health_interval, max_restarts=max_restarts
        )
        self._warned_no_tokens = False
        self.in_a_set = False  # one of `VLLMReplicas`: a call it cannot start goes to another
        # Whether /sleep and /wake_up exist: managed, whether it was started in sleep mode;
        # attached, what `GET /is_sleeping` answers at start (a CPU build never sleeps).
        self.can_sleep = False

    @property
    def base_model_id(self) -> str:
        return self._base_model

    @property
    def available(self) -> bool:
        return self.supervisor.ready.is_set()

    def health(self) -> str | None:
        return None if self.available else self.supervisor.down_reason

    # ---------------------------------------------------------------- lifecycle

    @property
    def context_length(self) -> int | None:
        return self._max_model_len

    async def start(self) -> None:
        self.client.open()
        await self.supervisor.connect()
        served = await detect_base_model(self.client, self._base_model)
        if served is not None:
            self._vllm_base, self._base_model, self._max_model_len = served
        if not self.managed:
            await check_logprobs_mode(self.client, self._vllm_base)
            self.can_sleep = await has_sleep_endpoints(self.client)
        self.supervisor.serve()

    async def close(self) -> None:
        await self.supervisor.stop()
        await self.client.close()

    # ---------------------------------------------------------------- chat

    def _target(self, request: EngineRequest) -> str:
        return request.adapter or self._vllm_base

    def _answer_error(self, status: int, payload: bytes, request: EngineRequest) -> RLProxyError:
        """vLLM's error answer as the gateway's error (`status_error`); a body that is not JSON
        goes to the log only, redacted, as the openai engine does (`logged_body`)."""
        if maybe_json(payload) is None:
            logged_body(self.client.url, payload, self._hide)
        return _redacted(self._hide, status_error(status, payload, self._target(request)))

    async def complete(self, request: EngineRequest) -> Completion:
        self.supervisor.check_ready()
        ask = ClientAsk.of(request.body)
        sampling = sampling_in_force(request.body)
        body = orjson.dumps(
            vllm_body(
                request.body, self._target(request), ask, background=request.background, request_id=request.request_id
            )
        )
        for attempt in (1, 2):
            try:
                answer = await self.client.chat(body)
            except TimeoutError:
                raise UpstreamTimeout(
                    f"vLLM did not answer within {self.timeout:g} s (raise --upstream-timeout if it is just slow)"
                ) from None
            except OSError as exc:  # refused, dropped, not HTTP
                raise self.supervisor.connection_lost(exc, answered=getattr(exc, "answered", True)) from None
            status, payload = answer.status, answer.body
            if status == 404 and attempt == 1 and await self._reload_missing(request.adapter):
                continue
            break
        if status >= 400:
            raise self._answer_error(status, payload, request)
        data = loads(payload, "a chat completion")
        response, tokens = split_completion(data, ask, sampling)
        self._warn_if_no_tokens(tokens)
        return Completion(response=response, tokens=tokens)

    async def stream(self, request: EngineRequest) -> AsyncIterator[StreamChunk | StreamEnd]:
        self.supervisor.check_ready()
        ask = ClientAsk.of(request.body)
        body = orjson.dumps(
            vllm_body(
                request.body, self._target(request), ask, background=request.background, request_id=request.request_id
            )
        )
        splitter = StreamSplitter(ask, sampling_in_force(request.body))
        finished = False
        try:
            for attempt in (1, 2):
                try:
                    resp = await self.client.chat_stream(body)
                except aiohttp.ClientError as exc:  # no status line came: nothing reached the client either
                    raise self.supervisor.connection_lost(exc, answered=False) from None
                if resp.status == 404 and attempt == 1:
                    payload = await resp.read()
                    resp.release()
                    if await self._reload_missing(request.adapter):
                        continue
                    raise self._answer_error(404, payload, request)
                break
            try:
                if resp.status >= 400:
                    raise self._answer_error(resp.status, await resp.read(), request)
                async for payload in sse_data(resp.content):
                    if payload == b"[DONE]":
                        finished = True
                        break
                    chunk = loads(payload, "a stream chunk")
                    if "choices" not in chunk and ("error" in chunk or chunk.get("object") == "error"):
                        raise _redacted(self._hide, UpstreamError(f"vLLM failed mid-stream: {error_message(chunk)}"))
                    out = splitter.feed(chunk)
                    if out is not None:
                        yield StreamChunk(data=out)
            finally:
                resp.release()
        except TimeoutError:
            raise UpstreamTimeout(f"vLLM sent nothing for {self.timeout:g} s") from None
        except aiohttp.ClientError as exc:
            raise self.supervisor.connection_lost(exc) from None
        if not finished:
            raise self.supervisor.connection_lost(ConnectionError("the stream ended before [DONE]"))
        tokens = splitter.record()
        self._warn_if_no_tokens(tokens)
        yield StreamEnd(tokens=tokens)

    async def count_tokens(self, body: dict) -> int:
        """vLLM's /tokenize renders the messages with the chat template it serves with."""
        self.supervisor.check_ready()
        keys = ("messages", "tools", "add_generation_prompt", "continue_final_message")
        ask = {"model": self._vllm_base, **{key: body[key] for key in keys if key in body}}
        status, payload = await self.client.post("/tokenize", ask)
        if status >= 400:
            raise self._answer_error(status, payload, EngineRequest(body=body, adapter=None, request_id="tokenize"))
        count = loads(payload, "a /tokenize answer").get("count")
        if not isinstance(count, int):
            raise UpstreamError("vLLM's /tokenize answer holds no 'count'")
        return count

    def _warn_if_no_tokens(self, tokens: TokenRecord | None) -> None:
        if tokens is None and not self._warned_no_tokens:
            self._warned_no_tokens = True
            log.warning(
                "vLLM returned no token ids; rlproxy needs vLLM >= 0.10.2 (return_token_ids). "
                "Calls are recorded without tokens and the trainer re-renders them."
            )

    async def _reload_missing(self, adapter: str | None) -> bool:
        """vLLM said 404 for `adapter`: load it (it restarted behind our back, or the step was known
        on demand) and say whether to send the call again. In a replica set, one that will not
        load is `EngineUnreached`, with the reason: nothing of the call was answered, so the set
        sends it to another replica (alone, vLLM's 404 stands: `status_error`)."""
        if await self.adapters.reload_missing(adapter, asleep=self.supervisor.asleep):
            return True
        if self.in_a_set and adapter is not None and adapter in self.adapters.failed:
            why = self.adapters.failed[adapter]
            raise EngineUnreached(redact(f"vLLM at {self.client.url} could not load {adapter}: {why}", self._hide))
        return False

    # ---------------------------------------------------------------- adapters

    async def load_adapter(self, name: str, path: Path) -> None:
        await self.adapters.load(name, path, ready=self.available, asleep=self.supervisor.asleep)

    async def unload_adapter(self, name: str) -> None:
        await self.adapters.unload(name, ready=self.available)

    # ---------------------------------------------------------------- sleep (colocated GPU)

    async def sleep(self, level: int = 1) -> None:
        """Free the GPU: level 1 offloads weights to CPU memory and drops the KV cache."""
        await self.supervisor.sleep(level)

    async def wake_up(self) -> None:
        """Take the GPU back. A managed vLLM that died while asleep is started afresh (awake)."""
        await self.supervisor.wake_up()

    async def is_sleeping(self) -> bool:
        data = await self.client.get_json("/is_sleeping")
        return bool(data.get("is_sleeping"))
