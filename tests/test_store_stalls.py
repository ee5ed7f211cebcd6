"""A store that stops answering (a disk in an NFS stall, a frozen PostgreSQL) under a running
gateway: the event loop is never the one left waiting, reads and shutdown are bounded by the
store's timeout, and what could not be written is refused or said, never acknowledged."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from gateway.app import create_app
from gateway.errors import StoreUnavailable
from gateway.settings import Settings
from gateway.store import writer
from gateway.store.health import StoreHealth
from gateway.store.sqlite import SQLiteStore
from gateway.store.waits import READ_THREADS, read_within
from tests.helpers import ThreadServer, gateway_process


def _chat(url: str, text: str = "hello", *, session: str = "s1") -> httpx.Response:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": text}]}
    return httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Session-Id": session}, timeout=120)


class _Disk:
    """A connection whose COMMIT stalls as on a disk that stops answering: `slow` seconds each, and
    while `hang` is set until `release` (everything else goes to the real connection)."""

    def __init__(self, conn, disk: _StallingDisk) -> None:
        self._conn, self._disk = conn, disk

    def execute(self, sql: str, *args):
        if sql == "COMMIT":
            self._disk.commit_waits()
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str):
        return getattr(self._conn, name)


class _StallingDisk:
    def __init__(self, store: SQLiteStore) -> None:
        self.slow = 0.0
        self.hang, self.hanging, self.release = threading.Event(), threading.Event(), threading.Event()
        store._conn = _Disk(store._conn, self)
        store._loop_conn = _Disk(store._loop_conn, self)

    def commit_waits(self) -> None:
        time.sleep(self.slow)
        if self.hang.is_set():
            self.hanging.set()
            self.release.wait(120)


def _gateway(upstream_url: str, state_dir: Path, **store_kwargs):
    settings = Settings(engine="openai", upstream_url=upstream_url, state_dir=state_dir, trainer="off")
    store = SQLiteStore(settings.db_path, **store_kwargs)
    return ThreadServer(create_app(settings, store=store)), store


def test_after_a_slow_commit_a_stalled_disk_no_longer_freezes_the_gateway(upstream, tmp_path):
    # A call recorded while no other was in flight was committed on the event loop itself: with the
    # disk stalled (an NFS hiccup), every request, /healthz too, froze for as long as the stall.
    # A commit that was slow sends the writes after it to the writer thread for a while.
    server, store = _gateway(upstream.url, tmp_path)
    with server, concurrent.futures.ThreadPoolExecutor(1) as pool:
        url = server.url
        assert _chat(url).status_code == 200  # on the loop: the disk is fast
        disk = _StallingDisk(store)
        disk.slow = 2 * writer.SLOW_COMMIT  # the disk starts to lag
        acknowledged = {_chat(url).headers["x-request-id"]}
        disk.slow = 0.0
        disk.hang.set()  # then stops answering
        held = pool.submit(_chat, url, "held", session="held")
        assert disk.hanging.wait(60)
        try:  # while the commit hangs, the gateway answers
            health = httpx.get(url + "/healthz", timeout=30)
            assert health.status_code == 200, health.text
        finally:
            disk.hang.clear()
            disk.release.set()
        reply = held.result()
        assert reply.status_code == 200, reply.text
        acknowledged.add(reply.headers["x-request-id"])
        recorded = {row["id"] for row in store._query("SELECT id FROM calls")}
        assert acknowledged <= recorded


def test_a_shutdown_with_a_write_the_disk_never_answers_ends_and_logs_what_was_not_recorded(upstream, tmp_path, caplog):
    # Shutdown waited for ever on a round the disk (or a frozen PostgreSQL) held: the lifespan's own
    # writes (the heartbeat row, RULER's verdicts) queued behind it, then the writer's join.
    server, store = _gateway(upstream.url, tmp_path, busy_timeout=1.0)
    server.__enter__()
    try:
        acknowledged = _chat(server.url).headers["x-request-id"]
        disk = _StallingDisk(store)
        disk.hang.set()
        # A write no client waits on (a RULER verdict, a heartbeat), made on the gateway's loop.
        loop = store._writer._loop
        background = asyncio.run_coroutine_threadsafe(store.set_reward("s1", 1.0), loop)
        assert disk.hanging.wait(60)
        with caplog.at_level(logging.ERROR, logger="rlproxy.store"):
            server.server.should_exit = True
            server.thread.join(120)
            assert not server.thread.is_alive(), "the shutdown waits for ever on the hung write"
        with pytest.raises(StoreUnavailable, match="did not answer"):
            background.result(0)
        assert "never answered" in caplog.text and "NOT recorded" in caplog.text
    finally:
        disk.hang.clear()
        disk.release.set()
        server.thread.join(60)
    reopened = SQLiteStore(store.path)
    try:
        assert reopened.get_call(acknowledged) is not None  # what was acknowledged is kept
    finally:
        reopened._close_connections()


def test_a_read_on_a_frozen_postgres_answers_503_within_the_stores_timeout(
    upstream, tmp_path, postgres_url, postgres_db
):
    # PostgreSQL frozen (SIGSTOP of its backends: a host swapping, a VM paused): GET /v1/sessions and the
    # dashboard's polls hung in a worker thread until the server answered, each holding a thread of the
    # default executor, which everything that reads the store shares. Now the store's timeout bounds a
    # read as it bounds a write: 503 store_unavailable in the OpenAI error shape, and the store recovers.
    import re

    import psycopg

    from gateway.store.postgres import PostgresStore

    settings = Settings(engine="openai", upstream_url=upstream.url, state_dir=tmp_path, trainer="off")
    store = PostgresStore(postgres_db, timeout=2)
    name = re.match(r"postgres(?:ql)?://[^/]*/([^?]*)", postgres_db).group(1)
    with ThreadServer(create_app(settings, store=store)) as server:
        url = server.url
        assert _chat(url).status_code == 200
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            found = admin.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", (name,)).fetchall()
        backends = [pid for (pid,) in found]
        assert backends
        for pid in backends:
            os.kill(pid, signal.SIGSTOP)
        try:
            reply = httpx.get(url + "/v1/sessions", timeout=60)
            assert reply.status_code == 503, reply.text
            assert reply.json()["error"]["code"] == "store_unavailable"
            assert "the database" in reply.json()["error"]["message"] or "PostgreSQL" in reply.text
        finally:
            for pid in backends:
                os.kill(pid, signal.SIGCONT)
        for _ in range(120):  # the pool replaces the connections that were cut
            if httpx.get(url + "/healthz", timeout=30).status_code == 200:
                break
            time.sleep(0.5)
        listing = httpx.get(url + "/v1/sessions", timeout=30)
        assert listing.status_code == 200, listing.text
        assert [s["id"] for s in listing.json()["data"]] == ["s1"]


def test_a_postgres_read_that_gets_no_answer_is_cut_at_the_stores_timeout_and_the_next_one_works(postgres_db):
    from gateway.store.postgres import PostgresStore

    store = PostgresStore(postgres_db, timeout=1)
    try:
        with pytest.raises(StoreUnavailable, match="a read has waited 1 s for the database without an answer"):
            store._query("SELECT pg_sleep(30)")  # as long as a frozen server: no answer in time
        assert store.health.degraded
        assert store._query("SELECT 1 AS one") == [{"one": 1}]  # on a fresh connection
        with pytest.raises(StoreUnavailable, match="without an answer"):
            with store._snapshot() as read:  # the reads of GET /v1/sessions/{id}
                read("SELECT pg_sleep(30)", ())
    finally:
        store._close_connections()


def test_sigterm_with_a_call_whose_write_the_disk_never_answers_ends_the_gateway(upstream, tmp_path):
    # uvicorn waits for every request before the lifespan's shutdown: a call whose write a stalled disk
    # held kept `kill PID` (systemd's stop, `docker stop` until its SIGKILL) waiting for ever. Now that
    # call is answered 503 once the write has waited twice the store's timeout, and the log says so.
    hang = tmp_path / "disk-hangs"
    code = (
        "import os, time; from gateway.store import sqlite as s; init, commit = s.SQLiteStore.__init__, "
        "s.SQLiteStore._commit\n"
        "def __init__(self, *a, **k):\n    init(self, *a, **{**k, 'busy_timeout': 1.0})\n"
        f"def _commit(self, conn):\n    while os.path.exists({str(hang)!r}): time.sleep(0.05)\n"
        "    commit(self, conn)\n"
        "s.SQLiteStore.__init__, s.SQLiteStore._commit = __init__, _commit\n"
        "s.SQLiteStore._write_now = lambda self, op: None\n"  # through the writer thread (see the first test)
        "from gateway.cli import run; run()"
    )
    flags = ["--engine", "openai", "--upstream-url", upstream.url, "--trainer", "off", "--state-dir", str(tmp_path)]
    with (
        gateway_process(flags, python_args=("-c", code)) as (proc, url),
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        acknowledged = _chat(url).headers["x-request-id"]
        sent = len(upstream.chat_requests())
        hang.touch()
        held = pool.submit(_chat, url, "held", session="held")
        for _ in range(600):  # until the upstream answered it: its write follows, and hangs
            if len(upstream.chat_requests()) == sent + 1:
                break
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        try:
            assert proc.wait(timeout=120) == 0
        finally:
            hang.unlink()
        reply = held.result()
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "store_unavailable", reply.text
        log = proc.stdout.read().decode(errors="replace")
        assert "NOT recorded" in log and reply.headers["x-request-id"] in log
    store = SQLiteStore(tmp_path / "rlproxy.db")
    try:
        assert store.get_call(acknowledged) is not None
    finally:
        store._close_connections()


def test_a_reward_whose_write_a_frozen_postgres_never_answers_is_a_503_and_the_gateway_recovers(
    upstream, tmp_path, postgres_db, monkeypatch
):
    # PostgreSQL froze (SIGSTOP: a host swapping, a VM paused) while a reward's transaction was under
    # way: its socket stayed open (the server's kernel answers TCP), so the writer's round, and the
    # reward POST in it, waited for as long as the server stayed frozen: for ever, with no answer.
    # Now a write waits twice the store's timeout for an answer, then is a 503 store_unavailable in
    # the OpenAI error shape; resumed, the server answers again and the gateway with it, by itself.
    from gateway.store import postgres_conn
    from gateway.store.postgres import PostgresStore

    frozen: list[int] = []
    execute = postgres_conn.PgConn.execute

    def freezing_at_the_reward(conn, sql, params=()):
        if sql.startswith("UPDATE sessions SET reward") and params[0] == 0.5 and not frozen:
            frozen.append(conn._conn.info.backend_pid)  # the server process writing it stops here
            os.kill(frozen[0], signal.SIGSTOP)
        return execute(conn, sql, params)

    settings = Settings(engine="openai", upstream_url=upstream.url, state_dir=tmp_path, trainer="off")
    store = PostgresStore(postgres_db, timeout=1)
    with ThreadServer(create_app(settings, store=store)) as server:
        url = server.url
        acknowledged = {_chat(url, session=s).headers["x-request-id"] for s in ("s1", "s2")}
        assert httpx.post(url + "/v1/sessions/s1/reward", json={"reward": 1.0}).status_code == 200
        monkeypatch.setattr(postgres_conn.PgConn, "execute", freezing_at_the_reward)
        try:
            reply = httpx.post(url + "/v1/sessions/s2/reward", json={"reward": 0.5}, timeout=60)
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        assert frozen, "the reward's write never reached the server"
        assert reply.status_code == 503, reply.text
        error = reply.json()["error"]
        assert error["code"] == "store_unavailable"
        assert "a write has waited 2 s for the database without an answer" in error["message"]
        for _ in range(120):  # the connection that was cut is replaced; a probe ends the degraded state
            if httpx.get(url + "/healthz", timeout=30).status_code == 200:
                break
            time.sleep(0.5)
        again = httpx.post(url + "/v1/sessions/s2/reward", json={"reward": 0.5}, timeout=30)
        assert again.status_code == 200, again.text
        acknowledged.add(_chat(url, session="s3").headers["x-request-id"])
        recorded = {row["id"] for row in store._query("SELECT id FROM calls")}
        rewards = {row["id"]: row["reward"] for row in store._query("SELECT id, reward FROM sessions")}
    assert acknowledged <= recorded
    assert rewards == {"s1": 1.0, "s2": 0.5, "s3": None}


class _HungReads:
    """`store.serving_step` blocks until `release` as a read on a disk that stopped answering does
    (`hanging` counts the reads held); writes are untouched, so a probe write still commits."""

    def __init__(self, store: SQLiteStore) -> None:
        self.release, self.held = threading.Event(), threading.Semaphore(0)
        real = store.serving_step

        def serving_step(model: str):
            self.held.release()
            self.release.wait(120)
            return real(model)

        store.serving_step = serving_step  # type: ignore[method-assign]


def test_a_store_read_the_disk_never_answers_freezes_neither_healthz_metrics_nor_calls(upstream, tmp_path):
    # /healthz (--promote manual: it reads the serving step) and /metrics ran their reads in the loop's
    # default executor with no bound: on a hung disk each poll held a thread and never answered.
    settings = Settings(engine="openai", upstream_url=upstream.url, state_dir=tmp_path, trainer="off", promote="manual")
    store = SQLiteStore(settings.db_path, busy_timeout=1.0)
    hung = _HungReads(store)
    polls = (os.cpu_count() or 1) + 5  # more than the default executor's threads
    try:
        with (
            ThreadServer(create_app(settings, store=store)) as server,
            concurrent.futures.ThreadPoolExecutor(polls) as pool,
        ):
            for health in pool.map(lambda _: httpx.get(server.url + "/healthz", timeout=60), range(polls)):
                assert health.status_code == 503, health.text
                assert health.json()["store"]["cause"] == "unavailable"
                assert "a read has waited" in health.json()["reason"]
            scrape = httpx.get(server.url + "/metrics", timeout=60)
            assert scrape.status_code == 200 and "rlproxy_store_degraded 1" in scrape.text
            assert hung.held.acquire(timeout=0)  # the reads were made, and are still held
            reply = _chat(server.url)  # a call needs no read: its probe write commits, and it answers
            assert reply.status_code == 200, reply.text
            hung.release.set()
            health = httpx.get(server.url + "/healthz", timeout=60)
            assert health.status_code == 200, health.text  # recovers by itself once the disk answers
    finally:
        hung.release.set()


def test_healthz_on_a_degraded_store_whose_probe_write_hangs_answers_within_the_stores_timeout(upstream, tmp_path):
    # Degraded, /healthz probes with a write queued behind the writer's round: with the disk stalled in
    # that round it waited for as long as the stall (check_writer only turns away requests coming later).
    server, store = _gateway(upstream.url, tmp_path, busy_timeout=1.0)
    with server:
        assert _chat(server.url).status_code == 200
        disk = _StallingDisk(store)
        store.health.failed(StoreUnavailable("the disk is full", cause="disk_full"))
        disk.hang.set()
        try:
            health = httpx.get(server.url + "/healthz", timeout=60)
            assert disk.hanging.is_set()  # the probe reached the stalled disk
            assert health.status_code == 503, health.text
            assert "a probe write has waited" in health.json()["reason"]
        finally:
            disk.hang.clear()
            disk.release.set()
        health = httpx.get(server.url + "/healthz", timeout=60)
        assert health.status_code == 200, health.text


def test_a_read_the_disk_never_answers_keeps_no_process_from_exiting():
    # The reads ran in executor threads, which the interpreter joins at exit: a gateway stopped (SIGTERM)
    # while its disk held a read never exited. Here the read never answers at all.
    code = (
        "import asyncio, threading\n"
        "from gateway.errors import StoreUnavailable\n"
        "from gateway.store.health import StoreHealth\n"
        "from gateway.store.waits import read_within\n"
        "class Hung:\n"
        "    busy_timeout, health = 0.2, StoreHealth()\n"
        "try:\n"
        "    asyncio.run(read_within(Hung(), threading.Event().wait))\n"
        "except StoreUnavailable as exc:\n"
        "    print(exc.message)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "a read has waited" in done.stdout


def test_a_listing_whose_read_the_disk_never_answers_is_a_503_and_the_next_one_answers(upstream, tmp_path):
    # GET /v1/sessions (the dashboard's, a step's sessions, a response by id too) waited on its read for
    # as long as the disk held it, in a thread of the loop's default executor held as long.
    settings = Settings(engine="openai", upstream_url=upstream.url, state_dir=tmp_path, trainer="off")
    store = SQLiteStore(settings.db_path, busy_timeout=0.5)
    release, real = threading.Event(), store.list_sessions

    def list_sessions(f):
        release.wait(120)
        return real(f)

    store.list_sessions = list_sessions  # type: ignore[method-assign]
    try:
        with ThreadServer(create_app(settings, store=store)) as server:
            listing = httpx.get(server.url + "/v1/sessions", timeout=60)
            assert listing.status_code == 503, listing.text
            assert listing.json()["error"]["code"] == "store_unavailable"
            assert "a read has waited" in listing.json()["error"]["message"]
            release.set()
            assert _chat(server.url).status_code == 200  # its probe write ends the degraded state
            assert httpx.get(server.url + "/v1/sessions", timeout=60).status_code == 200
    finally:
        release.set()


async def test_with_all_but_one_read_thread_held_by_the_disk_the_next_read_still_answers():
    # Reads held by a hung disk must not keep the next read from a free thread while there is one.
    class Store:
        busy_timeout, health = 30.0, StoreHealth()

    release = threading.Event()
    held = [asyncio.ensure_future(read_within(Store(), release.wait, 120)) for _ in range(READ_THREADS - 1)]
    try:
        for _ in range(3 * READ_THREADS):
            assert await read_within(Store(), lambda: 7) == 7
    finally:
        release.set()
        assert await asyncio.gather(*held) == [True] * (READ_THREADS - 1)
