"""Helpers for tests that run the gateway on the `openai` engine in front of the fake upstream."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

from gateway.app import create_app
from gateway.settings import Settings
from tests.helpers import ThreadServer


@contextlib.contextmanager
def openai_gateway(upstream_url: str, state_dir: Path, **settings) -> Iterator[tuple[ThreadServer, object]]:
    """The gateway (openai engine, in a thread) in front of `upstream_url`; yields (server, services)."""
    app = create_app(
        Settings(engine="openai", upstream_url=upstream_url, state_dir=state_dir, trainer="off", **settings)
    )
    with ThreadServer(app) as server:
        yield server, app.state.services


def raw_store_bytes(state_dir: Path) -> bytes:
    """Every byte of the SQLite store (main file, WAL and shared memory), to grep for secrets."""
    return b"".join(path.read_bytes() for path in sorted(Path(state_dir).glob("rlproxy.db*")))


def send_and_leave(base_url: str, path: str, session: str, body: dict) -> None:
    """POST a whole request over a raw socket, then close it at once, before any answer."""
    url = urlsplit(base_url)
    data = json.dumps(body).encode()
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"X-Session-Id: {session}\r\nContent-Length: {len(data)}\r\n\r\n".encode()
            + data
        )


def first_call(store, session: str, seconds: float) -> dict | None:
    """The session's first recorded call, waited for up to `seconds`; None if none came."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        calls = store.session_calls(session)
        if calls:
            return calls[0]
        time.sleep(0.02)
    return None
