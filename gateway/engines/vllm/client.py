"""HTTP to one vLLM server: the connections, and its admin API's answers as the gateway's errors.

Chat completions answered in one piece go through `gateway.engines.http1`'s lean pool (a
third of aiohttp's CPU per request, bench/upstream_client.py); streams and the admin API
(adapters, sleep, `/v1/models`, `/health`), aiohttp. vLLM unreachable is `EngineUnavailable`
(503); no answer in time, `UpstreamTimeout`. The vLLM is at an http(s) URL or on a Unix socket
(`unix:PATH`: the managed one, `gateway.engines.vllm.server`); a key, when it has one, goes as a
bearer on every request.
"""

from __future__ import annotations

import aiohttp
import orjson

from gateway.engines.http1 import HTTP1Pool
from gateway.engines.sse import post_stream, reuse_trace
from gateway.engines.vllm.server import probe_health, socket_of
from gateway.engines.vllm.wire import error_message, loads, maybe_json
from gateway.errors import EngineUnavailable, UpstreamError, UpstreamTimeout
from gateway.redact import mask_text


class VLLMClient:
    """The connections to the vLLM at `url` (http(s)://HOST:PORT or unix:PATH); `timeout` bounds
    each answer (streams: each read); `api_key`, the vLLM's key if it has one."""

    def __init__(self, url: str, timeout: float, *, api_key: str | None = None):
        # As messages, /healthz and the dashboard name it: a password or key in the URL is masked
        # (`url_secrets` holds them, for the engine to redact from vLLM's error text).
        self.url_secrets: list[str] = []
        self.url = mask_text(url, self.url_secrets)
        self.socket = socket_of(url)
        self.base = "http://localhost" if self.socket else url  # what request URLs start with
        self.timeout = timeout
        self.session: aiohttp.ClientSession | None = None
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        headers = {"Content-Type": "application/json", "Accept": "application/json", **self._auth}
        self.pool = HTTP1Pool(self.base, headers, unix_socket=self.socket)
        self._chat_head = self.pool.head("POST", "/v1/chat/completions")

    def open(self) -> None:
        if self.session is None:
            if self.socket:
                connector: aiohttp.BaseConnector = aiohttp.UnixConnector(self.socket, limit=512, limit_per_host=0)
            else:
                connector = aiohttp.TCPConnector(limit=512, limit_per_host=0)
            # No cookie jar: nothing from vLLM should leak between clients.
            self.session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                headers=self._auth,
                trace_configs=[reuse_trace()],  # for `post_stream`'s retry of a stale connection
            )

    async def close(self) -> None:
        await self.pool.close()
        if self.session is not None:
            await self.session.close()
            self.session = None

    # ------------------------------------------------------------ chat (the hot path)

    def chat(self, body: bytes):
        """POST a chat completion answered in one piece: an awaitable of the pool's `Answer`
        (returned, not awaited here, so the request pays no extra coroutine)."""
        return self.pool.exchange(self._chat_head, body, timeout=self.timeout)

    async def chat_stream(self, body: bytes) -> aiohttp.ClientResponse:
        """POST a streamed chat completion: aiohttp's response (release it when done). Sent once
        more on a new connection when a reused one turns out closed before any answer (vLLM's
        uvicorn closes idle ones after 5 s), as the pool does for whole answers."""
        return await post_stream(
            self.session,
            self.base + "/v1/chat/completions",
            body,
            {"Content-Type": "application/json"},
            aiohttp.ClientTimeout(total=None, sock_connect=self.timeout, sock_read=self.timeout),
        )

    # ------------------------------------------------------------ the admin API

    async def healthy(self) -> bool:
        return await probe_health(self.session, self.base)

    async def post(self, path: str, body: dict | None) -> tuple[int, bytes]:
        """POST to the admin API (adapters, sleep, /tokenize), sent once more when a reused
        connection turns out closed before any answer (aiohttp retries only GET and the like)."""
        data = orjson.dumps(body) if body is not None else b""
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        try:
            resp = await post_stream(
                self.session, self.base + path, data, {"Content-Type": "application/json"}, timeout
            )
            async with resp:
                return resp.status, await resp.read()
        except TimeoutError:
            raise UpstreamTimeout(f"vLLM did not answer {path} within {self.timeout:g} s") from None
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(
                f"cannot reach vLLM at {self.url} for {path}: {exc or type(exc).__name__}"
            ) from None

    async def get_json(self, path: str) -> dict:
        try:
            async with self.session.get(self.base + path, timeout=aiohttp.ClientTimeout(total=30)) as resp:
                status, payload = resp.status, await resp.read()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise EngineUnavailable(
                f"cannot reach vLLM at {self.url} for {path}: {exc or type(exc).__name__}"
            ) from None
        if status != 200:
            raise UpstreamError(
                sleep_error(path, status, payload) if "sleep" in path else f"vLLM answered {status} on {path}"
            )
        return loads(payload, path)


def sleep_error(path: str, status: int, payload: bytes) -> str:
    """What a failed `/sleep`, `/wake_up` or `/is_sleeping` means."""
    if status == 404:
        return (
            f"vLLM has no {path} endpoint: for --gpu-mode colocated start it with --enable-sleep-mode "
            "and VLLM_SERVER_DEV_MODE=1 (rlproxy does when it starts vLLM itself), or use --gpu-mode dedicated"
        )
    return f"vLLM answered {status} on {path}: {error_message(maybe_json(payload))}"
