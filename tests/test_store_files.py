"""Adapters through the store: the trainer's step carries its checkpoint files (content-addressed,
checksummed); a replica fetches them into its own models dir and refuses files that do not match."""

import hashlib

import pytest

from gateway.store.files import StepFilesError, materialize
from gateway.store.postgres import PostgresStore


def _checkpoint(directory, weights: bytes, step: int = 1):
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text('{"r": 8}')
    (directory / "adapter_model.safetensors").write_bytes(weights)
    (directory / "trainer_state.json").write_text(f'{{"step": {step}}}')
    return directory


def test_a_step_travels_through_the_store(postgres_db, tmp_path):
    trainer, replica = PostgresStore(postgres_db), PostgresStore(postgres_db)
    ckpt = _checkpoint(tmp_path / "trainer" / "models" / "agent" / "checkpoints" / "0001", b"\x00weights" * 1000)
    trainer.insert_step("agent", 1, str(ckpt), {}, [])
    models = tmp_path / "replica" / "models"
    local = replica.fetch_step_files("agent", 1, str(ckpt), models)
    assert local == str((models / "agent" / "store" / "0001").resolve())
    for name in ("adapter_config.json", "adapter_model.safetensors", "trainer_state.json"):
        assert (ckpt / name).read_bytes() == (
            tmp_path / "replica" / "models" / "agent" / "store" / "0001" / name
        ).read_bytes()
    # Content-addressed: a second step with the same config stores that file once.
    ckpt2 = _checkpoint(tmp_path / "trainer" / "models" / "agent" / "checkpoints" / "0002", b"\x01other" * 1000, step=2)
    trainer.insert_step("agent", 2, str(ckpt2), {}, [])
    digests = {d for _, d, _ in replica.step_files("agent", 1)} | {d for _, d, _ in replica.step_files("agent", 2)}
    assert replica._query("SELECT COUNT(*) AS n FROM blobs")[0]["n"] == len(digests) == 5
    trainer.close_sync()
    replica.close_sync()


def test_a_file_that_does_not_match_its_checksum_is_never_loaded(tmp_path):
    data = b"weights"
    listing = [("adapter_model.safetensors", hashlib.sha256(data).hexdigest(), len(data))]
    dest = tmp_path / "models" / "agent" / "store" / "0001"
    with pytest.raises(StepFilesError, match="checksum"):
        materialize(lambda digest: b"tampered", listing, dest)
    assert not dest.exists() and list(dest.parent.iterdir()) == []  # nothing half written left
    assert materialize(lambda digest: data, listing, dest) == dest
    (dest / "adapter_model.safetensors").write_bytes(b"changed on disk")  # a local copy gone bad is fetched again
    assert materialize(lambda digest: data, listing, dest) == dest
    assert (dest / "adapter_model.safetensors").read_bytes() == data


def test_names_from_the_store_never_become_paths(tmp_path):
    data = b"x"
    listing = [("../escape", hashlib.sha256(data).hexdigest(), 1)]
    with pytest.raises(StepFilesError, match="plain file name"):
        materialize(lambda digest: data, listing, tmp_path / "d")
    assert not (tmp_path / "escape").exists()


def test_a_trainer_on_a_new_machine_restores_its_checkpoint(postgres_db, tmp_path):
    from trainer import checkpoints as ckpts

    store = PostgresStore(postgres_db)
    ckpt = _checkpoint(tmp_path / "old" / "checkpoints" / "0003", b"w" * 100, step=3)
    (ckpt / "optimizer.pt").write_bytes(b"adam state")
    store.insert_step("agent", 3, str(ckpt), {}, [])
    root = tmp_path / "new" / "checkpoints"
    assert store.restore_checkpoint("agent", 3, ckpts.checkpoint_dir(root, 3)) == root / "0003"
    latest = ckpts.latest_checkpoint(root)
    assert latest is not None and latest.step == 3 and latest.state() == {"step": 3}
    assert (latest.path / "optimizer.pt").read_bytes() == b"adam state"
    assert store.restore_checkpoint("agent", 4, ckpts.checkpoint_dir(root, 4)) is None  # no such step
    store.close_sync()
