"""One cache object per (store, model), for the dashboard's incremental reads between polls."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class PerModel(Generic[T]):
    """A `make()` per store and model, kept as long as the store lives (weakly: a closed app's
    store takes its caches with it)."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._by_store: weakref.WeakKeyDictionary[Any, dict[str, T]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()  # polls run in worker threads, maybe two at once

    def get(self, store: Any, model: str) -> T:
        with self._lock:
            per_model = self._by_store.setdefault(store, {})
            if model not in per_model:
                per_model[model] = self._make()
            return per_model[model]
