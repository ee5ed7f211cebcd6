"""The lean HTTP/1.1 pool the openai engine relays through, against scripted raw servers."""

from __future__ import annotations

import asyncio

import pytest

from gateway.engines.http1 import ConnectError, ConnectionDropped, HTTP1Pool, ProtocolError
from tests.helpers import free_port


class RawServer:
    """Answers each request with the next scripted bytes; `None` closes the connection instead."""

    def __init__(self, answers: list[bytes | None], close_after_each: bool = False):
        self.answers = list(answers)
        self.close_after_each = close_after_each
        self.requests: list[bytes] = []
        self.connections = 0

    async def __aenter__(self) -> "RawServer":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                self.requests.append(head + await reader.readexactly(length))
                answer = self.answers.pop(0) if self.answers else None
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
                if self.close_after_each or b"Connection: close" in answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)


async def _post(pool: HTTP1Pool, body: bytes = b"{}", **kwargs) -> tuple[int, bytes]:
    response = await pool.request(pool.request_head("POST", "/chat/completions", {"X-Test": "1"}), body,
                                  timeout=kwargs.pop("timeout", 5.0), **kwargs)
    return response.status, await response.read()


async def test_keep_alive_reuses_one_connection_and_sends_a_proper_request():
    async with RawServer([ok(b'{"a": 1}'), ok(b'{"a": 2}')]) as server:
        pool = HTTP1Pool(server.url)
        assert await _post(pool, b'{"q": 1}') == (200, b'{"a": 1}')
        assert await _post(pool, b'{"q": 2}') == (200, b'{"a": 2}')
        await pool.close()
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"Host: 127.0.0.1:" in first and b"X-Test: 1\r\n" in first and b"Content-Length: 8\r\n" in first
    assert first.endswith(b'\r\n\r\n{"q": 1}')


async def test_a_connection_the_server_closed_is_replaced():
    async with RawServer([ok(b"1"), ok(b"2"), ok(b"3")], close_after_each=True) as server:
        pool = HTTP1Pool(server.url)
        for expected in (b"1", b"2", b"3"):
            assert await _post(pool) == (200, expected)
        await pool.close()
    assert server.connections == 3


async def test_stale_connection_is_retried_once_when_the_server_never_saw_the_request():
    # The server answers, then drops the connection when the next request arrives, without a byte.
    async with RawServer([ok(b"1"), None, ok(b"2")]) as server:
        pool = HTTP1Pool(server.url)
        assert await _post(pool) == (200, b"1")
        assert await _post(pool) == (200, b"2")
        await pool.close()
    assert server.connections == 2


async def test_chunked_body_streams_as_it_arrives_and_close_framed_body_reads_whole():
    chunked = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"6\r\ndata: \r\n3\r\nab\n\r\n0\r\n\r\n")
    close_framed = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\nuntil the end"
    async with RawServer([chunked, close_framed], close_after_each=False) as server:
        pool = HTTP1Pool(server.url)
        response = await pool.request(pool.request_head("POST", "/x", {}), b"", timeout=5, stream=True)
        assert response.content_type == "text/event-stream"
        assert b"".join([chunk async for chunk in response.chunks()]) == b"data: ab\n"
        assert await _post(pool) == (200, b"until the end")
        await pool.close()


async def test_errors_are_typed():
    pool = HTTP1Pool(f"http://127.0.0.1:{free_port()}/v1")
    with pytest.raises(ConnectError):
        await _post(pool)
    async with RawServer([b"NOT HTTP AT ALL\r\n\r\n"]) as server:
        with pytest.raises(ProtocolError):
            await _post(HTTP1Pool(server.url))
    async with RawServer([b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort"], close_after_each=True) as server:
        with pytest.raises(ConnectionDropped):
            await _post(HTTP1Pool(server.url))


async def test_timeout_fires_and_the_connection_is_not_reused():
    async def silent(reader, writer):
        await reader.read(100)
        await asyncio.sleep(5)
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    pool = HTTP1Pool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    with pytest.raises(asyncio.TimeoutError):
        await _post(pool, timeout=0.2)
    assert pool._idle == []
    server.close()


def test_urls_it_cannot_use_are_refused_at_once():
    with pytest.raises(ValueError):
        HTTP1Pool("ftp://example.com")
    assert HTTP1Pool("https://api.example.com/v1").host_header == "api.example.com"
    assert HTTP1Pool("http://[::1]:8080/v1").host_header == "[::1]:8080"
