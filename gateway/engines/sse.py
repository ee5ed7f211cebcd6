"""Event streams from an upstream (OpenAI-compatible servers and vLLM): the aiohttp session
that asks for them, and reading their server-sent events."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
from yarl import URL

from gateway.engines.http1 import STALE_TRIES


def stream_session(pool_size: int) -> aiohttp.ClientSession:
    """A session for event streams, which `post_stream` sends: no cookie jar (cookies from the
    upstream must not leak between clients), and a trace of whether a request went out on a
    reused connection."""
    connector = aiohttp.TCPConnector(limit=pool_size, limit_per_host=0, keepalive_timeout=60, ttl_dns_cache=300)
    return aiohttp.ClientSession(
        connector=connector,
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent",),
        trace_configs=[reuse_trace()],
    )


def reuse_trace() -> aiohttp.TraceConfig:
    """The trace `post_stream` needs on a session: whether a request went out on a reused connection."""
    reuse = aiohttp.TraceConfig()
    reuse.on_connection_reuseconn.append(_mark_reused)
    return reuse


async def _mark_reused(session: aiohttp.ClientSession, context, params) -> None:
    if isinstance(context.trace_request_ctx, dict):
        context.trace_request_ctx["reused"] = True


async def post_stream(
    session: aiohttp.ClientSession, url: URL | str, data: bytes, headers: dict, timeout: aiohttp.ClientTimeout
) -> aiohttp.ClientResponse:
    """POST for an event stream (`session` from `stream_session`, or one with `reuse_trace`); the
    response once its headers came. A reused keep-alive connection the upstream closed as we wrote
    (its idle timeout: 5 s on uvicorn, so on vLLM's server) fails before any byte of an answer:
    the upstream never saw the request, so it goes again, on the next pooled connection or a new
    one (aiohttp does so for idempotent methods only). After a quiet spell every idle connection
    may be closed so: each one that fails leaves the pool. A new connection that fails so is not
    tried again: that upstream may have seen the request."""
    for attempt in range(1, STALE_TRIES + 1):
        sent = {"reused": False}
        try:
            return await session.post(url, data=data, headers=headers, timeout=timeout, trace_request_ctx=sent)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            if attempt == STALE_TRIES or not sent["reused"]:
                raise
    raise AssertionError("unreachable")


async def sse_lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The stream's lines, `\\r\\n` or `\\n` ended, of any length. Not `async for line in
    content`: aiohttp's `readline` raises `LineTooLong` past 512 KiB, and one chat chunk (a
    long tool call's arguments, or a whole answer from an upstream that does not stream
    token by token) can be longer; that broke the client's stream and was recorded as
    the client's leaving."""
    parts: list[bytes] = []  # the line so far, joined once it ends (no copying per piece)
    async for data in content.iter_any():
        if b"\n" not in data:
            parts.append(data)
            continue
        *lines, rest = data.split(b"\n")
        lines[0] = b"".join((*parts, lines[0]))
        parts = [rest] if rest else []
        for line in lines:
            yield line.rstrip(b"\r")
    if parts:
        yield b"".join(parts).rstrip(b"\r")


async def sse_data(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The `data` of each server-sent event (multi-line data joined by newlines); `event:`,
    `id:`, `retry:` and `:` comment lines carry nothing a chat chunk needs."""
    lines: list[bytes] = []
    async for line in sse_lines(content):
        if not line:
            if lines:
                yield b"\n".join(lines)
                lines = []
        elif line.startswith(b"data:"):
            value = line[5:]
            lines.append(value[1:] if value.startswith(b" ") else value)
    if lines:
        yield b"\n".join(lines)
