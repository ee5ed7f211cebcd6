"""A lean HTTP/1.1 client for one upstream origin: a keep-alive pool on asyncio + httptools.

Why not aiohttp: on the gateway's hot path (relay a chat completion) aiohttp's request
machinery was a third of the gateway's CPU per call in bench/proxy.py's profile
(~130 us per request; httpx's pool was 20x that). This does only what the openai
engine needs, in a fraction of it: POST a body, then read the whole response or
relay its body as it arrives.

Scope, on purpose: http and https; responses framed by Content-Length, chunked
encoding or (rarely) the connection closing; no redirects, no proxies, and no
compression (requests say `Accept-Encoding: identity`).

A request that fails on a reused keep-alive connection before any byte of the
answer arrived is sent once more on a new connection: the server closed an idle
connection as we wrote, so it never saw the request.
"""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit

import httptools

# Stream flow control: stop reading from the upstream while this many body chunks wait.
_PAUSE_AT, _RESUME_AT = 64, 16


class ConnectError(OSError):
    """No connection to the upstream could be made (refused, unresolvable, unreachable)."""


class ConnectionDropped(OSError):
    """The connection broke before the response was complete."""


class ProtocolError(OSError):
    """The upstream's bytes are not a valid HTTP/1.1 response."""


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection; one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None

    # -- per request
    def begin(self, streaming: bool, timeout: float, idle_timeout: bool) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.queue: asyncio.Queue | None = asyncio.Queue() if streaming else None
        self.got_bytes = False
        self.keep_alive = False
        self.headers_done = self._loop.create_future()
        self.finished = self._loop.create_future()
        self._timeout = timeout
        self._idle_timeout = idle_timeout  # restart the timer on every byte (streams), or one deadline
        self._paused = False
        self._arm_timer()

    def _arm_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(self._timeout, self._on_timeout)

    def _on_timeout(self) -> None:
        self._fail(asyncio.TimeoutError())
        self.abort()

    def _fail(self, exc: BaseException) -> None:
        for future in (self.headers_done, self.finished):
            if not future.done():
                future.set_exception(exc)
                future.exception()  # marked retrieved: a caller may be waiting on the other one only
        if self.queue is not None:
            self.queue.put_nowait(exc)

    def settle(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    # -- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self._idle_timeout:
            self._arm_timer()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(ProtocolError("the upstream tried to switch protocols"))
            self.abort()
        except httptools.HttpParserError as exc:
            self._fail(ProtocolError(f"invalid HTTP response from the upstream: {exc}"))
            self.abort()

    def connection_lost(self, exc) -> None:
        self.closed = True
        if not hasattr(self, "finished") or self.finished.done():
            return
        if (self.headers_done.done() and not self.headers_done.exception()
                and "content-length" not in self.headers and "chunked" not in self.headers.get("transfer-encoding", "")):
            self.on_message_complete()  # a body framed by the connection closing
            return
        reason = f": {exc}" if exc else ""
        self._fail(ConnectionDropped(f"the upstream closed the connection before the response was complete{reason}"))

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.queue is None:
            self.body.append(body)
            return
        self.queue.put_nowait(body)
        if self.queue.qsize() >= _PAUSE_AT and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        self.settle()
        if not self.finished.done():
            self.finished.set_result(None)
        if self.queue is not None:
            self.queue.put_nowait(None)

    def consumed(self) -> None:
        """The stream reader took a chunk: read again once the backlog is small."""
        if self._paused and self.queue is not None and self.queue.qsize() <= _RESUME_AT and not self.closed:
            self._paused = False
            self.transport.resume_reading()


class Response:
    """A response whose headers arrived; read the body whole (`read`) or as it comes (`chunks`)."""

    def __init__(self, pool: "HTTP1Pool", conn: _Connection):
        self._pool = pool
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers
        self._released = False

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").split(";", 1)[0].strip().lower()

    async def read(self) -> bytes:
        conn = self._conn
        try:
            if conn.queue is None:
                await conn.finished
                return b"".join(conn.body)
            return b"".join([chunk async for chunk in self.chunks()])
        finally:
            self.release()

    async def chunks(self):
        """Body bytes as they arrive (streaming requests only)."""
        conn = self._conn
        assert conn.queue is not None, "chunks() needs a request opened with stream=True"
        try:
            while True:
                item = await conn.queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                conn.consumed()
                yield item
        finally:
            self.release()

    def release(self) -> None:
        """Give the connection back (kept alive only if the response was read to its end)."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        conn.settle()
        done = conn.finished.done() and not conn.finished.exception()
        self._pool._put_back(conn, reusable=done and conn.keep_alive and not conn.closed)


class HTTP1Pool:
    """Keep-alive connections to the origin of `base_url`."""

    def __init__(self, base_url: str, *, connect_timeout: float = 30.0):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        default_port = parts.port is None or parts.port == (443 if parts.scheme == "https" else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if default_port else f"{host}:{self.port}"
        self.base_path = parts.path.rstrip("/")
        self.connect_timeout = connect_timeout
        # No cap on connections: the gateway's own clients bound its concurrency, and a
        # proxy that queued behind a cap would add latency the client cannot see the cause of.
        self._idle: list[_Connection] = []
        self._closed = False

    def request_head(self, method: str, path: str, headers: dict[str, str]) -> bytes:
        """The request line and headers, minus Content-Length: build once, reuse for every call."""
        lines = [f"{method} {self.base_path}{path} HTTP/1.1", f"Host: {self.host_header}",
                 "Accept-Encoding: identity", *(f"{name}: {value}" for name, value in headers.items())]
        return ("\r\n".join(lines) + "\r\n").encode("latin-1")

    async def request(self, head: bytes, body: bytes, *, timeout: float, stream: bool = False) -> Response:
        """Send `head` + body; return once the response headers are in.

        `timeout` bounds the whole exchange, or for `stream=True` every wait for bytes."""
        data = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
        for attempt in (1, 2):
            conn = await self._connection()
            conn.begin(stream, timeout, idle_timeout=stream)
            conn.transport.write(data)
            try:
                await conn.headers_done
            except (ConnectionDropped, ProtocolError):
                conn.settle()
                conn.abort()
                if attempt == 1 and conn.reused and not conn.got_bytes:
                    continue  # the server dropped an idle connection as we wrote: it never saw the request
                raise
            except BaseException:
                conn.settle()
                conn.abort()
                raise
            return Response(self, conn)
        raise AssertionError("unreachable")

    async def _connection(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                conn.reused = True
                return conn
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Connection, self.host, self.port, ssl=self.ssl,
                                       server_hostname=self.host if self.ssl else None),
                self.connect_timeout,
            )
        except asyncio.TimeoutError:
            raise ConnectError(f"no connection to {self.host}:{self.port} within {self.connect_timeout:g} s") from None
        except OSError as exc:
            raise ConnectError(str(exc) or type(exc).__name__) from None
        return conn

    def _put_back(self, conn: _Connection, reusable: bool) -> None:
        if reusable and not self._closed:
            self._idle.append(conn)
        else:
            conn.abort()

    async def close(self) -> None:
        self._closed = True
        for conn in self._idle:
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()
