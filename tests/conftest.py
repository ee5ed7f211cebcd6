"""Fixtures shared by several test modules."""

import pytest

from tests.fake_upstream import FakeUpstream


@pytest.fixture(scope="module")
def upstream():
    """A loopback OpenAI-compatible upstream (echoes the last user message), one per module."""
    with FakeUpstream() as server:
        yield server
