"""Export recorded sessions as JSON lines (one trajectory per line)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import orjson

from gateway.errors import NotFound
from gateway.store_open import open_store


def export_trajectories(db_path: Path | str, output: str, *, split: str | None = None,
                        only_rewarded: bool = False) -> int:
    """`db_path`: the SQLite file, or a postgresql:// URL (`--store`)."""
    if "://" not in str(db_path) and not Path(db_path).exists():
        raise NotFound(f"no store at {db_path}: pass the --state-dir (or --store) the gateway ran with")
    store = open_store(db_path)
    where, params = [], []
    if split:
        where.append("split = ?")
        params.append(split)
    if only_rewarded:
        where.append("reward IS NOT NULL")
    sql = "SELECT id FROM sessions" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY created_at, id"
    out = sys.stdout.buffer if output == "-" else open(output, "wb")
    count = 0
    try:
        for row in store._query(sql, tuple(params)):
            out.write(orjson.dumps(store.get_session(row["id"]), default=str) + b"\n")
            count += 1
    finally:
        if out is not sys.stdout.buffer:
            out.close()
        asyncio.run(store.close())  # no writer task: this only closes the connections
    return count
