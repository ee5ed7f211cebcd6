"""A checkpoint saved but never recorded (the trainer killed between the two) is recorded at the next
start with the parent it was trained from, not whatever serves by then: one whose parent was rolled
back while the trainer was down is discarded, as a step is taken back when that lands while it trains."""

from __future__ import annotations

import asyncio

from gateway.store.sqlite import SQLiteStore
from trainer import checkpoints as ckpts
from trainer.resume import record_orphan


def _adapter(directory):
    (directory / "adapter_config.json").write_text("{}")
    (directory / "adapter_model.safetensors").write_bytes(b"weights")


def _step(store, root, step: int, parent: int | None) -> None:
    checkpoint = ckpts.write_checkpoint(root, step, _adapter, settings={}, metrics={}, groups=[], parent=parent)
    store.insert_step("agent", step, str(checkpoint.path), {}, [], parent=parent)


def test_an_orphan_trained_from_a_step_rolled_back_while_the_trainer_was_down_is_discarded(tmp_path):
    store = SQLiteStore(tmp_path / "db.sqlite")
    root = tmp_path / "checkpoints"
    try:
        _step(store, root, 0, None)
        _step(store, root, 1, 0)  # promoted: serves
        orphan = ckpts.write_checkpoint(root, 2, _adapter, settings={}, metrics={}, groups=[], parent=1)
        # The trainer is killed here; the canary's watch then rolls step 1 back: step 0 serves again.
        store.decide_step("agent", 1, "rolled_back", {"by": "test"})
        record_orphan(store, "agent", orphan, "candidate")
        assert not orphan.path.exists()
        assert [row["step"] for row in store.steps("agent")] == [0, 1]
    finally:
        asyncio.run(store.close())


def test_an_orphan_is_recorded_with_the_parent_it_was_trained_from(tmp_path):
    store = SQLiteStore(tmp_path / "db.sqlite")
    root = tmp_path / "checkpoints"
    try:
        _step(store, root, 0, None)
        _step(store, root, 1, 0)
        _step(store, root, 2, 1)  # serves now: the parent a record that asks the store would name
        orphan = ckpts.write_checkpoint(root, 3, _adapter, settings={}, metrics={}, groups=[], parent=1)
        record_orphan(store, "agent", orphan)
        assert {row["step"]: row["parent"] for row in store.steps("agent")}[3] == 1
    finally:
        asyncio.run(store.close())


def test_a_checkpoint_left_on_a_machine_the_trainer_came_back_to_is_not_loaded_for_the_recorded_step(
    postgres_db, tmp_path
):
    """PostgreSQL, one store, two machines. On A the trainer recorded step 0, saved step 1 and was killed
    before recording it; it went on on B, which recorded its own step 1; back on A, resume found A's
    unrecorded `0001` under the number of a recorded step and loaded it: weights the store's step 1
    never had, trained on and recorded as its children. The store's files win."""
    from gateway.settings import Settings
    from gateway.store.postgres import PostgresStore
    from trainer.resume import resume

    settings = Settings(state_dir=tmp_path / "a", store=postgres_db, model_name="agent", promote="manual")
    shape = settings.public_dict()

    def weights(data: bytes):
        return lambda directory: _adapter(directory) or (directory / "adapter_model.safetensors").write_bytes(data)

    store = PostgresStore(postgres_db)
    a, b = tmp_path / "a" / "checkpoints", tmp_path / "b" / "checkpoints"
    try:
        step_0 = ckpts.write_checkpoint(a, 0, weights(b"step 0"), settings=shape, metrics={}, groups=[])
        store.insert_step("agent", 0, str(step_0.path), {}, [])
        ckpts.write_checkpoint(a, 1, weights(b"A's, never recorded"), settings=shape, metrics={}, groups=[])
        on_b = ckpts.write_checkpoint(b, 1, weights(b"B's step 1"), settings=shape, metrics={}, groups=[], parent=0)
        store.insert_step("agent", 1, str(on_b.path), {}, [], parent=0)  # promoted: it serves

        loaded = []
        resumed = resume(store, "agent", a, settings, save=None, load=loaded.append)  # type: ignore[arg-type]
        assert resumed == (2, 1)
        assert [(path / "adapter_model.safetensors").read_bytes() for path in loaded] == [b"B's step 1"]
    finally:
        store.close_sync()
