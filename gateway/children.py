"""Child processes tied to the life of the process that started them (the gateway's vLLM,
its trainer, the demo's trainer): they must not outlive it, even when it is SIGKILLed."""

from __future__ import annotations

import contextlib
import signal
import sys


def die_with_parent() -> None:  # pragma: no cover - runs in the child, between fork and exec
    """`preexec_fn` of a child: ask Linux to SIGTERM it when its parent dies, by any signal
    (PR_SET_PDEATHSIG). Elsewhere a no-op: the shared process group is then the only tie."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
