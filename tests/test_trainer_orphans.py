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
