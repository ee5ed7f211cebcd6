"""`--keep-checkpoints` against promotion decisions: NAME never ends up serving a step with no files.

The trainer's prune and a gateway's decision run in different processes. The racing orders are
played here by calling the store's functions in that order (no sleeps): a prune that works from
what the trainer saw before decisions landed, and a decision asked while a prune runs (it waits;
PostgreSQL shows the wait in pg_locks). Either the prune keeps what a decision made serve, or the
decision finds the files gone and is refused (409)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import psycopg

from gateway.store.postgres import PostgresStore
from gateway.store.sqlite import SQLiteStore
from trainer import checkpoints as ckpts


def _checkpoint(root: Path, step: int) -> str:
    path = ckpts.checkpoint_dir(root, step)
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text('{"r": 8}')
    (path / "adapter_model.safetensors").write_bytes(bytes([step]) * 1000)
    (path / "trainer_state.json").write_text(f'{{"step": {step}}}')
    return str(path)


def _promoted_in_turn(store, root: Path, steps: int) -> None:
    """Steps 0..steps-1, each promoted over the one before (its parent)."""
    for step in range(steps):
        store.insert_step("agent", step, _checkpoint(root, step), {}, [])


def _on_disk(root: Path) -> list[int]:
    return [c.step for c in ckpts.list_checkpoints(root)]


def _another(store):
    """A second store on the same database: the gateway's, beside the trainer's."""
    return SQLiteStore(store.path) if isinstance(store, SQLiteStore) else PostgresStore(store.url)


def test_a_second_rollback_after_the_trainer_looked_keeps_the_step_it_serves(either_backend, tmp_path):
    """Steps 0-3 promoted in turn: the trainer sees step 3 serve and step 2 as what a rollback serves
    again. Before it removes anything, a gateway rolls back twice: step 1 serves. The prune, working
    from what the trainer saw, removed steps 0 and 1 (disk and store): NAME served a step no gateway
    could load. It reads what serves again where decisions wait, and keeps 1 and 0 (its parent)."""
    trainer = either_backend
    gateway = _another(trainer)
    root = tmp_path / "checkpoints"
    _promoted_in_turn(trainer, root, 4)
    looked = {3, 2}  # the serving step and its parent, as the trainer read them
    for step in (3, 2):
        gateway.decide_step("agent", step, "rolled_back", {"by": "api", "reason": "worse"})
    assert gateway.serving_step("agent") == 1

    moved: dict[int, Path] = {}

    def set_aside(kept: set[int]) -> list[int]:
        moved.update(ckpts.set_aside(root, 1, kept))
        return sorted(moved)

    removed, dropped = trainer.prune_checkpoints("agent", 1, looked, set_aside)
    ckpts.remove_set_aside(moved.values())
    # Step 3 is the newest, 2 what the trainer kept, 1 serves, 0 is what rolling 1 back serves again.
    assert removed == [] and dropped == []
    assert sorted(p.name for p in root.iterdir()) == ["0000", "0001", "0002", "0003"]
    if isinstance(trainer, PostgresStore):
        assert gateway.stored_steps("agent") == {0, 1, 2, 3}
        restored = gateway.restore_checkpoint("agent", 1, tmp_path / "elsewhere" / "0001")
        assert restored is not None and (restored / "adapter_model.safetensors").read_bytes() == bytes([1]) * 1000
    # What serves loads, and a decision from here on checks the files that are left.
    gateway.decide_step("agent", 1, "rolled_back", {"by": "api", "reason": "worse still"})
    assert gateway.serving_step("agent") == 0
    asyncio.run(gateway.close())


def test_the_trainer_prune_keeps_what_a_decision_made_serve_since_its_last_step(either_backend, tmp_path):
    """`trainer.resume.prune_checkpoints`, as after each step: two rollbacks landed since the step
    was recorded; the serving step (1) and its parent (0) stay, the rolled-back step 2 goes."""
    from trainer.resume import prune_checkpoints

    trainer = either_backend
    root = tmp_path / "checkpoints"
    _promoted_in_turn(trainer, root, 4)
    for step in (3, 2):
        trainer.decide_step("agent", step, "rolled_back", {"by": "api"})
    prune_checkpoints(trainer, "agent", root, 1, 3)
    assert _on_disk(root) == [0, 1, 3]
    assert sorted(p.name for p in root.iterdir()) == ["0000", "0001", "0003"]  # nothing left set aside


def test_a_decision_waits_for_a_prune_in_progress_then_sees_what_it_removed(postgres_db, tmp_path):
    """The prune holds the blobs' lock from its read of what serves to its commit; a promotion asked
    meanwhile waits, then finds the candidate's files as the prune left them (kept: it was a
    candidate when the prune read) and lands; a step the prune dropped is never made to serve."""
    trainer, gateway = PostgresStore(postgres_db), PostgresStore(postgres_db)
    root = tmp_path / "checkpoints"
    _promoted_in_turn(trainer, root, 3)
    trainer.insert_step("agent", 3, _checkpoint(root, 3), {}, [], state="candidate")
    outcome: list = []

    def promote() -> None:
        try:
            outcome.append(gateway.decide_step("agent", 3, "promoted", {"by": "api"}))
        except Exception as exc:  # noqa: BLE001 - the assertion below says what it was
            outcome.append(exc)

    thread = threading.Thread(target=promote)

    def set_aside(kept: set[int]) -> list[int]:
        assert kept == {1, 2, 3}  # serving 2, its parent 1, the candidate 3
        thread.start()
        with psycopg.connect(postgres_db, autocommit=True) as watcher:
            while not watcher.execute("SELECT 1 FROM pg_locks WHERE NOT granted").fetchone() and thread.is_alive():
                time.sleep(0.01)
        assert thread.is_alive()  # waiting for this prune, not decided around it
        moved.update(ckpts.set_aside(root, 1, kept))
        return sorted(moved)

    moved: dict[int, Path] = {}
    assert trainer.prune_checkpoints("agent", 1, set(), set_aside) == ([0], [0])
    ckpts.remove_set_aside(moved.values())
    thread.join()
    assert outcome[0]["state"] == "promoted" and gateway.serving_step("agent") == 3
    assert gateway.stored_steps("agent") == {1, 2, 3}
    trainer.close_sync()
    gateway.close_sync()
