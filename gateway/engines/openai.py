"""The `openai` engine: relay to any OpenAI-compatible upstream and record only.

The gateway has already removed rlproxy's metadata keys and set `model`; the
body goes upstream as-is. Only rlproxy's own upstream key is sent: the client's
headers (its Authorization above all) never leave the gateway, and the upstream
key never reaches the store or the log.

Error mapping. An upstream 4xx is the client's fault (bad body, unknown model,
rate limit) and keeps its status, type and message; 401/403 are the exception:
the client's key is not what the upstream saw, so those mean rlproxy's own
`--upstream-api-key` is wrong and become 502. Everything the client cannot fix
(5xx, refused connection, a body that is not a chat completion) is a 502, and
no answer within `--upstream-timeout` is a 504. Every error's text (and a relayed stream's
error event) has the upstream key and every configured secret replaced by `***` before the
client, the store or the log sees it: an upstream may echo the Authorization header it got.

Requests answered in one piece (chat completions, relayed protocols, `/models`) go
through `gateway.engines.http1`, a lean keep-alive HTTP/1.1 pool: relaying is the
gateway's hot path, and aiohttp's client machinery cost three times the pool's CPU per
request (bench/README.md). Event streams go through aiohttp (a third of httpx's CPU).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Iterable

import aiohttp
import orjson
from yarl import URL

from gateway.engines.base import Completion, Engine, EngineRequest, StreamChunk, StreamEnd, check_base_url
from gateway.engines.http1 import HTTP1Pool
from gateway.engines.sse import post_stream, sse_data, stream_session
from gateway.engines.upstream_failures import UpstreamFailures
from gateway.errors import ConfigError
from gateway.redact import mask_text, redact
from gateway.settings import Settings

log = logging.getLogger("rlproxy.engines.openai")

# Connections kept to the upstream for streams: above the concurrency a gateway process is run at.
POOL_SIZE = 512
MODELS_CACHE_SECONDS = 30.0


class OpenAIEngine(Engine):
    kind = "openai"
    supports_adapters = False

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 600.0,
        served_base_id: str = "upstream",
        secrets: Iterable[str] = (),
    ):
        self.base_url = base_url.rstrip("/")
        # Hidden from every error this engine raises: an upstream may echo the Authorization it got.
        self._secrets = [api_key or "", *secrets]
        mask_text(self.base_url, self._secrets)
        self._chat_url = URL(self.base_url + "/chat/completions")
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._pool = HTTP1Pool(self.base_url, self._headers, connect_timeout=min(timeout, 30.0))
        self._chat_head = self._pool.head("POST", "/chat/completions")
        self.timeout = timeout
        # A stream's timeout bounds the wait for the first byte and every gap between
        # chunks, not the whole stream: a long answer that keeps coming is not stuck.
        self._stream_timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        self._served_base_id = served_base_id
        self._session: aiohttp.ClientSession | None = None
        self._models: list[str] = []
        self._models_at = float("-inf")
        self.failures = UpstreamFailures(self.base_url, self._secrets)

    @classmethod
    def from_settings(cls, settings: Settings) -> OpenAIEngine:
        if not settings.upstream_url:
            raise ConfigError(
                "the openai engine needs an upstream: pass --upstream-url http://HOST:PORT/v1 "
                "(or set RLPROXY_UPSTREAM_URL) with the base URL an OpenAI client would use"
            )
        if not settings.upstream_url.startswith(("http://", "https://")):
            raise ConfigError(f"--upstream-url must start with http:// or https://, got '{settings.upstream_url}'")
        check_base_url("--upstream-url", settings.upstream_url)
        key = settings.upstream_api_key.get_secret_value() if settings.upstream_api_key else None
        return cls(
            settings.upstream_url,
            api_key=key,
            timeout=settings.upstream_timeout,
            served_base_id=settings.base_model,
            secrets=settings.secrets(),
        )

    @property
    def base_model_id(self) -> str:
        return self._served_base_id

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self._session is None:
            self._session = stream_session(POOL_SIZE)

    async def close(self) -> None:
        await self._pool.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            await self.start()
        assert self._session is not None
        return self._session

    # ---------------------------------------------------------------- chat

    async def _exchange(self, head: bytes, data: bytes | None, timeout: float | None = None) -> tuple[int, bytes]:
        """One request through the pool: (status, body) of a 2xx/3xx answer; a timeout, an
        unreachable upstream or an error status raised as the gateway's own errors."""
        try:
            answer = await self._pool.exchange(head, data, timeout=timeout or self.timeout)
        except TimeoutError:
            raise self.failures.timed_out(self.timeout) from None
        except OSError as exc:  # ConnectError, ConnectionDropped, ProtocolError
            raise self.failures.unreachable(exc) from None
        self.failures.down = None  # it answered, whatever it said
        if answer.status >= 400:
            raise self.failures.status(answer.status, answer.body, answer.retry_after)
        return answer.status, answer.body

    def health(self) -> str | None:
        return self.failures.down

    async def probe(self) -> None:
        try:
            await self._pool.exchange(self._pool.head("GET", "/models"), None, timeout=min(self.timeout, 5.0))
        except (TimeoutError, OSError):
            return
        self.failures.down = None

    async def complete(self, request: EngineRequest) -> Completion:
        status, payload = await self._exchange(self._chat_head, orjson.dumps(request.body))
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise self.failures.fail(
                f"the upstream at {self.base_url} answered {status} with a body that is not JSON; "
                + self.failures.logged(payload)
            ) from None
        if not isinstance(data, dict) or "choices" not in data:
            if isinstance(data, dict) and isinstance(data.get("error"), dict):
                raise self.failures.fail(
                    f"the upstream at {self.base_url} answered with an error: {data['error'].get('message')}"
                )
            raise self.failures.fail(
                f"the upstream at {self.base_url} answered {status} with JSON that is not a "
                f"chat.completion (no 'choices'): {self.failures.logged(payload)}"
            )
        return Completion(response=data, tokens=None)

    async def stream(self, request: EngineRequest) -> AsyncIterator[StreamChunk | StreamEnd]:
        finished = False
        try:
            resp = await post_stream(
                await self._client(), self._chat_url, orjson.dumps(request.body), self._headers, self._stream_timeout
            )
            self.failures.down = None
            try:
                if resp.status >= 400:
                    raise self.failures.status(resp.status, await resp.read(), resp.headers.get("Retry-After"))
                if resp.content_type != "text/event-stream":
                    raise self.failures.fail(
                        f"the upstream at {self.base_url} answered a stream request with {resp.content_type or 'no'}"
                        f" content instead of text/event-stream: {self.failures.logged(await resp.read())}"
                    )
                async for payload in sse_data(resp.content):
                    if payload == b"[DONE]":
                        finished = True
                        break
                    try:
                        data = orjson.loads(payload)
                    except orjson.JSONDecodeError:
                        raise self.failures.fail(
                            f"the upstream at {self.base_url} sent a stream chunk that is not JSON; "
                            + self.failures.logged(payload)
                        ) from None
                    if not isinstance(data, dict):
                        raise self.failures.fail(
                            f"the upstream at {self.base_url} sent a stream chunk that is not a "
                            f"JSON object: {self.failures.logged(payload)}"
                        )
                    if "error" in data and "choices" not in data:
                        error = data["error"] if isinstance(data["error"], dict) else {"message": data["error"]}
                        raise self.failures.fail(
                            f"the upstream at {self.base_url} failed mid-stream: {error.get('message')}"
                        )
                    if not _chunk_shaped(data):
                        raise self.failures.fail(
                            f"the upstream at {self.base_url} sent a stream chunk that is not a "
                            f"chat.completion.chunk: {self.failures.logged(payload)}"
                        )
                    yield StreamChunk(data=data, raw=payload)
            finally:
                resp.release()
        except TimeoutError:
            raise self.failures.timed_out(self.timeout) from None
        except aiohttp.ClientError as exc:
            raise self.failures.unreachable(exc) from None
        if not finished:
            raise self.failures.fail(f"the upstream at {self.base_url} closed the stream before sending [DONE]")
        yield StreamEnd(tokens=None)

    # ---------------------------------------------------------------- other protocols, relayed as they are

    async def relay(self, path: str, body: dict | None, method: str | None = None) -> dict:
        """POST `body` (GET when None, or `method`) to `{upstream}{path}` in a protocol the upstream
        speaks itself (`--upstream-protocol`); its JSON answer, errors mapped as for chat."""
        head = self._pool.head(method or ("GET" if body is None else "POST"), path)
        status, payload = await self._exchange(head, None if body is None else orjson.dumps(body))
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            raise self.failures.fail(
                f"the upstream at {self.base_url} answered {path} with something that is not a JSON "
                f"object: {self.failures.logged(payload)}"
            )
        return data

    async def relay_stream(self, path: str, body: dict) -> AsyncIterator[bytes]:
        """The `data` payloads of the upstream's event stream for `path` (`[DONE]` too, where
        the protocol sends one); each protocol's payloads name their event in `type`."""
        try:
            resp = await post_stream(
                await self._client(), URL(self.base_url + path), orjson.dumps(body), self._headers, self._stream_timeout
            )
            self.failures.down = None
            try:
                if resp.status >= 400:
                    raise self.failures.status(resp.status, await resp.read(), resp.headers.get("Retry-After"))
                if resp.content_type != "text/event-stream":
                    raise self.failures.fail(
                        f"the upstream at {self.base_url} answered a stream request on {path} with "
                        f"{resp.content_type or 'no'} content: {self.failures.logged(await resp.read())}"
                    )
                async for payload in sse_data(resp.content):
                    if b'"error"' in payload:  # relayed as it is: an error event may echo our key
                        payload = redact(payload.decode("utf-8", errors="replace"), self._secrets).encode()
                    yield payload
            finally:
                resp.release()
        except TimeoutError:
            raise self.failures.timed_out(self.timeout) from None
        except aiohttp.ClientError as exc:
            raise self.failures.unreachable(exc) from None

    # ---------------------------------------------------------------- models

    async def list_models(self) -> list[str]:
        """The upstream's model ids, cached briefly; [] when the upstream cannot say."""
        now = time.monotonic()
        if now - self._models_at < MODELS_CACHE_SECONDS:
            return self._models
        models: list[str] = []
        try:
            answer = await self._pool.exchange(self._pool.head("GET", "/models"), None, timeout=min(self.timeout, 10.0))
            if answer.status == 200:
                data = orjson.loads(answer.body)
                models = [str(item["id"]) for item in data.get("data", []) if "id" in item]
            else:
                log.warning("the upstream's /models answered %s", answer.status)
        except (TimeoutError, OSError, orjson.JSONDecodeError, AttributeError, TypeError) as exc:
            log.warning("cannot list the upstream's models: %s", type(exc).__name__)
        self._models, self._models_at = models, now
        return models


def _chunk_shaped(data: dict) -> bool:
    """Whether `data` has the shape the stream's record is rebuilt from (`StreamAccumulator`):
    `choices` a list of objects with an int `index`, a `delta` object, text `content` and
    tool calls that are objects. Anything else crashed that rebuild mid-stream, which broke the
    client's stream with no error event and recorded the call as the client's leaving."""
    choices = data.get("choices")
    if choices is None:
        return True  # a usage-only chunk may leave them out
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict) or not isinstance(choice.get("index", 0), int):
            return False
        delta = choice.get("delta") or {}
        if not isinstance(delta, dict) or not isinstance(delta.get("content") or "", str):
            return False
        calls = delta.get("tool_calls") or []
        if not isinstance(calls, list):
            return False
        for call in calls:
            function = call.get("function") or {} if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(call.get("index", 0), int):
                return False
            if not all(isinstance(function.get(key) or "", str) for key in ("name", "arguments")):
                return False
    return True
