"""The serving step's checkpoint gone (removed by hand; on PostgreSQL not in the store either) while the
weights hold another step (a rejected candidate): training waits, and says why, until it is back.

It went on from the weights it had and recorded the next step as the serving step's child: a lineage
the store promises (staleness along the parent chain, the step a rollback serves again) and the
weights did not keep. A restart said the same: it loaded the newest checkpoint and took the weights
for the serving step's."""

from __future__ import annotations

import shutil
import threading

import pytest

from gateway.errors import Conflict
from tests.helpers_trainer import Recorder, trainer_settings

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*tie_word_embeddings"),
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing"),
]

WAITS = "training waits: step 0 serves but its checkpoint is gone"


def _params(worker) -> list:
    return worker.backend.snapshot()["params"]


def _same(a: list, b: list) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _wait_for_hold(worker, store, caplog) -> None:
    """Run `worker` until it says it waits for the serving step's files; nothing may train meanwhile."""
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    with caplog.at_level("INFO", logger="rlproxy"):
        thread.start()
        try:
            while WAITS not in caplog.text:
                assert store.get_group("g2")["trained_step"] is None, "trained on weights that are not step 0's"
                assert thread.is_alive()
                thread.join(0.05)
        finally:
            stop.set()
            thread.join(60)


def test_training_waits_while_the_serving_steps_checkpoint_is_gone_then_goes_on_from_it(tmp_path, caplog):
    from trainer.worker import TrainerWorker

    settings = trainer_settings(tmp_path, groups_per_step=1, promote="manual", max_staleness=10, max_rejections=5)
    recorder = Recorder(settings)
    store = recorder.store
    recorder.group("g1", [1.0, 0.0])
    worker = TrainerWorker(settings)
    worker.start()
    try:
        step_0 = _params(worker)
        assert worker.run(max_steps=1) == 1
        store.decide_step("agent", 1, "rejected", {"by": "test"})  # step 0 serves; the weights hold step 1
        root = settings.checkpoints_dir()
        aside = tmp_path / "aside"
        shutil.move(root / "0000", aside)  # removed by hand
        recorder.group("g2", [0.0, 1.0], step=0)
        _wait_for_hold(worker, store, caplog)
        assert [r["step"] for r in store.steps("agent")] == [0, 1]
        assert f"{root / '0000'} is missing or incomplete" in caplog.text
        assert "--model-name NEW --init-from agent@1" in caplog.text  # the way out where it cannot be put back
        # No decision ends the wait (docs/training.md): step 1's files are there, but only a
        # candidate can be promoted, and a holding trainer records none.
        with pytest.raises(Conflict, match="step 1 of 'agent' is rejected, not candidate"):
            store.decide_step("agent", 1, "promoted", {"by": "test"})
    finally:
        worker.close()

    restarted = TrainerWorker(settings)
    restarted.start()
    try:
        assert restarted.weights_step == 1, "the restart loaded step 1's checkpoint, the newest there is"
        caplog.clear()
        _wait_for_hold(restarted, store, caplog)
        assert not _same(_params(restarted), step_0)
        shutil.move(aside, root / "0000")  # put back: training goes on from step 0's adapter by itself
        assert not restarted._held(threading.Event())
        assert restarted.weights_step == 0 and _same(_params(restarted), step_0)
        assert restarted.run(max_steps=1) == 1
        rows = {r["step"]: r for r in store.steps("agent")}
        assert rows[2]["parent"] == 0 and store.get_group("g2")["trained_step"] == 2
    finally:
        restarted.close()
        recorder.close()


def test_a_new_run_from_a_step_whose_files_are_there_is_the_way_out_when_they_cannot_be_put_back(tmp_path):
    """docs/training.md: no decision ends the wait, `--init-from NAME@N` (another --model-name) does."""
    from trainer.worker import TrainerWorker

    settings = trainer_settings(tmp_path, groups_per_step=1, promote="manual", max_staleness=10, max_rejections=5)
    recorder = Recorder(settings)
    recorder.group("g1", [1.0, 0.0])
    worker = TrainerWorker(settings)
    worker.start()
    try:
        assert worker.run(max_steps=1) == 1
        step_1 = _params(worker)
    finally:
        worker.close()
    recorder.store.decide_step("agent", 1, "rejected", {"by": "test"})  # step 0 serves; the weights hold step 1
    shutil.rmtree(settings.checkpoints_dir() / "0000")  # gone for good
    recorder.close()

    again = trainer_settings(tmp_path, groups_per_step=1, promote="manual", model_name="agent-2", init_from="agent@1")
    successor = Recorder(again)
    successor.group("h1", [0.0, 1.0], step=0)
    restarted = TrainerWorker(again)
    restarted.start()
    try:
        assert restarted.weights_step == 0 and _same(_params(restarted), step_1), "step 0 of agent-2 is agent@1"
        assert restarted.run(max_steps=1) == 1
        assert successor.store.get_group("h1")["trained_step"] == 1
    finally:
        restarted.close()
        successor.close()
