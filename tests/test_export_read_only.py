"""`rlproxy export` from a store it cannot write: a copy on read-only media, or files this user
may only read. Export only reads, so it reads such a store (`gateway.store.read_only`); where
it cannot without losing commits, it says so in one line.

Each export runs in a user namespace (`unshare`), so the test proves the real thing even as
root, for whom file permissions do not apply: `--user` alone leaves root's files unmapped, so
their mode bits hold; `--map-root-user --mount` may bind a directory over itself read-only.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys

import pytest

from gateway.store.sqlite import SQLiteStore
from tests.helpers import call_row

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READ_ONLY_MOUNT = [
    "unshare",
    "--user",
    "--map-root-user",
    "--mount",
    "sh",
    "-c",
    'mount --bind -o ro "$0" "$0" && exec "$@"',
]
NO_WRITE_PERMISSION = ["unshare", "--user"]


def _namespaces() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run([*READ_ONLY_MOUNT, "/tmp", "true"], capture_output=True)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _namespaces(), reason="needs unshare with user and mount namespaces")


def record(store: SQLiteStore, session: str) -> None:
    store.record_call_sync(
        call_row(
            f"call-{session}",
            session,
            None,
            request={"model": "agent", "messages": [{"role": "user", "content": "hi"}]},
            response={"choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}}]},
        )
    )


def export(state_dir, how: str):
    """`rlproxy export --state-dir state_dir` with the store made unwritable `how`."""
    command = [sys.executable, "-m", "gateway.cli", "export", "--state-dir", str(state_dir), "-o", "-"]
    if how == "read-only mount":
        command = [*READ_ONLY_MOUNT, str(state_dir), *command]
    else:
        command = [*NO_WRITE_PERMISSION, *command]
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})


@pytest.fixture
def copied(tmp_path):
    """A store copied, closed cleanly, into a directory of its own (as a backup is)."""
    source = tmp_path / "live"
    store = SQLiteStore(source / "rlproxy.db")
    record(store, "s-1")
    record(store, "s-2")
    asyncio.run(store.close())
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(source / "rlproxy.db", copy / "rlproxy.db")
    yield copy
    copy.chmod(0o700)  # whatever the test did to it, pytest can remove it


def unwritable(directory, how: str) -> None:
    if how == "no write permission":
        for path in directory.iterdir():
            path.chmod(0o444)
        directory.chmod(0o555)


@pytest.mark.parametrize("how", ["read-only mount", "no write permission"])
def test_a_store_that_cannot_be_written_exports(copied, how):
    unwritable(copied, how)
    done = export(copied, how)
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["id"] for line in done.stdout.splitlines()] == ["s-1", "s-2"]
    assert "exported 2 sessions" in done.stderr
    assert sorted(p.name for p in copied.iterdir()) == ["rlproxy.db"]  # nothing written beside it


@pytest.mark.parametrize("how", ["read-only mount", "no write permission"])
def test_commits_still_in_the_wal_are_read_with_its_shm_or_refused_without_it(tmp_path, how):
    # A copy of a store in use: the newest call is only in rlproxy.db-wal, which SQLite reads
    # with the -shm beside it. Without the -shm, in a directory where it cannot be made, the
    # file alone would export without that call: refused, in one line.
    store = SQLiteStore(tmp_path / "live" / "rlproxy.db")
    record(store, "s-checkpointed")
    store._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    record(store, "s-in-the-wal")
    for name, suffixes in (("with-shm", ("", "-wal", "-shm")), ("without-shm", ("", "-wal"))):
        (tmp_path / name).mkdir()
        for suffix in suffixes:
            shutil.copy(tmp_path / "live" / f"rlproxy.db{suffix}", tmp_path / name / f"rlproxy.db{suffix}")
        unwritable(tmp_path / name, how)
    asyncio.run(store.close())

    done = export(tmp_path / "with-shm", how)
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["id"] for line in done.stdout.splitlines()] == ["s-checkpointed", "s-in-the-wal"]

    refused = export(tmp_path / "without-shm", how)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.startswith("rlproxy export: cannot read the store")
    assert "copy rlproxy.db and rlproxy.db-wal to a writable directory" in refused.stderr.lower()
    assert "Traceback" not in refused.stderr
    for name in ("with-shm", "without-shm"):
        (tmp_path / name).chmod(0o700)


def test_a_writable_store_still_opens_as_usual(copied):
    # Writable, it is the gateway's own store: opened (and migrated) as serve and train open it.
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "export", "--state-dir", str(copied), "-o", "-"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 2
