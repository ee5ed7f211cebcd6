"""Fixtures shared by several test modules."""

import pytest

from tests.fake_upstream import FakeUpstream


@pytest.fixture(scope="module")
def upstream():
    """A loopback OpenAI-compatible upstream (echoes the last user message), one per module."""
    with FakeUpstream() as server:
        yield server


@pytest.fixture(scope="session")
def postgres_url():
    """A running PostgreSQL (see tests/helpers_postgres.py), one per test session."""
    from tests.helpers_postgres import postgres_server

    import shutil
    import tempfile
    import uuid
    from pathlib import Path

    # Not under pytest's basetemp: pytest runs beside this one may prune old basetemps.
    root = Path(tempfile.gettempdir()) / f"rlproxy-pg-{uuid.uuid4().hex[:12]}"
    try:
        with postgres_server(root) as url:
            yield url
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def postgres_db(postgres_url):
    """The URL of an empty database of this test's own."""
    from tests.helpers_postgres import fresh_database

    return fresh_database(postgres_url)
