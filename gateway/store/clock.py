"""The one clock that rows compared across hosts are written and compared in.

A gateway's heartbeat row (`gateways.expires_at`) is written by one host and compared by every
other (`gateways.reap`); a trainer's claim row (`group_claims.expires_at`) likewise. Each host's
own `time.time()` made a replica whose clock ran a lease ahead (a minute: NTP off, a VM resumed)
take every live gateway for gone and hand its running judgements on while they still ran (a shadow
group judged twice); one whose clock ran behind was taken for gone by the others at each beat.
On PostgreSQL the database server's clock is the only one every host shares, so those rows are
written and compared in it; SQLite is one machine's file, and that machine's clock is its own.
"""

from __future__ import annotations

import time
from typing import Any


def store_now(conn: Any) -> float:
    """Seconds since the epoch by the store's clock: the database server's on PostgreSQL
    (`PgConn.server_time`), this host's on SQLite."""
    server_time = getattr(conn, "server_time", None)
    return float(server_time()) if server_time is not None else time.time()
