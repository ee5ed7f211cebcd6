"""The keep-alive HTTP/1.1 pool the openai engine sends whole-body requests through, against
scripted raw servers (bytes in, bytes out: nothing here trusts the pool's own framing)."""

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
        self.open = 0  # connections not closed yet

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
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
            self.open -= 1
            writer.close()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: %d\r\n%s\r\n%s" % (
        len(body),
        extra,
        body,
    )


async def _post(pool: HTTP1Pool, body: bytes = b"{}", timeout: float = 5.0) -> tuple[int, bytes]:
    answer = await pool.exchange(pool.head("POST", "/chat/completions"), body, timeout=timeout)
    return answer.status, answer.body


async def test_keep_alive_reuses_one_connection_and_sends_a_proper_request():
    async with RawServer([ok(b'{"a": 1}'), ok(b'{"a": 2}')]) as server:
        pool = HTTP1Pool(server.url, {"X-Test": "1"})
        answer = await pool.exchange(pool.head("POST", "/chat/completions"), b'{"q": 1}', timeout=5)
        assert (answer.status, answer.content_type, answer.body) == (200, "application/json", b'{"a": 1}')
        assert await _post(pool, b'{"q": 2}') == (200, b'{"a": 2}')
        await pool.close()
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"\r\nHost: 127.0.0.1:" in first and b"\r\nX-Test: 1\r\n" in first
    assert b"\r\nContent-Length: 8\r\n" in first and b"\r\nAccept-Encoding: identity\r\n" in first
    assert first.endswith(b'\r\n\r\n{"q": 1}')


async def test_a_get_has_no_body_and_no_content_length():
    async with RawServer([ok(b'{"data": []}')]) as server:
        pool = HTTP1Pool(server.url, {})
        answer = await pool.exchange(pool.head("GET", "/models"), None, timeout=5)
        await pool.close()
    assert answer.body == b'{"data": []}'
    assert server.requests[0].startswith(b"GET /v1/models HTTP/1.1\r\n")
    assert b"content-length" not in server.requests[0].lower() and server.requests[0].endswith(b"\r\n\r\n")


async def test_a_connection_the_server_closed_is_replaced():
    async with RawServer([ok(b"1"), ok(b"2", b"Connection: close\r\n"), ok(b"3")], close_after_each=True) as server:
        pool = HTTP1Pool(server.url, {})
        for expected in (b"1", b"2", b"3"):
            assert await _post(pool) == (200, expected)
        await pool.close()
    assert server.connections == 3


async def test_stale_connection_is_retried_once_when_the_server_never_saw_the_request():
    # The server answers, then drops the connection when the next request arrives, without a byte.
    async with RawServer([ok(b"1"), None, ok(b"2")]) as server:
        pool = HTTP1Pool(server.url, {})
        assert await _post(pool) == (200, b"1")
        assert await _post(pool) == (200, b"2")
        await pool.close()
    assert server.connections == 2


async def test_every_stale_idle_connection_is_passed_over_until_a_new_one_answers():
    # Two idle connections, both closed by the server as the next request comes (its keep-alive
    # timeout ran out on each during a quiet spell): the request goes on to a third, new one.
    async with RawServer([ok(b"1"), ok(b"2"), None, None, ok(b"3")]) as server:
        pool = HTTP1Pool(server.url, {})
        assert sorted(await asyncio.gather(_post(pool), _post(pool))) == [(200, b"1"), (200, b"2")]
        assert len(pool._idle) == 2
        assert await _post(pool) == (200, b"3")
        await pool.close()
    assert server.connections == 3


async def test_chunked_and_close_framed_bodies_read_whole():
    chunked = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'6\r\n{"a": \r\n2\r\n1}\r\n0\r\n\r\n'
    )
    close_framed = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\nuntil the end"
    async with RawServer([chunked, close_framed]) as server:
        pool = HTTP1Pool(server.url, {})
        assert await _post(pool) == (200, b'{"a": 1}')
        assert await _post(pool) == (200, b"until the end")
        await pool.close()
    assert server.connections == 1


async def test_error_statuses_come_back_as_answers():
    body = b'{"error": {"message": "no"}}'
    answer = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    async with RawServer([answer]) as server:
        pool = HTTP1Pool(server.url, {})
        assert await _post(pool) == (503, body)
        await pool.close()


async def test_errors_are_typed():
    pool = HTTP1Pool(f"http://127.0.0.1:{free_port()}/v1", {})
    with pytest.raises(ConnectError):
        await _post(pool)
    async with RawServer([b"NOT HTTP AT ALL\r\n\r\n"]) as server:
        with pytest.raises(ProtocolError):
            await _post(HTTP1Pool(server.url, {}))
    async with RawServer([b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort"], close_after_each=True) as server:
        with pytest.raises(ConnectionDropped):
            await _post(HTTP1Pool(server.url, {}))


async def test_a_timeout_or_a_cancelled_call_never_leaves_its_connection_in_the_pool():
    async def silent(reader, writer):
        await reader.read(100)
        await asyncio.sleep(5)
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    pool = HTTP1Pool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", {})
    with pytest.raises(TimeoutError):
        await _post(pool, timeout=0.2)
    assert pool._idle == []
    call = asyncio.ensure_future(_post(pool))
    await asyncio.sleep(0.1)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert pool._idle == []  # its answer could still arrive and be taken for the next request's
    server.close()


def test_urls_and_paths_it_cannot_use_are_refused_at_once():
    with pytest.raises(ValueError):
        HTTP1Pool("ftp://example.com", {})
    pool = HTTP1Pool("https://api.example.com/v1", {})
    assert pool.head("GET", "/models").startswith(b"GET /v1/models HTTP/1.1\r\nHost: api.example.com\r\n")
    assert b"Host: [::1]:8080\r\n" in HTTP1Pool("http://[::1]:8080/v1", {}).head("GET", "/models")
    for path in ("/responses/a b", "/responses/x\r\nX-Evil: 1", "responses", "/responses/x\n"):
        with pytest.raises(ValueError):
            pool.head("GET", path)


async def test_close_drops_idle_connections_and_the_pool_still_works_after():
    slow = b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n"
    async with RawServer([ok(b"1"), ok(b"2"), slow + b"late", ok(b"3")]) as server:
        pool = HTTP1Pool(server.url, {})
        assert await _post(pool) == (200, b"1")
        await pool.close()
        assert pool._idle == []
        assert await _post(pool) == (200, b"2")  # a new connection: the engine restarted, say
        in_use = asyncio.ensure_future(_post(pool))  # on the connection "2" came back on
        await asyncio.sleep(0)  # the exchange has its connection now
        await pool.close()
        assert await in_use == (200, b"late")
        assert pool._idle == []  # it belonged to the pool before the close: not kept
        assert await _post(pool) == (200, b"3")
        await pool.close()
    assert server.connections == 3  # "1"; "2" and "late"; "3"


async def test_connections_left_idle_after_a_burst_are_closed_once_their_keep_alive_expires():
    # After 30 calls at once the pool held 30 idle connections for as long as the upstream let
    # it: a socket each on both sides, for good where the upstream keeps idle ones open.
    async with RawServer([ok(b"%d" % i) for i in range(31)]) as server:
        pool = HTTP1Pool(server.url, {}, keepalive_expiry=0.05)
        answers = await asyncio.gather(*(_post(pool) for _ in range(30)))
        assert sorted(int(body) for _, body in answers) == list(range(30))
        assert server.connections == 30 and len(pool._idle) == 30
        for _ in range(500):  # the pool's one timer closes them; the server sees each close
            if server.open == 0:
                break
            await asyncio.sleep(0.01)
        assert server.open == 0 and pool._idle == []
        assert await _post(pool) == (200, b"30")  # a new connection: the pool goes on
        assert server.connections == 31 and len(pool._idle) == 1
        await pool.close()
