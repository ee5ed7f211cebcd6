"""Adapters through the store: the trainer's step carries its checkpoint files (content-addressed,
checksummed); a replica fetches them into its own models dir and refuses files that do not match."""

import hashlib
from pathlib import Path

import pytest

from gateway.store.files import StepFilesError, materialize, remove_abandoned_fetches
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
    for name in ("adapter_config.json", "adapter_model.safetensors"):
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


def test_a_replica_fetches_only_the_adapter_and_a_trainer_restores_everything(postgres_db, tmp_path):
    """A replica fetches what its engine reads (the PEFT adapter), not the optimizer state (twice
    the adapter's size) nor the trainer's files: it copied all of them for every step it served.
    A trainer resuming on another machine still gets the whole checkpoint."""
    trainer, replica = PostgresStore(postgres_db), PostgresStore(postgres_db)
    ckpt = _checkpoint(tmp_path / "trainer" / "checkpoints" / "0001", b"weights" * 1000)
    (ckpt / "optimizer.pt").write_bytes(b"adam moments" * 2000)
    (ckpt / "settings.json").write_text("{}")
    trainer.insert_step("agent", 1, str(ckpt), {}, [])
    served = Path(replica.fetch_step_files("agent", 1, str(ckpt), tmp_path / "replica" / "models"))
    assert sorted(p.name for p in served.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (served / "adapter_model.safetensors").read_bytes() == b"weights" * 1000
    (served / "adapter_model.safetensors").write_bytes(b"gone bad on disk")  # still checked against the store
    replica.fetch_step_files("agent", 1, str(ckpt), tmp_path / "replica" / "models")
    assert (served / "adapter_model.safetensors").read_bytes() == b"weights" * 1000
    restored = replica.restore_checkpoint("agent", 1, tmp_path / "new-node" / "0001")
    assert sorted(p.name for p in restored.iterdir()) == sorted(p.name for p in ckpt.iterdir())
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


def _recorded(store, root, step: int, weights: bytes, **kwargs):
    from trainer import checkpoints as ckpts

    ckpt = _checkpoint(ckpts.checkpoint_dir(root, step), weights, step=step)
    store.insert_step("agent", step, str(ckpt), {}, [], **kwargs)
    return ckpt


def _blob_bytes(store) -> int:
    return int(store._query("SELECT COALESCE(SUM(size), 0) AS n FROM blobs")[0]["n"])


def test_keep_checkpoints_bounds_the_blobs_in_the_store_too(postgres_db, tmp_path):
    """`--keep-checkpoints 2` on PostgreSQL: the files of the steps it removes from disk leave the
    database as well (every step's adapter and optimizer state stayed there for ever), and what
    is kept there is what is kept on disk: the newest two, and what NAME serves however old."""
    from trainer.resume import prune_checkpoints

    store, replica = PostgresStore(postgres_db), PostgresStore(postgres_db)
    root = tmp_path / "trainer" / "checkpoints"
    _recorded(store, root, 0, b"step 0 weights" * 1000)
    for step in range(1, 7):
        # --promote manual: every candidate turned down, so step 0 still serves.
        _recorded(store, root, step, bytes([step]) * 14000, state="candidate")
        store.decide_step("agent", step, "rejected", {"by": "test"})
        prune_checkpoints(store, "agent", root, 2, 0)
    on_disk = sorted(int(p.name) for p in root.iterdir())
    assert on_disk == [0, 5, 6]
    listed = {s: replica.step_files("agent", s) for s in range(7)}
    assert [s for s in range(7) if listed[s]] == on_disk
    # Three files a step, the config shared by all: what the kept steps list, nothing more.
    assert _blob_bytes(replica) == len('{"r": 8}') + 14000 * 3 + sum(len(f'{{"step": {s}}}') for s in on_disk)
    models = tmp_path / "replica" / "models"
    for step in on_disk:  # a replica still loads every kept step, checked against its checksums
        local = replica.fetch_step_files("agent", step, str(root / f"{step:04d}"), models)
        assert (tmp_path / "replica" / "models" / "agent" / "store" / f"{step:04d}" / "adapter_config.json").is_file()
        assert local.endswith(f"{step:04d}")
    assert replica.restore_checkpoint("agent", 3, tmp_path / "restored") is None  # removed: none half fetched
    store.close_sync()
    replica.close_sync()


def test_a_blob_another_step_lists_stays_when_a_prune_drops_it(postgres_db, tmp_path):
    """Blobs are content-addressed: a file of a pruned step that another model's step also holds
    (the same --init-from adapter, an unchanged config) stays with that step."""
    store = PostgresStore(postgres_db)
    shared = b"the same weights" * 1000
    other = _checkpoint(tmp_path / "other" / "0001", shared, step=1)
    store.insert_step("other", 1, str(other), {}, [])
    root = tmp_path / "agent"
    _recorded(store, root, 0, shared)
    for step in (1, 2):
        _recorded(store, root, step, bytes([step]) * 1000)
    assert store.prune_step_files("agent", 1, set()) == [0]  # step 1 is what a rollback of step 2 serves
    restored = store.restore_checkpoint("other", 1, tmp_path / "restored")
    assert restored is not None and (restored / "adapter_model.safetensors").read_bytes() == shared
    store.close_sync()


def test_a_blob_collected_while_a_step_is_recorded_is_stored_again(postgres_db, tmp_path, monkeypatch):
    """Trainer A uploads its step's files (the weights are already stored, listed only by model B's
    old step), then B's trainer prunes that step and collects the blob before A's step row lists it:
    A's step is recorded all the same, with every file it lists in the store."""
    from gateway.store import files

    trainer_a, trainer_b = PostgresStore(postgres_db), PostgresStore(postgres_db)
    weights = b"weights both trainers wrote" * 1000
    trainer_b.insert_step("b", 0, str(_checkpoint(tmp_path / "b" / "0000", weights, step=0)), {}, [])
    for step in (1, 2):  # step 0 older than the step NAME serves (2) and what a rollback serves again (1)
        trainer_b.insert_step(
            "b", step, str(_checkpoint(tmp_path / "b" / f"{step:04d}", b"newer" * 1000, step=step)), {}, []
        )
    upload = files.upload_blobs

    def upload_then_b_prunes(conn, directory):
        listing = upload(conn, directory)  # finds the weights stored: nothing sent
        assert trainer_b.prune_step_files("b", 1, set()) == [0]  # B's step 0 goes, its blob with it
        return listing

    monkeypatch.setattr(files, "upload_blobs", upload_then_b_prunes)
    ckpt = _checkpoint(tmp_path / "a" / "0001", weights, step=1)
    trainer_a.insert_step("a", 1, str(ckpt), {}, [])
    monkeypatch.setattr(files, "upload_blobs", upload)
    restored = trainer_b.restore_checkpoint("a", 1, tmp_path / "restored")
    assert restored is not None and (restored / "adapter_model.safetensors").read_bytes() == weights
    trainer_a.close_sync()
    trainer_b.close_sync()


def test_an_export_of_a_step_pruned_from_the_store_names_the_steps_it_keeps(postgres_db, tmp_path):
    """`rlproxy export-model agent@1 --store postgresql://...` on a machine without the checkpoints,
    after --keep-checkpoints dropped step 1's files: a clear 'removed', with the steps the store
    can still give, not a traceback nor every step recorded."""
    from gateway.errors import NotFound
    from gateway.export.model import find_checkpoint
    from gateway.settings import Settings

    store = PostgresStore(postgres_db)
    root = tmp_path / "trainer"
    for step in range(4):
        _recorded(store, root, step, bytes([step]) * 100)
    assert store.prune_step_files("agent", 2, set()) == [0, 1]
    store.close_sync()
    elsewhere = Settings(state_dir=tmp_path / "elsewhere", store=postgres_db)
    with pytest.raises(NotFound, match=r"nor in the store \(--keep-checkpoints .*steps with a checkpoint: 2, 3$"):
        find_checkpoint(elsewhere, "agent", 1, tmp_path / "fetched")
    with pytest.raises(NotFound, match=r"no checkpoint for step 7 .*\(steps with one: 2, 3\)$"):
        find_checkpoint(elsewhere, "agent", 7, tmp_path / "fetched")
    assert find_checkpoint(elsewhere, "agent", 3, tmp_path / "fetched").step == 3


def test_a_prune_waits_for_a_step_being_recorded_and_keeps_the_blob_it_lists(postgres_db, tmp_path):
    """The other order: A's step transaction has listed a stored blob (not committed yet) when B's
    prune would collect it. The prune waits for that transaction, then sees the list and keeps
    the blob (it failed on the foreign key, or, had it gone first, A's step lost a file)."""
    import threading
    import time

    import psycopg

    from gateway.store import files
    from gateway.store.postgres_conn import PgConn

    trainer_b = PostgresStore(postgres_db)
    weights = b"weights both trainers wrote" * 1000
    trainer_b.insert_step("b", 0, str(_checkpoint(tmp_path / "b" / "0000", weights, step=0)), {}, [])
    for step in (1, 2):  # step 0 older than the step NAME serves (2) and what a rollback serves again (1)
        trainer_b.insert_step(
            "b", step, str(_checkpoint(tmp_path / "b" / f"{step:04d}", b"newer" * 1000, step=step)), {}, []
        )
    a_dir = _checkpoint(tmp_path / "a" / "0001", weights, step=1)
    pruned: list = []

    def prune() -> None:
        try:
            pruned.append(trainer_b.prune_step_files("b", 1, set()))
        except Exception as exc:  # noqa: BLE001 - the test's assertion says what it was
            pruned.append(exc)

    with psycopg.connect(postgres_db) as trainer_a, psycopg.connect(postgres_db, autocommit=True) as watcher:
        with trainer_a.transaction():
            listing = files.upload_blobs(PgConn(trainer_a), a_dir)
            files.write_file_list(PgConn(trainer_a), "a", 1, listing, a_dir)
            thread = threading.Thread(target=prune)
            thread.start()
            # Committed once B's prune waits on this transaction (a lock it asked for, not granted).
            while not watcher.execute("SELECT 1 FROM pg_locks WHERE NOT granted").fetchone() and thread.is_alive():
                time.sleep(0.01)
        thread.join()
    assert pruned == [[0]]
    restored = trainer_b.restore_checkpoint("a", 1, tmp_path / "restored")
    assert restored is not None and (restored / "adapter_model.safetensors").read_bytes() == weights
    trainer_b.close_sync()


def test_init_from_a_step_in_the_store_leaves_no_copy_of_it_behind(postgres_db, tmp_path):
    """`rlproxy serve --init-from sft@4 --store postgresql://...` on a machine without sft's
    checkpoints: the step is fetched to check it and to seed step 0, then goes; a copy under
    STATE/models/sft/store/ stayed there for good (no replica of 'sft' runs here to remove it)."""
    import json

    from gateway.settings import Settings
    from gateway.trainer_process import check_init_from
    from trainer import checkpoints as ckpts
    from trainer.resume import init_source

    here = Settings(state_dir=tmp_path / "new-node", store=postgres_db, model_name="rl", init_from="sft@4")
    store = PostgresStore(postgres_db)
    ckpt = _checkpoint(tmp_path / "sft-node" / "checkpoints" / "0004", b"sft weights" * 100, step=4)
    (ckpt / "settings.json").write_text(json.dumps(here.public_dict()))
    (ckpt / "optimizer.pt").write_bytes(b"adam moments")  # step 0 starts a fresh optimizer: not fetched
    store.insert_step("sft", 4, str(ckpt), {}, [])
    check_init_from(store, here)
    with init_source(store, here) as source:
        assert ckpts.is_complete(source)
        assert (source / "adapter_model.safetensors").read_bytes() == b"sft weights" * 100
        assert not (source / "optimizer.pt").exists()
    assert not source.exists()
    assert not (here.models_dir / "sft").exists()
    store.close_sync()


def test_init_from_a_step_in_the_store_fetches_its_adapter_once(postgres_db, tmp_path, monkeypatch):
    """`rlproxy serve --trainer auto --init-from sft@4 --store postgresql://...`: the gateway's check before
    the trainer starts read every file of the step from the database, then the trainer fetched them all
    again to seed step 0. The check reads the step's settings only; its shape is still refused."""
    import json

    from gateway.errors import ConfigError
    from gateway.settings import Settings
    from gateway.store import files
    from gateway.trainer_process import check_init_from
    from trainer.resume import init_source

    here = Settings(state_dir=tmp_path / "new-node", store=postgres_db, model_name="rl", init_from="sft@4")
    store = PostgresStore(postgres_db)
    weights = b"sft weights" * 100
    ckpt = _checkpoint(tmp_path / "sft-node" / "checkpoints" / "0004", weights, step=4)
    (ckpt / "settings.json").write_text(json.dumps(here.public_dict()))
    store.insert_step("sft", 4, str(ckpt), {}, [])
    read = files.read_blob
    reads: list[str] = []
    monkeypatch.setattr(files, "read_blob", lambda query, digest: reads.append(digest) or read(query, digest))
    check_init_from(store, here)  # the gateway's, before it starts the trainer
    with init_source(store, here) as source:  # the trainer's, seeding step 0
        assert (source / "adapter_model.safetensors").read_bytes() == weights
    assert reads.count(hashlib.sha256(weights).hexdigest()) == 1
    other_rank = here.model_copy(update={"lora_rank": here.lora_rank * 2})
    with pytest.raises(ConfigError, match=rf"lora_rank {here.lora_rank} \(here {here.lora_rank * 2}\)"):
        check_init_from(store, other_rank)
    assert reads.count(hashlib.sha256(weights).hexdigest()) == 1
    store.close_sync()


def test_what_a_killed_fetch_left_goes_at_the_next_fetch_but_a_running_one_is_left_alone(postgres_db, tmp_path):
    """A replica killed while it fetched a step left `store/.tmp-NNNN-...` with the files written so
    far, and nothing ever removed it. The next fetch on that machine (a gateway's first at its
    start too) removes it; a fetch still running in another process keeps its directory."""
    import signal
    import subprocess
    import sys

    trainer = PostgresStore(postgres_db)
    for step in (1, 2):
        checkpoint = _checkpoint(tmp_path / "trainer" / f"{step:04d}", bytes([step]) * 100)
        trainer.insert_step("agent", step, str(checkpoint), {}, [])
    models = tmp_path / "replica" / "models"
    store_dir = models / "agent" / "store"
    # Another replica process, stopped half-way through step 1's files (each read waits for ever).
    fetching = f"""
import sys, time
from pathlib import Path
from gateway.store import files
from gateway.store.postgres import PostgresStore
read = files.read_blob
def slow(query, digest):
    data = read(query, digest)
    print("fetching", flush=True)
    time.sleep(600)
    return data
files.read_blob = slow
PostgresStore({postgres_db!r}).fetch_step_files("agent", 1, "/elsewhere", Path({str(models)!r}))
"""
    replica = PostgresStore(postgres_db)
    other = subprocess.Popen([sys.executable, "-c", fetching], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline() == "fetching\n"
        in_flight = [p.name for p in store_dir.iterdir()]
        assert len(in_flight) == 1 and in_flight[0].startswith(".tmp-0001-")
        replica.fetch_step_files("agent", 2, "/elsewhere", models)
        assert sorted(p.name for p in store_dir.iterdir()) == [in_flight[0], "0002"]  # running: kept
        other.send_signal(signal.SIGKILL)
        other.wait()
        replica.fetch_step_files("agent", 2, "/elsewhere", models)
        assert sorted(p.name for p in store_dir.iterdir()) == ["0002"]  # its process gone: removed
    finally:
        other.kill()
        other.wait()
    trainer.close_sync()
    replica.close_sync()


def test_a_fetch_on_a_filesystem_that_locks_no_directories_still_completes(tmp_path, monkeypatch):
    """NFS may refuse an flock on a directory opened to read: the fetch goes on unlocked (it looped
    for ever making directories), and a sweep that cannot lock removes nothing."""
    import errno
    import fcntl

    def refused(fd, operation):
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(fcntl, "flock", refused)
    data = b"weights"
    listing = [("adapter_model.safetensors", hashlib.sha256(data).hexdigest(), len(data))]
    dest = tmp_path / "models" / "agent" / "store" / "0001"
    assert materialize(lambda digest: data, listing, dest) == dest
    assert (dest / "adapter_model.safetensors").read_bytes() == data
    (dest.parent / ".tmp-0002-1").mkdir()  # someone's fetch, dead or alive: no lock can tell
    remove_abandoned_fetches(dest.parent)
    assert sorted(p.name for p in dest.parent.iterdir()) == [".tmp-0002-1", "0001"]


def test_the_files_of_a_step_whose_record_is_refused_leave_the_store(postgres_db, tmp_path):
    """A step's files go into the store before its row; the row refused (its step number taken, as
    a restart finds for a checkpoint recorded meanwhile, or a session discarded while it trained),
    its checkpoint is discarded, and its blobs were named by no step for ever: without
    --keep-checkpoints nothing collected them (one adapter and its optimizer state a refusal).
    A file the refused step shares with a recorded one (the config) stays with that one."""
    from gateway.errors import Conflict

    store = PostgresStore(postgres_db)
    recorded = _checkpoint(tmp_path / "a" / "0001", b"recorded weights" * 1000, step=1)
    store.insert_step("agent", 1, str(recorded), {}, [])
    before = _blob_bytes(store)
    refused = _checkpoint(tmp_path / "b" / "0001", b"refused weights" * 1000, step=1)
    (refused / "optimizer.pt").write_bytes(b"adam moments" * 2000)
    with pytest.raises(Conflict, match="recorded already"):
        store.insert_step("agent", 1, str(refused), {}, [])
    assert _blob_bytes(store) == before
    restored = store.restore_checkpoint("agent", 1, tmp_path / "restored")
    assert restored is not None and (restored / "adapter_model.safetensors").read_bytes() == b"recorded weights" * 1000
    store.close_sync()
