"""A SQLite store restored from a backup: by replacing its file (taking effect at a restart), or
into the running store through SQLite's backup API (at once)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sqlite3

import pytest

from gateway.errors import StoreUnavailable
from gateway.store.sqlite import SQLiteStore


def _record(store: SQLiteStore, step: int) -> None:
    store.insert_step("agent", step, f"/nowhere/{step:04d}", {}, [])


def _steps(store: SQLiteStore) -> list[int]:
    return [row["step"] for row in store.steps("agent")]


def _backup(db, to) -> None:
    with contextlib.closing(sqlite3.connect(db)) as source, contextlib.closing(sqlite3.connect(to)) as copy:
        source.backup(copy)


def test_a_file_restored_over_the_running_store_is_what_a_restart_opens(tmp_path):
    """The operator moves the store's file aside and puts a backup in its place while the gateway runs.
    Writes are refused (the message says a restore takes effect at a restart), but at the restart the
    WAL the replaced file left beside the backup (SQLite keeps it when the file moved) was read over it:
    the restore was undone, steps 1 and 2 back as if never restored. Now the stop removes that WAL once
    its content is in the replaced file, which keeps everything it acknowledged."""
    db, backup = tmp_path / "rlproxy.db", tmp_path / "backup.db"
    store = SQLiteStore(db)
    _record(store, 0)
    _backup(db, backup)
    _record(store, 1)
    _record(store, 2)
    db.rename(tmp_path / "before-restore.db")
    shutil.copy(backup, db)
    with pytest.raises(StoreUnavailable) as refused:
        _record(store, 3)
    assert refused.value.cause == "moved"
    assert f"its file {db} was replaced while the gateway ran" in refused.value.message
    assert "A restore takes effect at a restart: stop the gateway and the trainer" in refused.value.message
    asyncio.run(store.close())

    restarted = SQLiteStore(db)
    assert _steps(restarted) == [0]  # the backup's, not the replaced file's
    _record(restarted, 1)
    assert _steps(restarted) == [0, 1]
    asyncio.run(restarted.close())
    # The file moved aside holds every step it acknowledged, its WAL's included.
    with contextlib.closing(sqlite3.connect(tmp_path / "before-restore.db")) as old:
        assert [row[0] for row in old.execute("SELECT step FROM steps ORDER BY step")] == [0, 1, 2]


def test_a_restore_into_the_running_store_takes_effect_at_once(tmp_path):
    """`sqlite3 rlproxy.db ".restore backup.db"` (SQLite's backup API into the live file): the same
    file, so no restart; the store reads the backup's rows and goes on recording."""
    db, backup = tmp_path / "rlproxy.db", tmp_path / "backup.db"
    store = SQLiteStore(db)
    _record(store, 0)
    _backup(db, backup)
    _record(store, 1)
    _backup(backup, db)
    assert _steps(store) == [0]
    _record(store, 1)
    assert _steps(store) == [0, 1]
    asyncio.run(store.close())


def test_a_wal_not_copied_whole_into_the_replaced_file_is_left_and_said(tmp_path, caplog):
    """A reader of the replaced file still on an old snapshot (an export, a sqlite3 shell in BEGIN)
    keeps the checkpoint from copying the newest writes into it: the WAL holding them stays, and the
    log says to remove it by hand once every process has stopped, rather than lose them."""
    db, backup = tmp_path / "rlproxy.db", tmp_path / "backup.db"
    store = SQLiteStore(db, busy_timeout=0.05)
    _record(store, 0)
    _backup(db, backup)
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as reader:
        reader.execute("BEGIN")
        assert reader.execute("SELECT COUNT(*) FROM steps").fetchone() == (1,)  # its snapshot: step 0 only
        _record(store, 1)
        db.rename(tmp_path / "before-restore.db")
        shutil.copy(backup, db)
        caplog.set_level("ERROR", logger="rlproxy.store")
        asyncio.run(store.close())
        assert (tmp_path / "rlproxy.db-wal").exists()
        assert f"remove {db}-wal and {db}-shm before starting on the file now there" in caplog.text
