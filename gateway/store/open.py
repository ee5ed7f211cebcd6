"""Pick the store's backend: `open_store(settings)` or `open_store("postgresql://...")`.

No `--store` (the default): the SQLite file under the state dir, for one machine. A
PostgreSQL URL: `PostgresStore`, shared by any number of gateways and trainers. Either way
the state dir is made private first (`gateway.store.private`). `open_for_reading` is
export's: an SQLite file this user cannot write (read-only media) is opened read-only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from gateway.errors import ConfigError
from gateway.store.base import Store
from gateway.store.private import is_sqlite, private_state_dir
from gateway.store.read_only import writable
from gateway.store.sqlite import SQLiteStore

POSTGRES_SCHEMES = ("postgresql://", "postgres://")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:")  # a URL's scheme; one letter is a Windows drive (C:)
SQLITE_SCHEME = "sqlite:///"  # then the file's path


def looks_like_url(text: str) -> bool:
    """Whether `text` starts with a scheme (`mysql:`, `postgresql:/...`): never an SQLite path to make."""
    return bool(_SCHEME.match(text))


def is_postgres_url(value: str | None) -> bool:
    return bool(value) and str(value).startswith(POSTGRES_SCHEMES)


def open_store(target: Any) -> Store:
    """A `Store` for Settings (its `store` URL, else its SQLite file) or for a URL or path."""
    if hasattr(target, "state_dir"):
        private_state_dir(target.state_dir)  # checkpoints live there whatever the backend
        url = getattr(target, "store", None)
        if not url:
            return SQLiteStore(target.db_path, synchronous=target.store_sync)
        target = url
    return _open_url(str(target), given=isinstance(target, str))


def open_for_reading(target: Path | str) -> Store:
    """The store at `target` (a path or a URL) for a command that only reads it (export): a
    writable SQLite file opens as usual (an older schema is brought up to date), one that
    cannot be written (read-only media, no write permission) opens read-only."""
    text = str(target)
    path = Path(text.removeprefix(SQLITE_SCHEME))
    if "://" not in str(path) and path.is_file() and not writable(path):
        return SQLiteStore(path, read_only=True)
    return _open_url(text, given=isinstance(target, str))


def _open_url(text: str, *, given: bool) -> Store:
    """`given`: a path the user typed (--store), not the state dir's own file."""
    if is_postgres_url(text):
        try:
            from gateway.store.postgres import PostgresStore
        except ImportError as exc:  # psycopg missing
            raise ConfigError(
                f"--store postgresql://... needs the PostgreSQL extra: pip install 'rlproxy[postgres]' ({exc})"
            ) from None
        return PostgresStore(text)
    if text.startswith(SQLITE_SCHEME):
        text = text[len(SQLITE_SCHEME) :]
    elif looks_like_url(text):
        # Not repeated: `mysql://u:PASSWORD@h` went to the terminal and the log whole. And `postgresql:/u:p@h/db`
        # (one slash) was taken for a file path: a gateway meant to share a store kept one of its own there.
        scheme = text.partition(":")[0]
        raise ConfigError(
            f"--store must be a postgresql://USER:PASSWORD@HOST:5432/DB URL or an SQLite file path; the one given "
            f"starts with '{scheme}:' and is neither (an SQLite file named so: ./{scheme}:...)"
        )
    # A --store path (a str; the state dir's own file comes as a Path, and a damaged one of those is said
    # so by SQLite): one that is not a database is more likely a slip than a damaged store.
    if given and not is_sqlite(Path(text)):
        raise ConfigError(
            f"--store {text} is not an SQLite database (nor a new, empty file): give the path of an rlproxy "
            "store, or of a file to create; it was left as it is"
        )
    return SQLiteStore(Path(text))
