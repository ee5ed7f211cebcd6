"""One trainer per model on a shared store: a second one, on another machine (its own state
dir, so its own lock file), is refused at start rather than numbering its steps as the first
does and training diverging weights under one name."""

import os
import threading

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


def _drop_connections(postgres_url: str, database_url: str) -> None:
    """What a restart of PostgreSQL does to every session on the database: gone, their advisory locks with them."""
    import re

    import psycopg

    name = re.match(r"postgres(?:ql)?://[^/]*/([^?]*)", database_url).group(1)
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        )


def test_a_trainer_takes_its_lock_again_after_postgres_dropped_it_and_a_second_one_is_still_refused(
    postgres_url, postgres_db
):
    from gateway.store.postgres import PostgresStore

    first, second = PostgresStore(postgres_db), PostgresStore(postgres_db)
    try:
        lock = first.lock_trainer("agent")
        _drop_connections(postgres_url, postgres_db)
        lock.ensure()  # what the trainer does before each step: the lock is its own again
        with pytest.raises(ConfigError, match="another trainer is training model 'agent'"):
            second.lock_trainer("agent")
        lock.release()
        second.lock_trainer("agent").release()  # gone with its holder, as before
    finally:
        first.close_sync()
        second.close_sync()


class _OneLook(threading.Event):
    """A stop event that ends the worker's loop at its first pause (no groups to train)."""

    def wait(self, timeout: float | None = None) -> bool:
        self.set()
        return True


def test_a_trainer_whose_lock_another_took_while_postgres_was_down_stops_and_records_no_step(
    postgres_url, postgres_db, tmp_path
):
    # The lock went with its connection (PostgreSQL restarted) and a second `rlproxy train` took it:
    # both trained model 'agent', numbering their steps alike.
    first = TrainerWorker(trainer_settings(tmp_path / "gpu-node-1", store=postgres_db))
    first.start()  # step 0
    _drop_connections(postgres_url, postgres_db)
    second = TrainerWorker(trainer_settings(tmp_path / "gpu-node-2", store=postgres_db))
    try:
        second.start()  # the lock was free: it is the second's now
        with pytest.raises(ConfigError, match="lost its lock on model 'agent'.*another trainer took it"):
            first.run(_OneLook())
        with pytest.raises(ConfigError, match="lost its lock on model 'agent'"):  # nor does it record a step
            first.store.insert_step("agent", 1, str(tmp_path / "nowhere"), {}, [])
        assert [s["step"] for s in second.store.steps("agent")] == [0]
    finally:
        first.close()
        second.close()
