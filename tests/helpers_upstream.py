"""Helpers for tests that run the gateway on the `openai` engine in front of the fake upstream."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from gateway.app import create_app
from gateway.settings import Settings
from tests.helpers import ThreadServer


@contextlib.contextmanager
def openai_gateway(upstream_url: str, state_dir: Path, **settings) -> Iterator[tuple[ThreadServer, object]]:
    """The gateway (openai engine, in a thread) in front of `upstream_url`; yields (server, services)."""
    app = create_app(Settings(engine="openai", upstream_url=upstream_url, state_dir=state_dir, trainer="off",
                              **settings))
    with ThreadServer(app) as server:
        yield server, app.state.services


def raw_store_bytes(state_dir: Path) -> bytes:
    """Every byte of the SQLite store (main file, WAL and shared memory), to grep for secrets."""
    return b"".join(path.read_bytes() for path in sorted(Path(state_dir).glob("rlproxy.db*")))
