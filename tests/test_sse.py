"""Reading an upstream's server-sent events, however the bytes happen to arrive."""

from __future__ import annotations

import asyncio
from unittest import mock

import aiohttp

from gateway.engines.sse import sse_data


def events(*pieces: bytes) -> list[bytes]:
    async def read() -> list[bytes]:
        content = aiohttp.StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop())
        for piece in pieces:
            content.feed_data(piece)
        content.feed_eof()
        return [payload async for payload in sse_data(content)]

    return asyncio.run(read())


def test_crlf_lines_comments_and_pieces_split_anywhere():
    stream = b': keep-alive\r\n\r\ndata: {"a": 1}\r\n\r\nevent: x\r\ndata: [DONE]\r\n\r\n'
    for cut in range(1, len(stream)):
        assert events(stream[:cut], stream[cut:]) == [b'{"a": 1}', b"[DONE]"], cut


def test_an_event_longer_than_any_buffer():
    big = b"x" * 3_000_000
    assert events(b"data: ", big[:1000], big[1000:], b"\n\ndata: [DONE]\n\n") == [big, b"[DONE]"]
