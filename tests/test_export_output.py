"""Where `rlproxy export` and `export-model` write, when writing goes wrong: a disk that fills up
half-way, a reader that stops reading (`| head`), a folder on the path that is a file, a tokenizer
that cannot be loaded. Each is one line and an exit status, never a traceback, and a file that was
there stays whole."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from gateway.cli import main
from gateway.store.sqlite import SQLiteStore
from tests.helpers import call_row
from tests.helpers_trainer import trainer_settings
from tests.test_store_failures import small_tmpfs

SESSIONS = 1500
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    """A store whose export (about 1.5 MB of JSON lines) is larger than a 1 MB disk."""
    state = tmp_path_factory.mktemp("state")
    store = SQLiteStore(state / "rlproxy.db")
    for n in range(SESSIONS):
        store.record_call_sync(
            call_row(
                f"c{n}",
                f"s{n}",
                None,
                request={"model": "agent", "messages": [{"role": "user", "content": f"question {n} " + "x" * 800}]},
                response={"choices": [{"index": 0, "message": {"role": "assistant", "content": "answer"}}]},
            )
        )
    asyncio.run(store.close())
    return state


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_disk_that_fills_up_is_one_line_and_the_previous_export_stays_whole(state_dir, capsys):
    # It was an OSError traceback, and the export was left cut off where the disk filled, over the
    # previous export, reading as a whole one.
    with small_tmpfs(1) as disk:
        previous = disk / "sessions.jsonl"
        previous.write_text('{"id": "from yesterday"}\n')
        assert main(["export", "--state-dir", str(state_dir), "--output", str(previous)]) == 2
        err = capsys.readouterr().err
        assert f"rlproxy export: cannot write --output {previous}: No space left on device" in err, err
        assert f"{previous} is as it was" in err
        assert previous.read_text() == '{"id": "from yesterday"}\n'
        assert sorted(p.name for p in disk.iterdir()) == ["sessions.jsonl"]  # no partial file left

        fresh = disk / "new.jsonl"
        assert main(["export", "--state-dir", str(state_dir), "--output", str(fresh)]) == 2
        assert "No space left on device" in capsys.readouterr().err
        assert not fresh.exists()


def test_a_complete_export_replaces_the_previous_one_and_a_device_is_written_in_place(state_dir, tmp_path, capsys):
    out = tmp_path / "samples.parquet"
    out.write_bytes(b"an older export")
    out.chmod(0o600)  # made private by its owner: the new export stays so
    link = tmp_path / "latest.parquet"
    link.symlink_to(out)
    assert main(["export", "--state-dir", str(state_dir), "--format", "parquet", "--output", str(link)]) == 0
    assert link.is_symlink() and pq.read_table(out).num_rows == SESSIONS  # rendered with the tiny model
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.parquet", "samples.parquet"]

    assert main(["export", "--state-dir", str(state_dir), "--output", os.devnull]) == 0
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)  # written to, not renamed over
    assert f"exported {SESSIONS} sessions" in capsys.readouterr().err


def test_a_reader_that_stops_early_ends_the_export_without_a_traceback(state_dir):
    # `rlproxy export | head` ended in a BrokenPipeError traceback.
    export = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "export", "--state-dir", str(state_dir), "-o", "-"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert export.stdout.read(100).startswith(b'{"id":"s0"')
    export.stdout.close()  # as `head -c 100` does once it has its bytes
    err = export.stderr.read().decode()
    assert export.wait(timeout=120) == 141, err  # 128 + SIGPIPE, as coreutils under `set -o pipefail`
    assert err == "", err


def test_a_base_model_this_machine_cannot_load_is_one_line(state_dir, monkeypatch, capsys, tmp_path):
    # The calls were recorded without token ids (an upstream engine): the sample formats render them
    # with the base model's tokenizer. One not in the cache, offline, was an OSError traceback.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out.jsonl"
    flags = ["--format", "openai", "--base-model", "rlproxy-tests/not-a-model", "--output", str(out)]
    assert main(["export", "--state-dir", str(state_dir), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlproxy export: cannot load the tokenizer of --base-model 'rlproxy-tests/not-a-model'")
    assert "Traceback" not in err and not out.exists()


@pytest.fixture(scope="module")
def trained_state(tmp_path_factory):
    """A state dir holding step 0 of `agent` (the fresh adapter, about 100 kB with its card)."""
    from trainer.worker import run_worker

    settings = trainer_settings(tmp_path_factory.mktemp("trained"))
    run_worker(settings, max_steps=0)
    return settings.state_dir


def test_export_model_under_a_file_is_one_line(trained_state, tmp_path, capsys):
    # It was mkdir's FileExistsError traceback.
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert main(["export-model", "agent", "--state-dir", str(trained_state), "--out", str(notes / "adapter")]) == 2
    err = capsys.readouterr().err
    assert f"rlproxy export-model: cannot write --out {notes / 'adapter'}: a folder on its path is a file" in err
    assert "Traceback" not in err and notes.read_text() == "mine"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_export_model_on_a_disk_that_fills_up_is_one_line_and_leaves_nothing(trained_state, tmp_path, capsys):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        out = disk / "adapter"
        assert main(["export-model", "agent", "--state-dir", str(trained_state), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"cannot write --out {out}: No space left on device; nothing was written" in err, err
        assert list(disk.iterdir()) == []  # not even the hidden work directory
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
