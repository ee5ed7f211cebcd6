"""A lean keep-alive HTTP/1.1 pool (asyncio + httptools) for whole-body exchanges with one origin.

Why not aiohttp for these: relaying a chat completion is the gateway's hot path, and per
request aiohttp's client machinery costs ~270 us of CPU on the 2-core bench machine
against ~90 us for a request written and parsed here (bench/README.md): most of what the
gateway adds to a call. The openai engine sends every request that is answered in one
piece (chat completions, other protocols relayed, `/models`) through this pool, the vLLM
engine its non-streamed chat completions; event streams stay on aiohttp, where per-chunk
work dominates anyway.

Scope, on purpose: http and https, over TCP or a Unix socket (the managed vLLM's); one request
per connection at a time; responses framed by Content-Length, chunked encoding (httptools
decodes it) or the connection closing; no redirects, no proxies (the aiohttp session does not
read proxy settings either), no compression (requests say `Accept-Encoding: identity`).

A request that fails on a reused keep-alive connection before any byte of the answer
arrived is sent again, on the next idle connection or a new one: the server closed an idle
connection as we wrote, so it never saw the request (after a quiet spell every idle one may be
closed so; each that fails leaves the pool). A new connection that fails so is not tried again.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

# What a request path may hold (RFC 3986's path and query characters): never a space or a
# line break, which would let a name from a request write its own request line or headers
# (matched whole: `$` lets a final line break through).
_PATH = re.compile(r"/[A-Za-z0-9._~!$&'()*+,;=:@/%?-]*")

# Sends of one request on pooled connections that turn out closed before it goes to a new one.
STALE_TRIES = 8

# Seconds an idle connection is kept (aiohttp's keepalive_timeout): a burst of calls leaves as
# many connections as it had at once, and an upstream that keeps idle ones open (a load
# balancer, a server with a long keep-alive) held them all, a socket each on both sides, for good.
KEEPALIVE_EXPIRY = 15.0


class ConnectError(OSError):
    """No connection to the upstream could be made (refused, unresolvable, unreachable)."""

    answered = False


class ConnectionDropped(OSError):
    """The connection broke before the response was complete; `answered`: whether any byte of
    the response had come (if not, the request may be sent elsewhere)."""

    answered = True


class ProtocolError(OSError):
    """The upstream's bytes are not a valid HTTP/1.1 response."""

    answered = True


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str  # media type only, lower case ("application/json")
    body: bytes
    retry_after: str | None = None  # an error answer's Retry-After, for the client to honour


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection; one exchange at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self._loop = asyncio.get_running_loop()
        self.finished: asyncio.Future | None = None
        self.generation = 0
        self.idle_since = 0.0  # the loop's clock when it was last put back in the pool

    def begin(self) -> asyncio.Future:
        """Get ready for the next response; the future settles when it is complete."""
        self.parser = httptools.HttpResponseParser(self)
        self.content_type = ""
        self.retry_after: str | None = None
        self.framed = False  # Content-Length or chunked: else the body ends when the connection does
        self.headers_done = False
        self.body: list[bytes] = []
        self.got_bytes = False
        self.finished = self._loop.create_future()
        return self.finished

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: BaseException) -> None:
        if self.finished is not None and not self.finished.done():
            self.finished.set_exception(exc)

    # -- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if self.finished is None or self.finished.done():
            self.abort()  # bytes nobody asked for: the connection's framing cannot be trusted
            return
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
        if self.finished is None or self.finished.done():
            return
        if self.headers_done and not self.framed:
            self.on_message_complete()  # a body framed by the connection closing
            return
        reason = f": {exc}" if exc else ""
        dropped = ConnectionDropped(f"the upstream closed the connection before the response was complete{reason}")
        dropped.answered = self.got_bytes
        self._fail(dropped)

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-type":
            self.content_type = value.decode("latin-1").split(";", 1)[0].strip().lower()
        elif name == b"retry-after":
            self.retry_after = value.decode("latin-1")
        elif name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.finished is not None and not self.finished.done():
            self.finished.set_result(
                Answer(self.parser.get_status_code(), self.content_type, b"".join(self.body), self.retry_after)
            )
        if not self.parser.should_keep_alive():
            self.closed = True


class HTTP1Pool:
    """Keep-alive connections to the origin of `base_url` (over `unix_socket` when given);
    `exchange` sends one request and returns the whole answer."""

    def __init__(
        self,
        base_url: str,
        headers: dict[str, str],
        *,
        connect_timeout: float = 30.0,
        unix_socket: str | None = None,
        keepalive_expiry: float = KEEPALIVE_EXPIRY,
    ):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        default_port = parts.port is None or parts.port == (443 if parts.scheme == "https" else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        host_header = host if default_port else f"{host}:{self.port}"
        self.base_path = parts.path.rstrip("/")
        # Built once: each request adds only its request line, Content-Length and body.
        self._headers = "".join(
            f"{name}: {value}\r\n"
            for name, value in {"Host": host_header, "Accept-Encoding": "identity", **headers}.items()
        ).encode("latin-1")
        self.connect_timeout = connect_timeout
        self.unix_socket = unix_socket
        self._where = unix_socket or f"{self.host}:{self.port}"
        # No cap on connections: the gateway's own clients bound its concurrency, and a
        # proxy that queued behind a cap would add latency the client cannot see the cause of.
        self._idle: list[_Connection] = []  # oldest put back first: taken from the end, the newest
        self._generation = 0  # `close()` starts a new one: a connection from before is not kept
        # One timer per pool, not per call (bench/README.md: per-call timers and tasks cost the hot
        # path): set while connections are idle, it closes those idle for `keepalive_expiry`.
        self.keepalive_expiry = keepalive_expiry
        self._sweep: asyncio.TimerHandle | None = None
        self._sweep_loop: asyncio.AbstractEventLoop | None = None

    def head(self, method: str, path: str) -> bytes:
        """The request line and headers up to Content-Length, for `exchange`; build once per route."""
        if not _PATH.fullmatch(path):
            raise ValueError(f"not a request path: {path!r}")
        return f"{method} {self.base_path}{path} HTTP/1.1\r\n".encode("latin-1") + self._headers

    async def exchange(self, head: bytes, body: bytes | None, *, timeout: float) -> Answer:
        """Send `head` (from `head()`) and `body` (None: no body, as for GET); the whole
        answer, within `timeout` seconds. Raises ConnectError, ConnectionDropped,
        ProtocolError or asyncio.TimeoutError."""
        data = head + (b"\r\n" if body is None else b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        async with asyncio.timeout(timeout):
            for attempt in range(1, STALE_TRIES + 1):
                conn = await self._connection()
                finished = conn.begin()
                conn.transport.write(data)
                try:
                    answer = await finished
                except (ConnectionDropped, ProtocolError):
                    conn.abort()
                    if attempt < STALE_TRIES and conn.reused and not conn.got_bytes:
                        continue  # the server dropped an idle connection as we wrote: it never saw the request
                    raise
                except BaseException:  # cancelled or timed out: the answer may still come, on this connection
                    conn.abort()
                    raise
                self._put_back(conn)
                return answer
        raise AssertionError("unreachable")

    async def _connection(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                conn.reused = True
                return conn
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                if self.unix_socket:
                    _, conn = await loop.create_unix_connection(_Connection, self.unix_socket)
                else:
                    _, conn = await loop.create_connection(
                        _Connection, self.host, self.port, ssl=self.ssl, server_hostname=self.host if self.ssl else None
                    )
                conn.generation = self._generation
        except TimeoutError:
            raise ConnectError(f"no connection to {self._where} within {self.connect_timeout:g} s") from None
        except OSError as exc:
            raise ConnectError(str(exc) or type(exc).__name__) from None
        return conn

    def _put_back(self, conn: _Connection) -> None:
        if conn.closed or conn.generation != self._generation:
            conn.abort()
            return
        loop = asyncio.get_running_loop()
        conn.idle_since = loop.time()
        self._idle.append(conn)
        if self._sweep is None or self._sweep_loop is not loop:  # (a pool used from another loop since)
            self._sweep, self._sweep_loop = loop.call_at(conn.idle_since + self.keepalive_expiry, self._expire), loop

    def _expire(self) -> None:
        """Close the connections idle for `keepalive_expiry`; come back when the next one will be."""
        self._sweep = None
        loop = asyncio.get_running_loop()
        cutoff = loop.time() - self.keepalive_expiry
        expired = 0
        while expired < len(self._idle) and self._idle[expired].idle_since <= cutoff:
            conn = self._idle[expired]
            conn.closed = True
            if conn.transport is not None:
                conn.transport.close()  # idle: nothing to flush, a plain FIN the server reads as a client gone
            expired += 1
        del self._idle[:expired]
        if self._idle:
            self._sweep = loop.call_at(self._idle[0].idle_since + self.keepalive_expiry, self._expire)

    async def close(self) -> None:
        """Close the idle connections; one in use is closed when its exchange ends. The pool
        stays usable (an engine that restarts opens new connections)."""
        self._generation += 1
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in self._idle:
            if conn.transport is not None:
                conn.transport.close()
        self._idle.clear()
