"""Fixtures shared by several test modules."""

import pytest

from tests.fake_upstream import FakeUpstream


@pytest.fixture(scope="module")
def upstream():
    """A loopback OpenAI-compatible upstream (echoes the last user message), one per module."""
    with FakeUpstream() as server:
        yield server


@pytest.fixture(scope="session")
def postgres_url(tmp_path_factory):
    """A running PostgreSQL (see tests/helpers_postgres.py), one per test session."""
    from tests.helpers_postgres import postgres_server

    with postgres_server(tmp_path_factory.mktemp("pg")) as url:
        yield url


@pytest.fixture
def postgres_db(postgres_url):
    """The URL of an empty database of this test's own."""
    from tests.helpers_postgres import fresh_database

    return fresh_database(postgres_url)
