"""`--store URL` on serve, train and export: the flag parses (never as `--store-sync`), a
PostgreSQL URL selects that backend, export reads from it, and a bad URL is a clean error."""

import asyncio
import json

from gateway.cli import build_parser, main, settings_from_args
from gateway.store.open import open_store
from gateway.store.postgres import PostgresStore
from gateway.store.sqlite import SQLiteStore
from tests.test_store import call


def test_store_is_its_own_flag_on_every_command():
    parser = build_parser()
    for command in ("serve", "train", "export"):
        args = parser.parse_args([command, "--store", "postgresql://db/x"])
        assert args.store == "postgresql://db/x"
        assert not hasattr(args, "store_sync") or command == "export"
    args = parser.parse_args(["serve", "--store-sync", "full"])
    assert args.store_sync == "full" and not hasattr(args, "store")


def test_store_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("RLPROXY_STORE", "postgresql://env/db")
    settings = settings_from_args(build_parser().parse_args(["serve", "--state-dir", str(tmp_path)]))
    assert settings.store == "postgresql://env/db"


def test_default_is_sqlite_under_the_state_dir(tmp_path):
    settings = settings_from_args(build_parser().parse_args(["serve", "--state-dir", str(tmp_path)]))
    store = open_store(settings)
    assert type(store) is SQLiteStore and store.path == tmp_path / "rlproxy.db"
    asyncio.run(store.close())


def test_a_store_url_of_another_kind_is_a_clean_error(tmp_path, capsys):
    assert main(["export", "--store", "mysql://db/x", "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "postgresql://" in capsys.readouterr().err


def test_a_store_that_is_no_url_we_read_is_refused_without_repeating_it(tmp_path, capsys, monkeypatch):
    # `mysql://u:PASSWORD@h/db` went whole to the terminal and the log; `postgresql:/u:PASSWORD@h/db` (one
    # slash) was taken for an SQLite path: the gateway made ./postgresql:/u:PASSWORD@h/ and kept a store
    # of its own there, while its replicas shared the real one.
    monkeypatch.chdir(tmp_path)
    for url in ("mysql://rl:hunter2@db/x", "postgresql:/rl:hunter2@db/x"):
        assert main(["export", "--store", url]) == 2
        err = capsys.readouterr().err
        assert "--store must be a postgresql://USER:PASSWORD@HOST:5432/DB URL or an SQLite file path" in err, err
        assert f"starts with '{url.partition(':')[0]}:'" in err and "hunter2" not in err
    assert list(tmp_path.iterdir()) == []


def test_export_reads_from_postgres(postgres_db, tmp_path):
    store = PostgresStore(postgres_db)
    store.record_call_sync(call(1, "s-exported", group="g"))
    store.close_sync()
    out = tmp_path / "out.jsonl"
    assert main(["export", "--store", postgres_db, "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["s-exported"] and rows[0]["calls"][0]["id"] == "req1"


def test_an_unreachable_store_is_a_clean_error_without_the_password(tmp_path):
    import socket

    import pytest

    from gateway.errors import ConfigError

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once closed
    with pytest.raises(ConfigError) as caught:
        PostgresStore(f"postgresql://user:hunter2@127.0.0.1:{port}/db?connect_timeout=1", timeout=2)
    assert "cannot connect" in caught.value.message and "hunter2" not in caught.value.message


def test_a_password_given_as_a_query_parameter_is_kept_out_of_the_error_too(tmp_path):
    # libpq reads `?password=...` as well as `user:password@`: the message once showed it.
    import socket

    import pytest

    from gateway.errors import ConfigError

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConfigError) as caught:
        PostgresStore(f"postgresql://user@127.0.0.1:{port}/db?password=hunter2&connect_timeout=1", timeout=2)
    message = caught.value.message
    assert "cannot connect" in message and "hunter2" not in message and "password=***" in message


def test_a_store_path_that_is_no_database_is_refused_and_left_as_it_is(tmp_path, capsys):
    # `--store /etc/passwd` made it 0600 (the store's files are made private before SQLite opens
    # them), then failed with "the store file is damaged ... move it away (the gateway starts a new
    # one)". A directory was chmod-ed 0600 too.
    notes, folder = tmp_path / "notes.txt", tmp_path / "folder"
    notes.write_text("mine\n")
    folder.mkdir()
    for path in (notes, folder):
        path.chmod(0o755 if path.is_dir() else 0o644)
        assert main(["train", "--store", str(path), "--state-dir", str(tmp_path / "state"), "--max-steps", "0"]) == 2
        err = capsys.readouterr().err
        assert f"--store {path} is not an SQLite database" in err and "it was left as it is" in err
    assert (notes.stat().st_mode & 0o777, folder.stat().st_mode & 0o777) == (0o644, 0o755)
    assert notes.read_text() == "mine\n"
    # A new file, and an empty one (SQLite's new database), are stores.
    for path in (tmp_path / "new.db", tmp_path / "empty.db"):
        if path.name == "empty.db":
            path.touch()
        asyncio.run(open_store(str(path)).close())
        assert path.read_bytes().startswith(b"SQLite format 3\x00")
