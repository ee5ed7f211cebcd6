"""`python -m gateway.cli ...` with yappi on a signal, for bench/vllm.py's `--profile` (the bench's
switch only: the gateway itself knows nothing of it). SIGUSR1 starts yappi (CPU clock, every
thread, builtins too: time a thread spends waiting is not counted); SIGUSR2 stops it and writes
its function stats, as pstats, to the file named by RLPROXY_BENCH_YAPPI, then that name + ".done".
Until SIGUSR1 the gateway runs as it would without this wrapper.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

# The checkout's root in place of bench/, whose vllm.py would shadow the real `vllm` package.
sys.path[0] = str(Path(__file__).resolve().parents[1])


def _start(*_) -> None:
    import yappi

    yappi.set_clock_type("cpu")
    yappi.clear_stats()
    yappi.start(builtins=True, profile_threads=True)


def _stop(*_) -> None:
    import yappi

    yappi.stop()
    out = os.environ["RLPROXY_BENCH_YAPPI"]
    yappi.get_func_stats().save(out, type="pstat")
    Path(out + ".done").write_text("ok")


if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
    from gateway.cli import main

    sys.argv[0] = "rlproxy"
    sys.exit(main())
