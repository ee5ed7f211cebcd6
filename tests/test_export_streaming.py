"""`rlproxy export` streams: each session goes from the store to the file before the next one is
read, in every format, so a store of any size exports in the memory of its largest session."""

from __future__ import annotations

import asyncio
import json
import weakref

import pyarrow.parquet as pq
import pytest

from gateway.export import records
from gateway.export.records import export_trajectories
from gateway.store.sqlite import SQLiteStore
from tests.helpers import call_row

SESSIONS = 6


class Session(dict):
    """A session row that can be watched (a plain dict takes no weak reference)."""


@pytest.fixture
def store_path(tmp_path):
    store = SQLiteStore(tmp_path / "rlproxy.db")
    for n in range(SESSIONS):
        store.record_call_sync(
            call_row(
                f"c{n}",
                f"s{n}",
                f"g{n}",
                engine="local",
                request={"model": "agent", "messages": [{"role": "user", "content": f"question {n}"}]},
                response={"choices": [{"index": 0, "message": {"role": "assistant", "content": "answer"}}]},
                prompt_ids=[1, 2, 3],
                completion_ids=[[4, 5]],
                behaviour_logprobs=[[-0.5, -0.25]],
            )
        )
    asyncio.run(store.close())
    return tmp_path / "rlproxy.db"


@pytest.mark.parametrize("fmt, name", [("rlproxy", "out.jsonl"), ("openai", "out.jsonl"), ("parquet", "out.parquet")])
def test_an_export_holds_one_session_at_a_time(store_path, tmp_path, monkeypatch, fmt, name):
    seen: list[weakref.ref] = []
    most = 0
    select = records.select_sessions

    def watched(store, where):
        nonlocal most
        for session in select(store, where):
            row = Session(session)
            seen.append(weakref.ref(row))
            most = max(most, sum(ref() is not None for ref in seen))
            yield row

    monkeypatch.setattr(records, "select_sessions", watched)
    out = tmp_path / name
    result = export_trajectories(store_path, str(out), fmt=fmt)
    assert (result.sessions, result.rows) == (SESSIONS, SESSIONS)
    if fmt == "parquet":
        assert pq.read_table(out).num_rows == SESSIONS
    else:
        assert len([json.loads(line) for line in out.read_text().splitlines()]) == SESSIONS
    # The one being written and the one just read; all of them when the selection was read first.
    assert most <= 2, f"{most} sessions held at once"
