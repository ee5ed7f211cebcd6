"""A COMMIT whose reply never came back: PostgreSQL committed the call, then the connection
dropped before the gateway heard so. The gateway looks for the call's row on a fresh connection
and answers the call, once; a 503 would make the official client send the call again, and it
would be recorded twice."""

from __future__ import annotations

import socket
import threading

import openai
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from gateway.app import create_app
from gateway.settings import Settings
from tests.helpers import ThreadServer, call_row


class CommitReplyLost:
    """A relay in front of PostgreSQL (TCP on loopback) that, once armed, passes one COMMIT on to
    the server and then drops that connection instead of relaying the server's reply."""

    def __init__(self, server_url: str) -> None:
        params = conninfo_to_dict(server_url)
        host, port = params.get("host") or "localhost", int(params.get("port") or 5432)
        if host.startswith("/"):  # a unix socket directory (pgserver's)
            self._target: tuple = (socket.AF_UNIX, f"{host}/.s.PGSQL.{port}")
        else:
            self._target = (socket.AF_INET, (host, port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        params.update(host="127.0.0.1", port=str(self._listener.getsockname()[1]))
        self.url = make_conninfo(**params)
        self._armed = threading.Event()
        self.dropped = threading.Event()  # a COMMIT reached the server and its reply was thrown away
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self) -> None:
        self._armed.set()

    def close(self) -> None:
        self._listener.close()
        for sock in self._sockets:
            _hang_up(sock)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            family, address = self._target
            server = socket.socket(family, socket.SOCK_STREAM)
            server.connect(address)
            self._sockets += [client, server]
            committing = threading.Event()
            threading.Thread(target=self._to_server, args=(client, server, committing), daemon=True).start()
            threading.Thread(target=self._to_client, args=(server, client, committing), daemon=True).start()

    def _to_server(self, client: socket.socket, server: socket.socket, committing: threading.Event) -> None:
        while data := _recv(client):
            if b"COMMIT" in data and self._armed.is_set():
                self._armed.clear()
                committing.set()  # before the server can answer it
            server.sendall(data)
        _hang_up(server)

    def _to_client(self, server: socket.socket, client: socket.socket, committing: threading.Event) -> None:
        while data := _recv(server):
            if committing.is_set():
                self.dropped.set()
                break
            client.sendall(data)
        for sock in (client, server):
            _hang_up(sock)


def _hang_up(sock: socket.socket) -> None:
    """shutdown, not just close: a recv blocked on the socket in the other thread would keep it open."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def _calls_of(url: str, session_id: str) -> int:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT count(*) FROM calls WHERE session_id = %s", (session_id,)).fetchone()[0]


@pytest.mark.parametrize("path", ["group commit", "a write alone"])
def test_a_call_whose_commit_reply_was_lost_is_answered_and_recorded_once(upstream, tmp_path, postgres_db, path):
    from gateway.store.postgres import PostgresStore

    relay = CommitReplyLost(postgres_db)
    store = PostgresStore(relay.url)
    settings = Settings(engine="openai", upstream_url=upstream.url, state_dir=tmp_path, trainer="off")
    try:
        with ThreadServer(create_app(settings, store=store)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=2)
            relay.arm()
            if path == "group commit":
                reply = client.chat.completions.create(
                    model="fake-model",
                    messages=[{"role": "user", "content": "hello"}],
                    extra_headers={"X-Session-Id": "s1"},
                )
                assert reply.choices[0].message.content
            else:
                store.record_call_sync(call_row("c1", "s1", None))
            assert relay.dropped.is_set(), "the COMMIT's reply was not lost: the test proved nothing"
    finally:
        store.close_sync()
        relay.close()
    assert _calls_of(postgres_db, "s1") == 1
