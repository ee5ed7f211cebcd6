"""Rewards and the trainer's claim serialise, on SQLite and on a real PostgreSQL (issue 38).

Each interleaving is forced: one store's write transaction is held open at a chosen statement
(`Pause`) while another store (a second gateway, or the trainer, as a second process would)
writes. Whatever the order, a reward answered 200 (`trainable: true`, with its group) is what its
group trains with (the `trained_reward` its step records), and one the trainer got to first is
refused with 409. The trainer here is trainer/worker.py's sequence without a GPU: ready groups,
the no-spread screen, the claim, the rewards read after it, the step recorded with them.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from gateway.errors import Conflict
from gateway.store import LiveRule, Store, rows
from gateway.store.postgres import PostgresStore
from gateway.store.sqlite import SQLiteStore
from tests.test_store import call
from trainer.data import NO_SPREAD
from trainer.selection import without_spread

MODEL = "agent"
LIVE = LiveRule(group_size=3, max_staleness=100)
# The stress test: groups of 3, live sessions, the most a client waits between two rewards, and
# how much longer each of a gateway's statements takes (the trainer's take no longer).
HARNESS_GROUPS, LIVE_SESSIONS, PACE_S, LATENCY_S = 16, 30, 0.3, 0.002


class Pause:
    """Holds a write transaction open after its first statement that contains `after` (None:
    after the op, just before COMMIT), until `release()`."""

    made: list[Pause] = []  # released when the test ends, so a failing test leaves nothing held

    def __init__(self, after: str | None = None) -> None:
        Pause.made.append(self)
        self.after = after
        self.reached = threading.Event()
        self.go = threading.Event()

    def hold(self) -> None:
        self.reached.set()
        assert self.go.wait(60), "the test never released the pause"

    def release(self) -> None:
        self.go.set()

    def wrap(self, op: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def held(conn: Any) -> Any:
            result = op(_Watched(conn, self) if self.after else conn)
            if self.after is None:
                self.hold()
            return result

        return held


class _Watched:
    """A connection that stops after the statement its `Pause` waits for."""

    def __init__(self, conn: Any, pause: Pause) -> None:
        self._conn, self._pause = conn, pause

    def execute(self, sql: str, params: Any = ()) -> Any:
        cursor = self._conn.execute(sql, params)
        if self._pause.after in sql and not self._pause.reached.is_set():
            self._pause.hold()
        return cursor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class _Distant:
    """A connection a network away: each statement takes `seconds` longer."""

    def __init__(self, conn: Any, seconds: float) -> None:
        self._conn, self._seconds = conn, seconds

    def execute(self, sql: str, params: Any = ()) -> Any:
        time.sleep(self._seconds)
        return self._conn.execute(sql, params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class _Pausing:
    """A store whose next write transactions go through `pause` while it is set, and whose
    statements each take `latency_s` longer (a gateway on another machine than the database)."""

    pause: Pause | None = None
    latency_s = 0.0

    def _distant(self, op: Callable[[Any], Any]) -> Callable[[Any], Any]:
        return (lambda conn: op(_Distant(conn, self.latency_s))) if self.latency_s else op

    def _run_sync(self, op):
        return super()._run_sync(self._distant(self.pause.wrap(op) if self.pause else op))

    def _apply_batch(self, ops):
        return super()._apply_batch([self._distant(op) for op in ops])


class PausingSQLite(_Pausing, SQLiteStore):
    pass


class PausingPostgres(_Pausing, PostgresStore):
    pass


@pytest.fixture(params=["sqlite", "postgres"])
async def open_store(request, tmp_path):
    """`open_store(start=False)`: one more process's store on the test's database (a gateway
    with `start=True` batches its writes, group commit); `open_store.url`: PostgreSQL's, else None."""
    opened: list[Store] = []
    url = request.getfixturevalue("postgres_db") if request.param == "postgres" else None

    async def make(start: bool = False) -> Store:
        store = PausingPostgres(url) if url else PausingSQLite(tmp_path / "rlproxy.db")
        opened.append(store)
        if start:
            await store.start()
        return store

    make.url = url
    yield make
    for pause in Pause.made:
        pause.release()
    Pause.made.clear()
    for store in opened:
        await store.close()


def _lock_waiters(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        sql = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        return conn.execute(sql).fetchone()[0]


async def _finished_or_waiting(url: str | None, *running: asyncio.Future) -> bool:
    """Whether `running` all finished (True), or one of them waits for a lock (False). SQLite's
    writers wait for the file's lock where no query sees them: give them a moment, say False."""
    if url is None:
        await asyncio.sleep(0.3)
        return all(f.done() for f in running)
    for _ in range(3000):
        if all(f.done() for f in running):
            return True
        if await asyncio.to_thread(_lock_waiters, url):
            return False
        await asyncio.sleep(0.01)
    raise AssertionError("neither finished nor waiting for a lock")


def _call(session: str, group: str | None, task_key: str | None = None):
    return call(0, session, group, id=f"{session}-call", task_key=task_key)


async def _group(gateway: Store, group_id: str, rewards: list[float]) -> list[str]:
    sessions = [f"{group_id}-{i}" for i in range(len(rewards))]
    for session, reward in zip(sessions, rewards, strict=True):
        await gateway.record_call(_call(session, group_id))
        await gateway.set_reward(session, reward)
    await gateway.close_group(group_id)
    return sessions


def train_round(trainer: Store, step: int, trained: dict[str, float]) -> list[str]:
    """One step as the worker takes it (trainer/worker.py, trainer/publish.py), less the GPU.
    `trained` gains what each session trained with, as the trainer read it."""
    ready = trainer.claim_groups(MODEL, "test-trainer")
    keep, _ = without_spread(trainer, ready)
    if not keep:  # nothing to claim: the worker waits (trainer.selection.enough_for_a_step)
        return []
    claimed = trainer.claim_for_step([g["id"] for g in keep], step)
    if not claimed:
        return []
    groups = [trainer.get_group(gid) for gid in claimed]  # read after the claim, as publish.plan_step does
    rewards = {s["id"]: s["reward"] for g in groups for s in g["sessions"]}
    trained.update(rewards)
    advantages = dict.fromkeys(rewards, 0.0)
    trainer.insert_step(
        MODEL, step, f"/ckpt/{step}", {}, claimed, list(rewards), advantages=advantages, rewards=rewards
    )
    return claimed


def _check_answer(store: Store, session: str, answer: dict | None, before: float, trained: dict[str, float]) -> None:
    """A 200 is what its group trains with; a 409 left the reward as it was, and that trained."""
    got = store.get_session(session)
    if answer is None:
        assert got["reward"] == before and trained[session] == before
    else:
        assert answer["trainable"] and got["group_id"] == answer["group_id"]
        assert trained.get(session) == answer["reward"], f"answered 200 with {answer['reward']}, trained {trained}"
    assert got["trained_reward"] == trained[session]  # the store records what the step trained with


async def _reward(gateway: Store, session: str, reward: float, live: LiveRule | None = None) -> dict | None:
    try:
        return await gateway.set_reward(session, reward, live=live)
    except Conflict as exc:
        assert exc.status_code == 409
        return None


# ------------------------------------------------------------------ a reward against the claim


async def test_a_reward_that_read_the_group_open_is_trained_by_the_claim_after_it(open_store):
    """The reward reads the group unclaimed and is held there; the trainer claims and reads the
    group meanwhile. The claim waits for the reward's commit, then trains the new reward."""
    gateway, trainer = await open_store(), await open_store()
    await _group(gateway, "g", [0.0, 1.0])
    gateway.pause = pause = Pause(after="claimed_step")  # the reward's read of the group's state
    reward = asyncio.ensure_future(_reward(gateway, "g-0", 0.25))
    assert await asyncio.to_thread(pause.reached.wait, 30)
    trained: dict[str, float] = {}
    step = asyncio.ensure_future(asyncio.to_thread(train_round, trainer, 1, trained))
    await _finished_or_waiting(open_store.url, step)
    pause.release()
    gateway.pause = None
    answer, claimed = await reward, await step
    assert claimed == ["g"]
    _check_answer(trainer, "g-0", answer, 0.0, trained)
    assert answer is not None  # it took the group's lock first: nothing refused it


async def test_a_reward_while_the_claim_is_open_waits_for_it_and_is_refused(open_store):
    """The claim's transaction is held before its COMMIT; the reward waits for it (on
    PostgreSQL, seen waiting for the group's row lock), then answers 409."""
    gateway, trainer = await open_store(), await open_store()
    await _group(gateway, "g", [0.0, 1.0])
    trainer.pause = pause = Pause(after="attempts = attempts + 1")  # the claim's write on the group
    trained: dict[str, float] = {}
    step = asyncio.ensure_future(asyncio.to_thread(train_round, trainer, 1, trained))
    assert await asyncio.to_thread(pause.reached.wait, 30)
    trainer.pause = None
    reward = asyncio.ensure_future(_reward(gateway, "g-1", 0.5))
    finished = await _finished_or_waiting(open_store.url, reward)
    assert not finished, f"the reward was answered while the claim was open: {reward.result()}"
    pause.release()
    answer = await reward
    assert await step == ["g"]
    assert answer is None
    _check_answer(trainer, "g-1", answer, 1.0, trained)


async def test_a_group_commit_batch_caught_between_two_groups_and_a_claim_answers_what_trained(open_store):
    """One gateway's group commit holds g2's lock (a reward) while the trainer claims g1, then
    waits for g2; the batch's next op, a call into g1, then waits for g1: the two wait on each
    other (on PostgreSQL; SQLite's one writer lets the batch finish first). The batch gives way
    (rolled back after `BATCH_LOCK_WAIT`) and each of its ops runs alone: no answer is lost, and
    each matches what the step trained (the reward: 200 and trained, or 409; the call: trained,
    or kept as late)."""
    gateway, trainer = await open_store(), await open_store()
    await _group(gateway, "g1", [0.0, 1.0])
    await _group(gateway, "g2", [0.0, 1.0])
    pause = Pause()
    reward = pause.wrap(lambda conn: rows.set_reward(conn, "g2-0", 0.25, {}))
    late = _call("g1-late", "g1")
    ops = [reward, lambda conn: rows.insert_call(conn, late)]
    batch = asyncio.ensure_future(asyncio.to_thread(gateway._apply_batch, ops))  # one round of the writer
    assert await asyncio.to_thread(pause.reached.wait, 30)
    trained: dict[str, float] = {}
    step = asyncio.ensure_future(asyncio.to_thread(train_round, trainer, 1, trained))
    await _finished_or_waiting(open_store.url, step)
    pause.release()
    (rewarded, answer), (recorded, untrainable) = await batch
    claimed = await step
    assert rewarded or isinstance(answer, Conflict), answer
    _check_answer(trainer, "g2-0", answer if rewarded else None, 0.0, trained)
    assert recorded and trainer.get_call("g1-late-call")["untrainable"] == untrainable
    assert (untrainable is not None) == ("g1" in claimed), (claimed, untrainable)
    if open_store.url:  # the two waited on each other, once: one gave way (the batch, unless PostgreSQL's
        assert "g2" in claimed and gateway.retries + trainer.retries == 1  # deadlock check came first)


# ------------------------------------------------------------------ live groups (K = 3) against the claim


async def test_a_live_session_never_joins_a_group_another_gateway_closed_for_the_trainer(open_store):
    """Two gateways, one live task key, K = 3: two sessions wait in the open group. Gateway b's
    reward for a fourth session has found that group open and is held; gateway a's reward for
    the third, then a trainer, run meanwhile. Every `trainable: true` names a group that trains
    it (or is still open); none names a group trained without it."""
    a, b, trainer = await open_store(), await open_store(), await open_store()
    for i in range(4):
        await a.record_call(_call(f"live-{i}", None, task_key="task"))
    answers = {s: await _reward(a, s, r, LIVE) for s, r in (("live-0", 0.0), ("live-1", 1.0))}
    assert answers["live-0"]["group_id"] == answers["live-1"]["group_id"]
    b.pause = pause = Pause(after="origin = 'live' AND closed = 0")  # b has read the open group
    fourth = asyncio.ensure_future(_reward(b, "live-3", 0.5, LIVE))
    assert await asyncio.to_thread(pause.reached.wait, 30)
    third = asyncio.ensure_future(_reward(a, "live-2", 0.75, LIVE))
    await _finished_or_waiting(open_store.url, third)
    trained: dict[str, float] = {}
    await asyncio.to_thread(train_round, trainer, 1, trained)
    pause.release()
    b.pause = None
    answers["live-3"], answers["live-2"] = await fourth, await third
    await asyncio.to_thread(train_round, trainer, 2, trained)
    for session, answer in answers.items():
        got = trainer.get_session(session)
        assert answer["trainable"] and got["group_id"] == answer["group_id"], (session, answer, got)
        group = trainer.get_group(answer["group_id"])
        if group["trained_step"] is not None:
            assert trained.get(session) == got["trained_reward"] == answer["reward"], (session, answer, trained)
        else:
            assert not group["closed"] and group["claimed_step"] is None  # still filling: may train later
    sizes = sorted(trainer.get_group(g)["n_sessions"] for g in {a["group_id"] for a in answers.values()})
    assert sizes == [1, 3]  # one group of K, closed and trained; the fourth session opened the next


# ------------------------------------------------------------------ the no-spread screen


class _RewardAfterRead:
    """The trainer's store, but a gateway's reward lands right after the screen reads a group."""

    def __init__(self, store: Store, reward: Callable[[], Any]) -> None:
        self._store, self._reward = store, reward
        self.answer: Any = "not sent"

    def get_group(self, group_id: str) -> dict:
        group = self._store.get_group(group_id)
        if self.answer == "not sent":
            self.answer = self._reward()
        return group

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


async def test_a_reward_between_the_screens_read_and_its_skip_is_seen(open_store):
    """Rewards 0.5, 0.5: no spread when the screen reads them; a reward of 0.9 lands before it
    decides. The group is not skipped as "no spread": the next step trains the 0.9."""
    gateway, trainer = await open_store(), await open_store()
    await _group(gateway, "flat", [0.5, 0.5])
    screened = _RewardAfterRead(trainer, lambda: asyncio.run(_reward(gateway, "flat-0", 0.9)))
    keep, skipped = await asyncio.to_thread(without_spread, screened, trainer.claim_groups(MODEL, "test-trainer"))
    answer = screened.answer
    assert answer is not None and answer["reward"] == 0.9
    trained: dict[str, float] = {}
    await asyncio.to_thread(train_round, trainer, 1, trained)
    assert trainer.get_group("flat")["skipped"] is None
    _check_answer(trainer, "flat-0", answer, 0.5, trained)


async def test_a_reward_while_the_screen_skips_waits_and_is_refused(open_store):
    """The screen's skip is held before its COMMIT; a reward that would give the group a
    spread waits for it (on PostgreSQL, seen waiting), then answers 409: never 200 and skipped."""
    gateway, trainer = await open_store(), await open_store()
    await _group(gateway, "flat", [0.5, 0.5])
    ready = trainer.claim_groups(MODEL, "test-trainer")
    trainer.pause = pause = Pause(after="SET skipped")  # the screen's write on the group
    screen = asyncio.ensure_future(asyncio.to_thread(without_spread, trainer, ready))
    assert await asyncio.to_thread(pause.reached.wait, 30)
    trainer.pause = None
    reward = asyncio.ensure_future(_reward(gateway, "flat-1", 0.9))
    finished = await _finished_or_waiting(open_store.url, reward)
    assert not finished, f"the reward was answered while the screen was skipping its group: {reward.result()}"
    pause.release()
    assert (await screen) == ([], 1)
    assert await reward is None
    group = trainer.get_group("flat")
    assert group["skipped"] == NO_SPREAD and [s["reward"] for s in group["sessions"]] == [0.5, 0.5]


# ------------------------------------------------------------------ all at once


async def test_rewards_live_joins_and_a_trainer_at_once_train_what_was_answered(open_store):
    """Two gateways post rewards (changing some) for harness groups and live sessions while a
    trainer claims in a loop. Afterwards each session's last 200 is its stored reward, and, where
    its group trained, the reward it trained with; a group skipped for no spread had none in
    the rewards it kept."""
    rng = random.Random(38)
    a, b, trainer = await open_store(start=True), await open_store(start=True), await open_store()
    gateways = (a, b)
    a.latency_s = b.latency_s = LATENCY_S  # a reward's read and its commit further apart: more to race
    plans: dict[str, tuple[Store, list[float], LiveRule | None]] = {}
    for g in range(HARNESS_GROUPS):
        for i in range(3):
            gateway, session = gateways[(g + i) % 2], f"h{g}-{i}"
            await gateway.record_call(_call(session, f"h{g}"))
            plans[session] = (gateway, [rng.choice((0.0, 1.0)) for _ in range(rng.randint(1, 3))], None)
        await a.close_group(f"h{g}")
    for i in range(LIVE_SESSIONS):
        session = f"l{i}"
        await a.record_call(_call(session, None, task_key=f"task-{i % 3}"))
        plans[session] = (gateways[i % 2], [rng.choice((0.0, 0.5, 1.0)) for _ in range(rng.randint(1, 2))], LIVE)

    answers: dict[str, list[tuple[float, dict | None]]] = defaultdict(list)

    async def client(session: str) -> None:
        gateway, rewards, live = plans[session]
        for reward in rewards:
            await asyncio.sleep(rng.random() * PACE_S)
            answers[session].append((reward, await _reward(gateway, session, reward, live)))

    trained: dict[str, float] = {}
    stop = threading.Event()

    def trainer_loop() -> int:
        step, drained = 1, 0
        while (not stop.is_set() or trainer.ready_groups(MODEL)) and drained < 50:
            drained += stop.is_set()  # once the clients are done: what is ready, then no more
            if train_round(trainer, step, trained):
                step += 1
            else:
                time.sleep(0.01)
        return step - 1

    steps = asyncio.ensure_future(asyncio.to_thread(trainer_loop))
    await asyncio.gather(*(client(s) for s in plans))
    stop.set()
    assert await steps >= 2
    for session, posted in answers.items():
        got = trainer.get_session(session)
        accepted = [(reward, answer) for reward, answer in posted if answer is not None]
        assert got["reward"] == (accepted[-1][0] if accepted else None), (session, posted)
        if not accepted or not accepted[-1][1]["trainable"]:
            continue
        answer = accepted[-1][1]
        assert got["group_id"] == answer["group_id"], (session, answer)
        group = trainer.get_group(answer["group_id"])
        if group["trained_step"] is not None:
            assert trained[session] == got["trained_reward"] == answer["reward"], (session, posted, group)
        elif group["skipped"] is not None:
            assert group["skipped"] == NO_SPREAD and len({s["reward"] for s in group["sessions"]}) == 1, group
        else:
            assert not group["closed"], group  # a live group still filling
    for g in range(HARNESS_GROUPS):
        group = trainer.get_group(f"h{g}")
        assert group["trained_step"] is not None or group["skipped"] == NO_SPREAD, group
