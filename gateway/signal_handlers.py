"""Signal handlers a command installs for as long as it runs, and no longer."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

Handler = Callable[[int, FrameType | None], Any]


@contextmanager
def handling(handlers: dict[signal.Signals, Handler]) -> Iterator[None]:
    """Install `handlers` (signal -> handler), then put back the ones they replaced, however the
    block ends. `rlproxy train` and `rlproxy demo` run in-process too (tests, a library caller):
    their handlers left behind made the caller's process ignore Ctrl-C and SIGTERM for good."""
    previous = {signum: signal.getsignal(signum) for signum in handlers}
    try:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        yield
    finally:
        for signum, handler in previous.items():
            # None: a handler installed outside Python, which cannot be put back; the default is the nearest
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
