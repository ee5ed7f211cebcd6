"""Fixtures shared by several test modules."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fake_upstream import FakeUpstream

# A run of at least this many tests (the whole suite) builds the built-in models beside its first tests.
BUILD_AHEAD_FROM = 300


@pytest.fixture(scope="session", autouse=True)
def built_in_models_built_once(request, tmp_path_factory):
    """One cache of built-in models for the whole run (children inherit it): the instruct
    model takes a minute or two to build, and no test should pay for it twice. In a whole run
    a child process builds the models as it starts: the instruct model's build is
    single-threaded, and the first test that needs it (minutes in) paid its 3 minutes while the
    other core sat idle. A test that comes first waits for the build under way
    (`gateway.models.cache.build_once`), as it would for a gateway's."""
    previous = os.environ.get("RLPROXY_CACHE_DIR")
    os.environ["RLPROXY_CACHE_DIR"] = str(tmp_path_factory.mktemp("model-cache"))
    builder = _build_ahead() if len(request.session.items) >= BUILD_AHEAD_FROM else None
    yield
    if builder is not None:
        builder.kill()  # a short run ended first: the rest of its build is of no use
        builder.wait()
    if previous is None:
        os.environ.pop("RLPROXY_CACHE_DIR", None)
    else:
        os.environ["RLPROXY_CACHE_DIR"] = previous


def _build_ahead() -> subprocess.Popen:
    """The built-in models, into `RLPROXY_CACHE_DIR`, in a child that dies with this process: the
    tiny one, SmolLM2's conversion (the cache takes one build at a time, and the chat template's
    tests need it a minute in), then the instruct one. A build that fails here is the test's to
    report: it tries again and says why."""
    from gateway.children import die_with_parent

    code = (
        "import contextlib, os\n"
        "from gateway.models.smollm2 import ensure_smollm2\n"
        "from gateway.models.tiny import ensure_tiny_model\n"
        "cache = os.environ['RLPROXY_CACHE_DIR']\n"
        "ensure_tiny_model(cache)\n"
        "with contextlib.suppress(Exception):\n"
        "    ensure_smollm2(cache)\n"
        "ensure_tiny_model(cache, instruct=True)\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent,
    )


@pytest.fixture(scope="session", autouse=True)
def serve_listens_on_a_free_port():
    """`rlproxy serve` binds its port before anything else; a test that runs it without `--port`
    to see a refusal would otherwise get "port 8000 is already in use" wherever something (another
    gateway, another suite) holds 8000. Port 0 is any free one; a test may still set its own."""
    previous = os.environ.get("RLPROXY_PORT")
    os.environ["RLPROXY_PORT"] = "0"
    yield
    if previous is None:
        os.environ.pop("RLPROXY_PORT", None)
    else:
        os.environ["RLPROXY_PORT"] = previous


@pytest.fixture(scope="module")
def upstream():
    """A loopback OpenAI-compatible upstream (echoes the last user message), one per module."""
    with FakeUpstream() as server:
        yield server


@pytest.fixture(scope="session")
def postgres_url():
    """A running PostgreSQL (see tests/helpers_postgres.py), one per test session."""
    import shutil
    import tempfile
    import uuid

    from tests.helpers_postgres import postgres_server

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


@pytest.fixture(params=["sqlite", "postgres"])
def either_backend(request, tmp_path):
    """A store of each backend in turn (its test runs twice): for SQL that both must run alike."""
    import asyncio

    from gateway.store.sqlite import SQLiteStore

    if request.param == "sqlite":
        yield SQLiteStore(tmp_path / "db.sqlite")
    else:
        from gateway.store.postgres import PostgresStore

        pg = PostgresStore(request.getfixturevalue("postgres_db"))
        yield pg
        asyncio.run(pg.close())
