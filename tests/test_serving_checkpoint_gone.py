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
