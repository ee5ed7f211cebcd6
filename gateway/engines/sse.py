"""Reading server-sent events from an upstream (OpenAI-compatible servers and vLLM)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp


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
