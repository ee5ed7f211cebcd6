"""Reading server-sent events from an upstream (OpenAI-compatible servers and vLLM)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp


async def sse_data(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The `data` of each server-sent event (multi-line data joined by newlines); `event:`,
    `id:`, `retry:` and `:` comment lines carry nothing a chat chunk needs."""
    lines: list[bytes] = []
    async for line in content:
        line = line.rstrip(b"\r\n")
        if not line:
            if lines:
                yield b"\n".join(lines)
                lines = []
        elif line.startswith(b"data:"):
            value = line[5:]
            lines.append(value[1:] if value.startswith(b" ") else value)
    if lines:
        yield b"\n".join(lines)
