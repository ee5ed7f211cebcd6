"""A real PostgreSQL for the tests: `RLPROXY_TEST_POSTGRES` (a URL) if set, else one the
`pgserver` wheel starts under a temporary directory (no system install), stopped at the end.
Each test gets a database of its own (`fresh_database`)."""

from __future__ import annotations

import os
import re
import uuid
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def postgres_server(root: Path):
    """Yield the URL of a server's maintenance database; stop the server afterwards if we started it."""
    url = os.environ.get("RLPROXY_TEST_POSTGRES")
    if url:
        yield url
        return
    import pgserver

    server = pgserver.get_server(str(root), cleanup_mode="stop")
    try:
        yield server.get_uri()
    finally:
        server.cleanup()


def database_url(server_url: str, name: str) -> str:
    """The URL of database `name` on the same server."""
    return re.sub(r"(postgres(?:ql)?://[^/]*/)([^?]*)", lambda m: m.group(1) + name, server_url, count=1)


def fresh_database(server_url: str) -> str:
    import psycopg

    name = "t_" + uuid.uuid4().hex[:16]
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return database_url(server_url, name)
