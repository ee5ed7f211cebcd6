"""Issue 27, items 3 and 7, on hand-made store rows (no model): staleness is decided by the
engine each call recorded, not the trainer's own `--engine`; greedy calls (temperature below
1e-5, on any engine) are context, never trained, and counted."""

from __future__ import annotations

import asyncio

import pytest

from gateway.settings import GREEDY_BELOW, Settings, is_greedy
from gateway.store import CallRecord
from gateway.store.lineage import chain_distance
from gateway.store.sqlite import SQLiteStore
from trainer.data import NO_TOKENS, build_batch, trajectory_samples
from trainer.publish import plan_step
from trainer.retries import GREEDY, greedy_calls, is_greedy_call, sampling_temperature
from trainer.selection import without_stale

PROMPT_1 = [1, 2, 3]
COMPLETION_1 = [4, 5]
PROMPT_2 = [1, 2, 3, 4, 5, 6, 7]  # extends call 1: prompt 1 + completion 1 + a user turn
COMPLETION_2 = [8, 9, 10]


def settings(tmp_path, **overrides) -> Settings:
    return Settings(state_dir=tmp_path, groups_per_step=1, max_tokens_per_row=64, **overrides)


def call(call_id, prompt, completion, *, temperature=None, engine="local", step=None, request_temperature=None):
    record = {
        "id": call_id,
        "status": "ok",
        "engine": engine,
        "step": step,
        "request": {"messages": [{"role": "user", "content": call_id}]},
        "response": {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}]},
        "prompt_ids": prompt,
        "completion_ids": [completion],
        "behaviour_logprobs": [[-0.5] * len(completion)],
        "sampling": None if temperature is None else {"temperature": temperature},
    }
    if request_temperature is not None:
        record["request"]["temperature"] = request_temperature
    return record


def record(store: SQLiteStore, group_id: str, session_id: str, row: dict) -> None:
    store.record_call_sync(
        CallRecord(
            id=row["id"],
            session_id=session_id,
            group_id=group_id,
            split="train",
            model="agent",
            served=None,
            step=row["step"],
            engine=row["engine"],
            stream=False,
            status="ok",
            request=row["request"],
            response=row["response"],
            latency_ms=1.0,
            prompt_ids=row["prompt_ids"],
            completion_ids=row["completion_ids"],
            behaviour_logprobs=row["behaviour_logprobs"],
            sampling=row["sampling"],
        )
    )


def group(store: SQLiteStore, group_id: str, rewards: list[float], **call_kwargs) -> None:
    for i, reward in enumerate(rewards):
        session_id = f"{group_id}-s{i}"
        record(store, group_id, session_id, call(f"{session_id}-c", PROMPT_1, COMPLETION_1, **call_kwargs))
        asyncio.run(store.set_reward(session_id, reward))
    asyncio.run(store.close_group(group_id))


# ---------------------------------------------------------------- staleness (item 3)


def test_a_local_engine_trainer_trains_openai_engine_groups_recorded_steps_ago(tmp_path):
    # `rlproxy train` on another machine runs with the default --engine local; the calls say
    # they came from an `openai` upstream, whose policy is not ours: never stale.
    s = settings(tmp_path, max_staleness=1)
    assert s.engine == "local"
    store = SQLiteStore(s.db_path)
    try:
        group(store, "upstream", [1.0, 0.0], engine="openai", step=None)
        group(store, "ours", [1.0, 0.0], engine="local", step=None)  # our base model, step 0
        groups = [store.get_group("upstream"), store.get_group("ours")]
        fresh, skipped = without_stale(store, s, groups, next_step=5)  # training from step 4
        assert [g["id"] for g in fresh] == ["upstream"] and skipped == 1
        assert store.get_group("upstream")["skipped"] is None
        assert store.get_group("ours")["skipped"] == "stale: sampled by step 0, training from step 4"
    finally:
        asyncio.run(store.close())


def test_an_openai_engine_trainer_still_skips_stale_groups_its_adapters_answered(tmp_path):
    # The other way round: a trainer whose own setting says openai does not exempt vLLM calls.
    s = settings(tmp_path, max_staleness=1, engine="openai", upstream_url="http://127.0.0.1:9")
    store = SQLiteStore(s.db_path)
    try:
        group(store, "served", [1.0, 0.0], engine="vllm", step=1)
        fresh, skipped = without_stale(store, s, [store.get_group("served")], next_step=4)
        assert fresh == [] and skipped == 1
    finally:
        asyncio.run(store.close())


def test_selection_reads_the_steps_between_a_groups_step_and_the_current_one_not_every_step(tmp_path):
    # `without_stale` read every step row of the run at each selection (every poll while groups
    # gather), more each step trained; the gateway's live check already walked only what it needs.
    s = settings(tmp_path, max_staleness=2)
    store = SQLiteStore(s.db_path)
    try:

        def record_steps(conn) -> None:  # 3,000 steps, each trained from the one before; 2990 rejected
            for step in range(3000):
                parent = None if step == 0 else (2989 if step == 2991 else step - 1)
                conn.execute(
                    "INSERT INTO steps (model, step, path, metrics, groups, created_at, parent) VALUES (?,?,?,?,?,?,?)",
                    ("agent", step, f"/nowhere/{step}", "{}", "[]", 0.0, parent),
                )

        store._run_sync(record_steps)
        for gid, step in {"fresh": 2998, "branch": 2990, "edge": 2997, "old": 5, "base": None}.items():
            group(store, gid, [1.0, 0.0], step=step)
        groups = [store.get_group(g) for g in ("fresh", "branch", "edge", "old", "base")]
        step_rows = []
        query = store._query

        def counting(sql, params=()):
            rows = query(sql, params)
            if "FROM steps" in sql and "state" not in sql:
                step_rows.append(len(rows))
            return rows

        store._query = counting
        fresh, skipped = without_stale(store, s, groups, next_step=3000)  # training from step 2999
        store._query = query
        # The answers of the whole chain: 2990 was turned down, so it is 8 steps from 2999, not 9.
        parents = store.lineage("agent")
        expected = [
            g
            for g, st in [("fresh", 2998), ("branch", 2990), ("edge", 2997), ("old", 5), ("base", 0)]
            if chain_distance(parents, 2999, st) <= 2
        ]
        assert [g["id"] for g in fresh] == expected == ["fresh", "edge"] and skipped == 3
        assert sum(step_rows) <= 64  # a few ranges near step 2999, not 3,000 rows
    finally:
        asyncio.run(store.close())


# ---------------------------------------------------------------- greedy (item 7)


@pytest.mark.parametrize("temperature", [0.0, 1e-6])
def test_a_greedy_call_is_context_not_trained(temperature):
    assert is_greedy(temperature) and not is_greedy(GREEDY_BELOW)
    greedy = call("c1", PROMPT_1, COMPLETION_1, temperature=temperature)
    sampled = call("c2", PROMPT_2, COMPLETION_2, temperature=0.7)
    assert is_greedy_call(greedy) and not is_greedy_call(sampled)
    assert sampling_temperature(greedy) == 1.0  # never scored at 1e-6
    (sample,) = trajectory_samples([greedy, sampled], trajectory_id="s", group_id="g", advantage=1.0)
    # one sequence still: the greedy completion is context, the later turn trains
    assert list(sample.token_ids) == PROMPT_2 + COMPLETION_2
    assert [i for i, m in enumerate(sample.loss_mask) if m] == [7, 8, 9]
    assert list(sample.temperatures[7:]) == [0.7] * 3
    # a trajectory of greedy calls only has nothing to train
    assert trajectory_samples([greedy], trajectory_id="s", group_id="g", advantage=1.0) == []
    assert greedy_calls([greedy, sampled]) == ["c1"]


def test_an_upstream_call_at_a_near_zero_temperature_is_greedy_too():
    # The openai engine records no sampling: the request's temperature decides.
    upstream = call("u", PROMPT_1, COMPLETION_1, request_temperature=1e-6, engine="openai")
    assert is_greedy_call(upstream)
    assert not is_greedy_call(call("u", PROMPT_1, COMPLETION_1, request_temperature=0.01))


def test_greedy_calls_are_counted_and_a_group_of_them_only_is_skipped():
    groups = [
        {"id": "mixed", "sessions": [{"id": "a", "reward": 1.0}, {"id": "b", "reward": 0.0}]},
        {"id": "argmax", "sessions": [{"id": "c", "reward": 1.0}, {"id": "d", "reward": 0.0}]},
    ]
    calls = {
        "a": [call("a1", PROMPT_1, COMPLETION_1, temperature=0.0), call("a2", PROMPT_2, COMPLETION_2)],
        "b": [call("b1", PROMPT_1, COMPLETION_1, temperature=1e-6), call("b2", PROMPT_2, COMPLETION_2)],
        "c": [call("c1", PROMPT_1, COMPLETION_1, temperature=0.0)],
        "d": [call("d1", PROMPT_1, COMPLETION_1, temperature=1e-7)],
    }
    batch = build_batch(groups, calls)
    assert batch.group_ids == ["mixed"] and batch.skipped == {"argmax": NO_TOKENS}
    assert batch.greedy_calls == 2
    assert all(sum(s.loss_mask) == len(COMPLETION_2) for s in batch.samples)
    assert "greedy" in NO_TOKENS and "1e-5" in GREEDY


def test_the_step_plan_counts_greedy_calls_for_the_step_metrics(tmp_path):
    s = settings(tmp_path)
    store = SQLiteStore(s.db_path)
    try:
        for i, reward in enumerate([1.0, 0.0]):
            session_id = f"g-s{i}"
            record(store, "g", session_id, call(f"{session_id}-c1", PROMPT_1, COMPLETION_1, temperature=1e-6))
            record(store, "g", session_id, call(f"{session_id}-c2", PROMPT_2, COMPLETION_2, temperature=1.0))
            asyncio.run(store.set_reward(session_id, reward))
        asyncio.run(store.close_group("g"))
        plan = plan_step(store, s, None, [store.get_group("g")], step=1)
        assert plan.trained_groups == ["g"] and plan.greedy_calls == 2
        assert sum(sum(sample.loss_mask) for sample in plan.samples) == 2 * len(COMPLETION_2)
    finally:
        asyncio.run(store.close())
