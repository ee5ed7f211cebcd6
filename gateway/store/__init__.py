"""The store: recorded calls, sessions, groups, rewards and steps; the only channel between
gateway and trainer.

`Store` (`base`) is the interface both backends implement: `SQLiteStore` (`sqlite`, one file,
the embedded default) and `PostgresStore` (`postgres`, shared by many machines). `open_store`
(`open`) picks one from the settings or a URL. What a call row holds is `CallRecord` (`rows`).
"""

from gateway.store.base import Store
from gateway.store.live import LiveRule
from gateway.store.open import open_store
from gateway.store.reads import SessionFilter
from gateway.store.rows import CallRecord, pack_floats, pack_ids, unpack_floats, unpack_ids

__all__ = [
    "CallRecord",
    "LiveRule",
    "SessionFilter",
    "Store",
    "open_store",
    "pack_floats",
    "pack_ids",
    "unpack_floats",
    "unpack_ids",
]
