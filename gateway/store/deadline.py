"""A deadline for a PostgreSQL connection's answer (`answer_within`), kept by one watchdog thread.

libpq waits for ever for a server that stopped answering (frozen, SIGSTOPped, its VM paused):
`statement_timeout` is the server's own, and TCP keepalives are answered by its kernel. Past the
deadline the connection's socket is shut down, so the waiting recv() returns, the statement fails
and the pool drops the connection. One thread for every deadline: a `threading.Timer` each cost a
thread start per read (0.1-0.4 ms here), and the pool checks each connection it hands out.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gateway.store.health import stalled


class _Watchdog:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: dict[int, tuple[float, int, threading.Event]] = {}  # key -> (deadline, socket fd, fired)
        self._keys = 0
        self._wakes_at = math.inf  # when the thread looks next (monotonic)
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float, fd: int) -> tuple[int, threading.Event]:
        fired = threading.Event()
        with self._cond:
            self._keys += 1
            due = time.monotonic() + seconds
            self._due[self._keys] = (due, fd, fired)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rlproxy-store-deadlines", daemon=True)
                self._thread.start()
            if due < self._wakes_at:
                self._cond.notify()
            return self._keys, fired

    def disarm(self, key: int) -> None:
        with self._cond:
            self._due.pop(key, None)

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for key, (due, fd, fired) in list(self._due.items()):
                    if due <= now:
                        del self._due[key]
                        fired.set()
                        _cut(fd)
                self._wakes_at = min((due for due, _, _ in self._due.values()), default=math.inf)
                self._cond.wait(None if self._wakes_at == math.inf else self._wakes_at - now)


def _cut(fd: int) -> None:
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # closed meanwhile
        pass


_WATCHDOG = _Watchdog()


@contextmanager
def answer_within(conn: Any, seconds: float, what: str = "a read") -> Iterator[None]:
    """The statements run inside on `conn` (a psycopg connection) get `seconds` for an answer; past
    that they fail as the store's `stalled` failure (503 store_unavailable). A read on a frozen
    server hung in a worker thread of the default executor, which every read of the gateway
    shares: a few such reads and nothing that reads the store answered."""
    key, fired = _WATCHDOG.arm(seconds, conn.pgconn.socket)
    try:
        yield
    except Exception as exc:
        if fired.is_set():
            raise stalled(seconds, what) from exc
        raise
    finally:
        _WATCHDOG.disarm(key)
