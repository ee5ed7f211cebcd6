"""A managed vLLM's log file (`STATE/vllm.log`): its tail, and its size kept bounded.

vLLM writes a line for every HTTP request it answers (the gateway's calls, and the health
probe every two seconds) to its stdout, which is this file: a gateway that runs for weeks
grew it without end. Once it passes `MAX_BYTES` its content moves to `vllm.log.1` (the
previous one replaced) and the file starts again from empty, as logrotate's copytruncate
does. The child opened it in append mode, so its next line lands at the new end, not at its
old offset. A line written between the copy and the truncation is lost.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

MAX_BYTES = 64 * 2**20
TAIL_BYTES = 64 * 2**10  # what `tail` reads: the end of a long log, never all of it


def rotated(path: Path) -> Path:
    return path.with_name(path.name + ".1")


def trim(path: Path, max_bytes: int = MAX_BYTES) -> bool:
    """Move the log to `vllm.log.1` and empty it if it is over `max_bytes`; whether it did."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
        shutil.copyfile(path, rotated(path))
        os.truncate(path, 0)
    except OSError:  # gone, or a full disk: the log is not worth failing the engine for
        return False
    return True


def tail(path: Path, lines: int = 20) -> str:
    """The last `lines` lines (at most `TAIL_BYTES` of them)."""
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - TAIL_BYTES))
            data = handle.read()
    except OSError:
        return "(no log)"
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])
