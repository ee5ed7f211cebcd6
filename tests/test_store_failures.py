"""The store failing under the gateway: a full disk (SQLite's page limit, and a real small
tmpfs where this machine lets us mount one), a read-only store, a write lock held by another
process. Calls answer 503/507 with the cause and what to do, nothing is acknowledged that
was not recorded, /healthz says `degraded` with the reason, /metrics counts the errors, and
the gateway recovers by itself, without a restart, once the cause is gone."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from gateway.app import create_app
from gateway.errors import StoreFull, StoreUnavailable
from gateway.settings import Settings
from gateway.store import Store
from gateway.store.health import classify
from gateway.store.sqlite import SQLiteStore
from tests.helpers import ThreadServer

BIG = "x" * 200_000  # a call that needs new pages (and WAL space) to be recorded


def _on_write_connections(store, sql: str) -> None:
    """A per-connection setting (a disk that is full, a file that is read-only) on each
    connection the store writes with: the writer thread's and the event loop's."""
    for conn in (store._conn, store._loop_conn):
        conn.execute(sql)


def _chat(url: str, text: str = "hello", *, stream: bool = False, session: str = "s1") -> httpx.Response:
    body = {"model": "fake-model", "stream": stream, "messages": [{"role": "user", "content": text}]}
    return httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Session-Id": session}, timeout=60)


@contextlib.contextmanager
def gateway(upstream_url: str, state_dir: Path, **store_kwargs):
    settings = Settings(engine="openai", upstream_url=upstream_url, state_dir=state_dir, trainer="off")
    store = SQLiteStore(settings.db_path, **store_kwargs)
    app = create_app(settings, store=store)
    with ThreadServer(app) as server:
        yield server.url, store


def _recorded(store: Store) -> set[str]:
    return {row["id"] for row in store._query("SELECT id FROM calls")}


def _assert_healthy(url: str) -> None:
    health = httpx.get(url + "/healthz")
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text


def _metric(url: str, line_start: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_full_disk_by_page_limit_answers_507_and_recovers_without_restart(upstream, tmp_path):
    with gateway(upstream.url, tmp_path) as (url, store):
        assert _chat(url).status_code == 200
        acknowledged = {_chat(url).headers["x-request-id"]}
        pages = store._conn.execute("PRAGMA page_count").fetchone()[0]
        _on_write_connections(store, f"PRAGMA max_page_count = {pages}")  # the disk is full now

        refused = _chat(url, BIG)
        assert refused.status_code == 507, refused.text
        error = refused.json()["error"]
        assert error["type"] == "insufficient_storage" and error["code"] == "store_full"
        assert "disk" in error["message"] and "full" in error["message"] and "Free space" in error["message"]
        assert "recovers by itself" in error["message"]
        assert refused.headers["x-request-id"] not in _recorded(store)

        # Degraded: every call is refused before engine work, streams too, with the same cause.
        sent_before = len(upstream.chat_requests())
        assert _chat(url, "small").status_code == 507
        assert _chat(url, "small", stream=True).status_code == 507
        assert len(upstream.chat_requests()) == sent_before
        health = httpx.get(url + "/healthz")
        assert health.status_code == 503
        assert health.json()["status"] == "degraded" and "full" in health.json()["reason"]
        assert health.json()["store"]["cause"] == "full"
        assert _metric(url, 'rlproxy_store_errors_total{cause="full"}') >= 3
        assert _metric(url, "rlproxy_store_degraded ") == 1

        _on_write_connections(store, "PRAGMA max_page_count = 1073741823")  # space is back
        _assert_healthy(url)
        for stream in (False, True):
            reply = _chat(url, BIG, stream=stream)
            assert reply.status_code == 200, reply.text
            acknowledged.add(reply.headers["x-request-id"])
        assert acknowledged <= _recorded(store)
        assert _metric(url, "rlproxy_store_degraded ") == 0


def test_stream_whose_record_fails_ends_with_the_error_and_no_done(upstream, tmp_path):
    with gateway(upstream.url, tmp_path) as (url, store):
        assert _chat(url).status_code == 200
        pages = store._conn.execute("PRAGMA page_count").fetchone()[0]
        _on_write_connections(store, f"PRAGMA max_page_count = {pages}")
        reply = _chat(url, BIG, stream=True)  # not degraded yet: the stream starts, its record fails
        assert reply.status_code == 200
        events = [line.removeprefix("data: ") for line in reply.text.splitlines() if line.startswith("data: ")]
        assert "[DONE]" not in events
        assert '"store_full"' in events[-1]
        assert reply.headers["x-request-id"] not in _recorded(store)
        _on_write_connections(store, "PRAGMA max_page_count = 1073741823")
        _assert_healthy(url)


def test_read_only_store_answers_503_and_recovers(upstream, tmp_path):
    with gateway(upstream.url, tmp_path) as (url, store):
        assert _chat(url).status_code == 200
        _on_write_connections(store, "PRAGMA query_only = ON")  # writes now fail as on a read-only file
        reply = _chat(url)
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        assert error["code"] == "store_read_only" and "read-only" in error["message"]
        assert "writable" in error["message"]
        reward = httpx.post(url + "/v1/sessions/s1/reward", json={"reward": 1.0})
        assert reward.status_code == 503 and reward.json()["error"]["code"] == "store_read_only"
        assert httpx.get(url + "/healthz").json()["store"]["cause"] == "read_only"
        _on_write_connections(store, "PRAGMA query_only = OFF")
        _assert_healthy(url)
        assert _chat(url).status_code == 200
        assert httpx.post(url + "/v1/sessions/s1/reward", json={"reward": 1.0}).status_code == 200


HOLD_LOCK = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.readline()
db.execute("ROLLBACK")
"""


def test_store_locked_by_another_process_answers_503_and_recovers(upstream, tmp_path):
    with gateway(upstream.url, tmp_path, busy_timeout=0.3) as (url, store):
        assert _chat(url).status_code == 200
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLD_LOCK, str(store.path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            assert holder.stdout.readline().strip() == "locked"
            reply = _chat(url)
            assert reply.status_code == 503, reply.text
            error = reply.json()["error"]
            assert error["code"] == "store_locked" and "another process" in error["message"]
            health = httpx.get(url + "/healthz")
            assert health.status_code == 503 and health.json()["store"]["cause"] == "locked"
        finally:
            holder.communicate("\n", timeout=30)
        _assert_healthy(url)
        assert _chat(url).status_code == 200


def test_a_store_file_moved_or_deleted_under_the_gateway_is_refused_not_acknowledged(upstream, tmp_path):
    # SQLite writes on to a file deleted (or moved) under it: every call and reward was answered
    # 200 into the deleted file, then lost when the gateway stopped; /healthz said ok.
    with gateway(upstream.url, tmp_path) as (url, store):
        acknowledged = {_chat(url).headers["x-request-id"]}
        away = store.path.with_name("moved-away.db")
        store.path.rename(away)
        reply = _chat(url)
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        assert error["code"] == "store_moved" and str(store.path) in error["message"]
        assert "deleted, moved or replaced" in error["message"]
        reward = httpx.post(url + "/v1/sessions/s1/reward", json={"reward": 1.0})
        assert reward.status_code == 503 and reward.json()["error"]["code"] == "store_moved", reward.text
        health = httpx.get(url + "/healthz")
        assert health.status_code == 503 and health.json()["store"]["cause"] == "moved"

        away.rename(store.path)  # put back: the gateway carries on by itself
        _assert_healthy(url)
        reply = _chat(url)
        assert reply.status_code == 200, reply.text
        acknowledged.add(reply.headers["x-request-id"])
        assert httpx.post(url + "/v1/sessions/s1/reward", json={"reward": 1.0}).status_code == 200
        assert acknowledged <= _recorded(store)

        store.path.unlink()  # deleted for good: refused, never answered 200 into the deleted file
        assert _chat(url).status_code == 503
    assert not store.path.exists()


def test_an_app_given_an_open_store_leaves_its_wal_alone_when_another_process_closes_the_store(upstream, tmp_path):
    # create_app(settings, store=...) made the state dir private after the store was open, reading the
    # database's header to check it: closing that descriptor dropped every POSIX lock of this process
    # on the file, SQLite's too, and the next process to close the store (a sqlite3 shell, the
    # trainer, an export) deleted the WAL under the open store, which then wrote into the deleted file.
    with gateway(upstream.url, tmp_path) as (url, store):
        assert _chat(url).status_code == 200
        wal = os.stat(f"{store.path}-wal").st_ino
        subprocess.run(
            [sys.executable, "-c", HOLD_LOCK, str(store.path)], input="\n", text=True, check=True, capture_output=True
        )
        assert os.stat(f"{store.path}-wal").st_ino == wal
        reply = _chat(url, session="s2")
        assert reply.status_code == 200, reply.text


def test_a_wal_deleted_under_the_gateway_is_refused_and_what_it_held_is_saved_into_the_database(upstream, tmp_path):
    # `rm rlproxy.db-wal` (a clean-up of "temporary" files): SQLite wrote on into the deleted WAL,
    # every call was answered 200, and at the next crash they were gone with every call since the
    # last checkpoint, acknowledged before the deletion too.
    with gateway(upstream.url, tmp_path) as (url, store):
        acknowledged = _chat(url).headers["x-request-id"]
        Path(f"{store.path}-wal").unlink()
        reply = _chat(url, session="s2")
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        assert error["code"] == "store_moved" and f"{store.path}-wal" in error["message"]
        assert httpx.get(url + "/healthz").json()["store"]["cause"] == "moved"

        # The database file alone (as a crash leaves it, the WAL gone) holds the acknowledged call.
        alone = tmp_path / "alone.db"
        alone.write_bytes(store.path.read_bytes())
        with contextlib.closing(sqlite3.connect(alone)) as db:
            assert db.execute("SELECT id FROM calls").fetchall() == [(acknowledged,)]


def test_a_wal_grown_behind_a_long_read_is_cut_back_once_it_is_checkpointed(tmp_path, monkeypatch):
    # A read held open (an export, a backup, a sqlite3 shell in BEGIN) keeps checkpoints from
    # copying the WAL back, so it grows; SQLite then reuses the file but never shrinks it: its
    # gigabytes stayed on disk for as long as the gateway ran.
    from gateway.store import sqlite_schema
    from gateway.store.rows import CallRecord

    monkeypatch.setattr(sqlite_schema, "WAL_SIZE_LIMIT", 1 << 20, raising=False)
    store = SQLiteStore(tmp_path / "rlproxy.db")
    wal = Path(f"{store.path}-wal")

    def record(i: int) -> None:
        request = {"messages": [{"role": "user", "content": f"{i} {BIG}"}]}
        store.record_call_sync(
            CallRecord(f"c{i}", f"s{i}", None, "train", "agent", None, None, "openai", False, "ok", request, {}, 1.0)
        )

    try:
        reader = sqlite3.connect(store.path, isolation_level=None)
        reader.execute("BEGIN")
        reader.execute("SELECT COUNT(*) FROM calls").fetchone()  # the long read starts
        for i in range(40):
            record(i)
        store._checkpoint()  # held back: the reader still needs the WAL
        assert wal.stat().st_size > 4 << 20
        reader.execute("ROLLBACK")
        reader.close()

        store._checkpoint()  # everything copied back: the next write starts the WAL over
        record(40)
        assert wal.stat().st_size <= 1 << 20
        assert len(_recorded(store)) == 41
    finally:
        asyncio.run(store.close())


def test_a_store_that_cannot_be_opened_is_one_line_naming_the_file_and_the_cause(tmp_path, capsys):
    # A damaged file, or one another process keeps locked, ended every command (serve, train,
    # export) in a sqlite3 traceback.
    from gateway.cli import main

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "rlproxy.db").write_bytes(b"not a database, " * 512)
    assert main(["export", "--state-dir", str(damaged)]) == 2
    err = capsys.readouterr().err
    assert f"cannot open the store {damaged / 'rlproxy.db'}: the store file is damaged" in err
    assert "Restore it from a backup" in err and "Traceback" not in err

    path = tmp_path / "locked.db"
    asyncio.run(SQLiteStore(path).close())  # a store, as a gateway left it
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(StoreUnavailable) as refused:
            SQLiteStore(path, busy_timeout=0.2)
        assert refused.value.cause == "locked" and "another process" in refused.value.message
    finally:
        holder.communicate("\n", timeout=30)


def test_a_store_that_cannot_be_opened_says_to_run_the_command_again(tmp_path):
    # The command stops there: the message promised it would recover by itself, no restart needed.
    asyncio.run(SQLiteStore(tmp_path / "rlproxy.db").close())
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path / "rlproxy.db")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(StoreUnavailable) as refused:
            SQLiteStore(tmp_path / "rlproxy.db", busy_timeout=0.2)
    finally:
        holder.communicate("\n", timeout=30)
    message = refused.value.message
    assert "another process" in message and "run the command again" in message
    assert "recovers by itself" not in message and "no restart needed" not in message


def test_classify_names_each_cause():
    def error(code: int, text: str) -> sqlite3.OperationalError:
        exc = sqlite3.OperationalError(text)
        exc.sqlite_errorcode, exc.sqlite_errorname = code, "SQLITE_X"
        return exc

    assert isinstance(classify(error(13, "database or disk is full")), StoreFull)
    assert classify(error(8, "attempt to write a readonly database")).cause == "read_only"
    assert classify(error(5, "database is locked")).cause == "locked"
    assert classify(error(10 | (3 << 8), "disk I/O error")).cause == "unavailable"  # SQLITE_IOERR_WRITE
    assert classify(error(14, "unable to open database file")).cause == "unavailable"
    assert classify(error(11, "database disk image is malformed")).cause == "damaged"
    assert classify(sqlite3.IntegrityError("UNIQUE constraint failed")) is None  # a bug, not the disk
    assert classify(ValueError("x")) is None
    assert all(isinstance(classify(error(c, "x")), StoreUnavailable) for c in (13, 8, 5, 6, 10, 14, 11, 26))


# ---------------------------------------------------------------- a real small disk


@contextlib.contextmanager
def small_tmpfs(size_mb: int):
    """A tmpfs of `size_mb` MB (needs root and the right to mount; skips otherwise)."""
    mount_point = Path(tempfile.mkdtemp(prefix="rlproxy-tmpfs-"))
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(mount_point)], capture_output=True
    )
    if done.returncode != 0:
        mount_point.rmdir()
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); the page-limit test covers it")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
        mount_point.rmdir()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_state_dir_on_a_read_only_disk_is_one_line_naming_the_file(capsys):
    # An existing state dir with no store yet, on a read-only disk (or a directory of another
    # user's): `serve` and `train` ended in an OSError traceback from creating the file.
    from gateway.cli import main

    with small_tmpfs(1) as disk:
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        assert main(["train", "--state-dir", str(disk), "--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"cannot create the store {disk / 'rlproxy.db'} (Read-only file system)" in err, err
    assert "Traceback" not in err


def _fill(directory: Path) -> Path:
    filler = directory / "filler"
    # Unbuffered: a buffered file would try its unwritten rest again on close, and fail there.
    with open(filler, "wb", buffering=0) as out:
        with contextlib.suppress(OSError):
            while True:
                out.write(b"\0" * 65536)
    return filler


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_full_tmpfs_answers_507_and_recovers_when_space_is_freed(upstream):
    with small_tmpfs(8) as disk, gateway(upstream.url, disk / "state") as (url, store):
        acknowledged = set()
        for _ in range(3):
            reply = _chat(url, "warm up")
            assert reply.status_code == 200
            acknowledged.add(reply.headers["x-request-id"])
        filler = _fill(disk)
        statuses = []
        for _ in range(40):  # the WAL has some room left from before; calls fill it
            reply = _chat(url, BIG)
            statuses.append(reply.status_code)
            if reply.status_code == 200:
                acknowledged.add(reply.headers["x-request-id"])
            else:
                break
        assert statuses[-1] == 507, statuses
        assert reply.json()["error"]["code"] == "store_full"
        assert httpx.get(url + "/healthz").json()["status"] == "degraded"
        assert _chat(url).status_code == 507

        filler.unlink()  # space is back
        _assert_healthy(url)
        reply = _chat(url, BIG)
        assert reply.status_code == 200
        acknowledged.add(reply.headers["x-request-id"])
        assert acknowledged <= _recorded(store)


# ---------------------------------------------------------------- the trainer


def _worker_with_two_groups(tmp_path):
    """A started trainer worker (the tiny model, CPU) and two ready groups, g1 and g2."""
    from tests.helpers_trainer import Recorder, trainer_settings
    from trainer.worker import TrainerWorker

    settings = trainer_settings(tmp_path)
    recorder = Recorder(settings)
    recorder.group("g1", [1.0, 0.0])
    recorder.group("g2", [0.0, 1.0])
    recorder.close()
    worker = TrainerWorker(settings)
    worker.start()
    return settings, worker


def _run_until_step_one(worker, meanwhile=None) -> None:
    """The worker on a thread of its own until it recorded steps 0 and 1 (a hang guard bounds it);
    `meanwhile(stop)` runs first, as the worker goes on."""
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        if meanwhile is not None:
            meanwhile(stop)
        for _ in range(600):
            if [s["step"] for s in worker.store.steps("agent")] == [0, 1]:
                break
            stop.wait(0.1)
    finally:
        stop.set()
        thread.join(timeout=120)
        worker.close()


def test_trainer_waits_for_a_failing_store_and_records_its_step_once_it_is_back(tmp_path):
    """The store fails while the worker looks for groups, then again as it records a step
    (its checkpoint saved): it waits, then records that step from its checkpoint, once."""
    settings, worker = _worker_with_two_groups(tmp_path)
    failures = {"ready_groups": 2, "insert_step": 1}

    def failing(name):
        real = getattr(worker.store, name)

        def method(*args, **kwargs):
            if failures[name] > 0:
                failures[name] -= 1
                raise StoreFull("the disk is full (test)", cause="full")
            return real(*args, **kwargs)

        return method

    worker.store.ready_groups = failing("ready_groups")
    worker.store.insert_step = failing("insert_step")
    _run_until_step_one(worker)
    store = SQLiteStore(settings.db_path)
    assert failures == {"ready_groups": 0, "insert_step": 0}
    steps = store.steps("agent")
    assert [s["step"] for s in steps] == [0, 1] and sorted(steps[1]["groups"]) == ["g1", "g2"]
    assert {store.get_group(g)["trained_step"] for g in ("g1", "g2")} == {1}
    assert sorted(p.name for p in settings.checkpoints_dir().iterdir() if p.is_dir()) == ["0000", "0001"]


def test_a_trainer_whose_store_came_back_is_no_longer_degraded_and_reloaded_nothing_while_it_waited(tmp_path, caplog):
    # Only a probe ends the degraded state, and the trainer never made one: its store stayed
    # degraded for good (no "recovered" in its log; on PostgreSQL each connection then waited 2 s at
    # most), and each look while it waited reloaded the checkpoint and said so, once a second.
    settings, worker = _worker_with_two_groups(tmp_path)
    caplog.set_level(logging.INFO)
    worker.store._conn.execute("PRAGMA query_only = 1")  # the trainer's store refuses writes (read-only)

    def fail_then_come_back(stop: threading.Event) -> None:
        for _ in range(600):  # the trainer looked at the store three times, in vain (a hang guard bounds it)
            if worker.store.health.errors["read_only"] >= 3:
                break
            stop.wait(0.1)
        assert worker.store.health.degraded
        worker.store._conn.execute("PRAGMA query_only = 0")  # writable again

    _run_until_step_one(worker, fail_then_come_back)
    assert [s["step"] for s in SQLiteStore(settings.db_path).steps("agent")] == [0, 1]
    assert not worker.store.health.degraded and worker.store.health.report() == {"status": "ok"}
    said = [r.getMessage() for r in caplog.records]
    assert sum("store recovered after" in m for m in said) == 1
    assert sum("waits for the store" in m for m in said) == 1
    assert sum("resumed from checkpoint" in m for m in said) == 1  # once it was back, not at every look


class _StallingStore(SQLiteStore):
    """Reads that hang, then fail, as they do with PostgreSQL gone (the pool waits for a
    connection until its timeout, 30 s): while `stall` is set each read waits for `release`,
    then raises a disk I/O error."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.stall, self.stalled, self.release = threading.Event(), threading.Event(), threading.Event()

    def _query(self, sql: str, params: tuple | dict = ()) -> list[dict]:
        if self.stall.is_set():
            self.stalled.set()
            self.release.wait(60)
            failure = sqlite3.OperationalError("disk I/O error")
            self._raise_failure(failure)  # as the store's own reads do: StoreUnavailable, noted in its health
            raise failure
        return super()._query(sql, params)


def test_a_read_the_store_does_not_answer_holds_up_no_other_request(upstream, tmp_path):
    # The routes read the store on the event loop: one GET /v1/sessions (or a dashboard poll,
    # a /metrics scrape) with PostgreSQL gone froze every request, chat and /healthz too, until
    # the pool gave up; and /metrics then failed, hiding rlproxy_store_degraded.
    settings = Settings(engine="openai", upstream_url=upstream.url, state_dir=tmp_path, trainer="off")
    store = _StallingStore(settings.db_path)
    with ThreadServer(create_app(settings, store=store)) as server:
        url = server.url
        assert _chat(url).status_code == 200
        store.stall.set()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            listing = pool.submit(httpx.get, url + "/v1/sessions", timeout=120)
            assert store.stalled.wait(60)
            try:  # while that read hangs, the gateway serves
                assert httpx.get(url + "/healthz", timeout=30).status_code == 200
                assert _chat(url, "meanwhile").status_code == 200
            finally:
                store.release.set()
            reply = listing.result()
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["code"] == "store_unavailable"

        scrape = httpx.get(url + "/metrics")  # reads still fail: the scrape says so
        assert scrape.status_code == 200, scrape.text
        assert _metric(url, "rlproxy_store_degraded ") == 1
        assert _metric(url, 'rlproxy_store_errors_total{cause="unavailable"}') >= 1

        store.stall.clear()  # the store is back
        _assert_healthy(url)
        assert httpx.get(url + "/v1/sessions").status_code == 200
        assert _metric(url, "rlproxy_store_degraded ") == 0


class _HangingStore(SQLiteStore):
    """Writes that hang, as on a PostgreSQL server that froze (or a disk that stopped answering):
    while `hang` is set, the writer's round waits for `release`. Every write goes through the
    writer thread, as PostgreSQL's do."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, busy_timeout=0.5)
        self._writes_on_loop = False
        self.hang, self.hanging, self.release = threading.Event(), threading.Event(), threading.Event()

    def _apply_batch(self, ops):
        if self.hang.is_set():
            self.hanging.set()
            self.release.wait(120)
        return super()._apply_batch(ops)


def test_a_write_the_database_does_not_answer_degrades_the_store_and_refuses_what_comes_after(upstream, tmp_path):
    # A frozen PostgreSQL: the call being recorded hung, and every call and reward after it queued
    # behind it for as long as the server stayed frozen, while /healthz answered ok.
    settings = Settings(engine="openai", upstream_url=upstream.url, state_dir=tmp_path, trainer="off")
    store = _HangingStore(settings.db_path)
    with ThreadServer(create_app(settings, store=store)) as server, concurrent.futures.ThreadPoolExecutor(1) as pool:
        url = server.url
        acknowledged = {_chat(url).headers["x-request-id"]}
        store.hang.set()
        held = pool.submit(_chat, url, "held", session="held")
        assert store.hanging.wait(60)
        time.sleep(2 * store.busy_timeout)  # the round outlives the store's timeout

        health = httpx.get(url + "/healthz")
        assert health.status_code == 503 and health.json()["status"] == "degraded", health.text
        assert "without an answer" in health.json()["reason"]
        sent_before = len(upstream.chat_requests())
        reply = _chat(url, session="other")
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "store_unavailable", reply.text
        assert len(upstream.chat_requests()) == sent_before  # refused before any engine work
        reward = httpx.post(url + "/v1/sessions/s1/reward", json={"reward": 1.0})
        assert reward.status_code == 503, reward.text

        store.hang.clear()
        store.release.set()  # the database answers again: the held call lands, the store recovers
        reply = held.result()
        assert reply.status_code == 200, reply.text
        acknowledged.add(reply.headers["x-request-id"])
        _assert_healthy(url)
        reply = _chat(url, session="other")
        assert reply.status_code == 200, reply.text
        acknowledged.add(reply.headers["x-request-id"])
        assert acknowledged <= _recorded(store)


# ---------------------------------------------------------------- PostgreSQL


def test_postgres_gone_read_only_answers_503_and_recovers_by_itself(upstream, tmp_path, postgres_url, postgres_db):
    """The database fails over to a read-only server (and drops every connection): calls get
    503 store_read_only, /healthz says degraded; once it takes writes again the gateway
    recovers without a restart, on fresh connections."""
    import re

    import psycopg

    from gateway.store.postgres import PostgresStore

    name = re.match(r"postgres(?:ql)?://[^/]*/([^?]*)", postgres_db).group(1)

    def admin(sql: str) -> None:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(sql)

    def drop_connections() -> None:
        admin(
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'"
            " AND pid <> pg_backend_pid()"
        )

    settings = Settings(engine="openai", upstream_url=upstream.url, state_dir=tmp_path, trainer="off")
    store = PostgresStore(postgres_db)
    with ThreadServer(create_app(settings, store=store)) as server:
        url = server.url
        acknowledged = {_chat(url).headers["x-request-id"]}

        admin(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
        drop_connections()
        reply = _chat(url)
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        assert error["code"] == "store_read_only" and "primary" in error["message"]
        health = httpx.get(url + "/healthz")
        assert health.status_code == 503 and health.json()["status"] == "degraded"

        admin(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')
        drop_connections()  # the read-only setting sticks to open sessions: new ones see it gone
        _assert_healthy(url)
        reply = _chat(url)
        assert reply.status_code == 200, reply.text
        acknowledged.add(reply.headers["x-request-id"])
        assert acknowledged <= _recorded(store)


def test_postgres_gone_answers_503_promptly_and_recovers_by_itself(upstream, tmp_path, postgres_url, postgres_db):
    """The database stops taking connections (a restart, a failover under way): once a call has
    found it gone, calls and /healthz answer 503 as a client or a balancer's health check with a
    10 s timeout sees it, not after the pool's whole wait each, in turn (they hung for a minute);
    once it takes connections again the gateway recovers by itself and lost nothing acknowledged."""
    import re

    import psycopg

    from gateway.store.postgres import PostgresStore

    name = re.match(r"postgres(?:ql)?://[^/]*/([^?]*)", postgres_db).group(1)

    def admin(sql: str) -> None:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(sql)

    settings = Settings(engine="openai", upstream_url=upstream.url, state_dir=tmp_path, trainer="off")
    store = PostgresStore(postgres_db, timeout=15)
    with ThreadServer(create_app(settings, store=store)) as server:
        url = server.url
        acknowledged = {_chat(url).headers["x-request-id"]}

        admin(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        admin(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'")
        first = _chat(url)  # finds the server gone (after the pool's wait for a connection)
        assert first.status_code == 503 and first.json()["error"]["code"] == "store_unavailable", first.text
        for _ in range(3):
            health = httpx.get(url + "/healthz", timeout=10)
            assert health.status_code == 503 and health.json()["status"] == "degraded"
            body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
            reply = httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "s2"}, timeout=10)
            assert reply.status_code == 503 and reply.json()["error"]["code"] == "store_unavailable", reply.text

        admin(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        for _ in range(120):  # the pool reconnects by itself
            if httpx.get(url + "/healthz", timeout=10).status_code == 200:
                break
            time.sleep(0.5)
        _assert_healthy(url)
        reply = _chat(url)
        assert reply.status_code == 200, reply.text
        acknowledged.add(reply.headers["x-request-id"])
        assert acknowledged <= _recorded(store)


def test_postgres_row_held_by_another_session_answers_503_locked_and_stalls_nothing_for_ever(
    upstream, tmp_path, postgres_db
):
    """A psql session left in `BEGIN; UPDATE sessions ...` holds a row the gateway writes: PostgreSQL
    waits for a lock for ever by default, so that session's call hung, and with it every call and
    reward of the gateway (they share one writer), while /healthz said ok. Now the store waits its
    timeout, as SQLite's busy timeout, then answers 503 store_locked; the rest carries on."""
    import psycopg

    from gateway.store.postgres import PostgresStore

    settings = Settings(engine="openai", upstream_url=upstream.url, state_dir=tmp_path, trainer="off")
    store = PostgresStore(postgres_db, timeout=2)
    with ThreadServer(create_app(settings, store=store)) as server:
        url = server.url
        acknowledged = {_chat(url, session="held").headers["x-request-id"]}
        with psycopg.connect(postgres_db) as psql:  # not autocommit: the UPDATE's row lock stays held
            psql.execute("UPDATE sessions SET updated_at = updated_at WHERE id = 'held'")
            reply = _chat(url, session="held")
            assert reply.status_code == 503, reply.text
            error = reply.json()["error"]
            assert error["code"] == "store_locked" and "another session" in error["message"]
            assert "pg_stat_activity" in error["message"]
            assert reply.headers["x-request-id"] not in _recorded(store)
            reward = httpx.post(url + "/v1/sessions/held/reward", json={"reward": 1.0}, timeout=60)
            assert reward.status_code == 503 and reward.json()["error"]["code"] == "store_locked", reward.text

            other = _chat(url, session="other")  # a session whose rows are free is served meanwhile
            assert other.status_code == 200, other.text
            acknowledged.add(other.headers["x-request-id"])
            psql.rollback()
        reply = _chat(url, session="held")
        assert reply.status_code == 200, reply.text
        acknowledged.add(reply.headers["x-request-id"])
        assert httpx.post(url + "/v1/sessions/held/reward", json={"reward": 1.0}).status_code == 200
        _assert_healthy(url)
        assert acknowledged <= _recorded(store)
        assert store.get_session("held")["reward"] == 1.0


def test_a_checkpoint_disk_that_is_full_sets_no_group_aside_and_the_step_lands_once_it_has_room(tmp_path):
    # A checkpoint write failing (ENOSPC) counted as the batch's fault: bisected, retried, and
    # after the attempt limit every group was set aside as failed for good, rewards and all.
    import errno

    settings, worker = _worker_with_two_groups(tmp_path)
    backend, real_save, full = worker.backend, worker.backend.save, {"saves": 8}

    def save(directory):
        if full["saves"] > 0:
            full["saves"] -= 1
            (directory / "adapter_model.safetensors").write_bytes(b"half")  # the disk filled up half-way
            raise OSError(errno.ENOSPC, "No space left on device", str(directory))
        real_save(directory)

    backend.save = save
    _run_until_step_one(worker)
    store = SQLiteStore(settings.db_path)
    assert full["saves"] == 0
    groups = [store.get_group(g) for g in ("g1", "g2")]
    assert [(g["failed"], g["trained_step"]) for g in groups] == [(None, 1), (None, 1)]
    assert sorted(store.steps("agent")[1]["groups"]) == ["g1", "g2"]
    assert sorted(p.name for p in settings.checkpoints_dir().iterdir()) == [".worker.lock", "0000", "0001"]
