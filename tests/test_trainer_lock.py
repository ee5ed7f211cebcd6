"""One trainer per model on a shared store: a second one, on another machine (its own state
dir, so its own lock file), is refused at start rather than numbering its steps as the first
does and training diverging weights under one name."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from gateway.errors import ConfigError
from tests.helpers_trainer import trainer_settings
from trainer.worker import TrainerWorker


def test_a_second_trainer_of_one_model_on_a_postgres_store_is_refused_until_the_first_is_gone(postgres_db, tmp_path):
    first = TrainerWorker(trainer_settings(tmp_path / "gpu-node-1", store=postgres_db))
    first.start()  # saves and records step 0
    second = TrainerWorker(trainer_settings(tmp_path / "gpu-node-2", store=postgres_db))
    try:
        with pytest.raises(ConfigError, match="another trainer is training model 'agent' on the store"):
            second.start()
    finally:
        second.close()
    other_model = TrainerWorker(trainer_settings(tmp_path / "gpu-node-2", store=postgres_db, model_name="critic"))
    try:
        other_model.start()  # several models, one trainer each: as deploy/README.md says
    finally:
        other_model.close()
    first.close()  # (a killed trainer's lock goes with its connection)
    second = TrainerWorker(trainer_settings(tmp_path / "gpu-node-2", store=postgres_db))
    try:
        second.start()  # takes over: step 0 from the store, the next step is 1
        assert second.next_step == 1
    finally:
        second.close()
