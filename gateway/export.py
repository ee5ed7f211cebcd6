"""Export recorded sessions as JSON lines (one trajectory per line)."""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import sqlite_utils

from gateway.errors import NotFound
from gateway.store import Store


def export_trajectories(db_path: Path, output: str, *, split: str | None = None, only_rewarded: bool = False) -> int:
    if not Path(db_path).exists():
        raise NotFound(f"no store at {db_path}: pass the --state-dir the gateway ran with")
    store = Store(db_path)
    where, params = [], []
    if split:
        where.append("split = ?")
        params.append(split)
    if only_rewarded:
        where.append("reward IS NOT NULL")
    db = sqlite_utils.Database(db_path)
    rows = db["sessions"].rows_where(" AND ".join(where) or None, params, order_by="created_at", select="id")
    out = sys.stdout.buffer if output == "-" else open(output, "wb")
    count = 0
    try:
        for row in rows:
            out.write(orjson.dumps(store.get_session(row["id"]), default=str) + b"\n")
            count += 1
    finally:
        if out is not sys.stdout.buffer:
            out.close()
        store._conn.close()
        store._read_conn.close()
    return count
