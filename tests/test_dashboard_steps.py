"""/v1/dashboard's step rows on a long run: every step's metrics, as `store.steps` has them,
while each poll reads only the step rows recorded since the one before."""

from __future__ import annotations

import json

import httpx

from gateway.app import create_app
from gateway.settings import Settings
from gateway.store.sqlite import SQLiteStore
from tests.helpers import ThreadServer


def record_steps(store: SQLiteStore, steps) -> None:
    def op(conn) -> None:
        for step in steps:
            conn.execute(
                "INSERT INTO steps (model, step, path, metrics, groups, created_at) VALUES (?,?,?,?,?,?)",
                ("agent", step, f"/nowhere/{step}", json.dumps({"loss": step / 10}), json.dumps([f"g{step}"]), step),
            )

    store._run_sync(op)


class CountingStore(SQLiteStore):
    """Counts the step rows its reads return."""

    step_rows = 0

    def _query(self, sql, params=()):
        rows = super()._query(sql, params)
        if "FROM steps" in sql and "COUNT(*)" not in sql:
            self.step_rows += len(rows)
        return rows


def test_each_dashboard_poll_reads_only_the_steps_recorded_since_the_last(tmp_path):
    store = CountingStore(tmp_path / "rlproxy.db")
    record_steps(store, [s for s in range(2000) if s != 1000])  # 1000: recorded late, below the newest
    settings = Settings(
        state_dir=tmp_path, engine="openai", upstream_url="http://127.0.0.1:9/v1", model_name="agent", trainer="off"
    )
    expected = [{k: s[k] for k in ("step", "created_at", "metrics", "groups")} for s in store.steps("agent")]
    with ThreadServer(create_app(settings, store=store)) as server:

        def poll() -> list[dict]:
            store.step_rows = 0
            answer = httpx.get(f"{server.url}/v1/dashboard", timeout=30)
            assert answer.status_code == 200
            return answer.json()["steps"]

        assert poll() == expected and store.step_rows == 1999
        assert poll() == expected and store.step_rows == 0  # nothing recorded since
        record_steps(store, [2000, 2001])
        steps = poll()
        assert [s["step"] for s in steps[-3:]] == [1999, 2000, 2001] and steps[-1]["metrics"] == {"loss": 200.1}
        assert len(steps) == 2001 and store.step_rows == 2  # the two new ones only
        record_steps(store, [1000])  # below the newest kept (another gateway's trainer, say): all read again
        expected = [{k: s[k] for k in ("step", "created_at", "metrics", "groups")} for s in store.steps("agent")]
        assert poll() == expected and len(expected) == 2002


def test_step_history_reads_alike_on_either_backend(either_backend):
    store = either_backend
    for step in (0, 1, 3):
        store.insert_step("agent", step, f"/nowhere/{step}", {"loss": step}, [])
    count, rows = store.step_history("agent", None)
    assert count == 3 and [(r["step"], r["metrics"], r["groups"]) for r in rows] == [
        (0, {"loss": 0}, []),
        (1, {"loss": 1}, []),
        (3, {"loss": 3}, []),
    ]
    assert store.step_history("agent", 1) == (3, rows[2:]) and store.step_history("agent", 3) == (3, [])
