"""`rlproxy train --nproc N`: N ranks of the same `rlproxy train` command on this machine.

Each rank gets what torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), so it runs exactly what it runs under `torchrun --nnodes M` across
machines. On one machine nothing listens beyond loopback: the launcher binds the rendezvous
socket to 127.0.0.1 and hands it to rank 0's `TCPStore` (`RLPROXY_STORE_FD`; the others connect
to it: `RLPROXY_LOOPBACK_STORE`), where torchrun's
agent would listen on every interface (its store answers anyone who can reach the port), and
gloo's sockets are kept on `lo`.

The launcher watches the ranks as torchrun's agent does: when one exits with an error it stops
the others (SIGTERM, then SIGKILL after `STOP_GRACE_SECONDS`) and reports each rank's exit. A
SIGTERM or SIGINT to the launcher goes on to the ranks: rank 0 finishes its step and tells the
others to stop.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

from gateway.children import die_with_parent
from gateway.errors import TRY_AGAIN_EXIT, RLProxyError

log = logging.getLogger("rlproxy.trainer")

STORE_FD_ENV = "RLPROXY_STORE_FD"
"""Rank 0's inherited listening socket for the rendezvous store (set by `launch` only)."""

STOP_GRACE_SECONDS = 30.0
"""How long stopped ranks get to end their step before they are killed (torchrun's default too)."""


class RanksFailed(RLProxyError):
    """A training rank exited with an error; the launcher stopped the others."""

    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str, first_code: int | None) -> None:
        super().__init__(message)
        # A rank that refused its settings (exit 2) refuses them again on a restart: exit 2 too; one
        # refused for the moment (75: another trainer holds the lock): 75, tried again for as long as
        # it takes; a rank that crashed or was killed: 1, started again until it crashes too often.
        self.exit_code = 2 if first_code == 2 else TRY_AGAIN_EXIT if first_code == TRY_AGAIN_EXIT else 1


def _exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"exit code {code} ({signal.Signals(-code).name})"
    return f"exit code {code}"


def launch(argv: list[str], nproc: int) -> int:
    """Run `python -m gateway.cli <argv>` on `nproc` ranks; 0 when every rank ended well."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(max(64, nproc))
    port = listener.getsockname()[1]
    base = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        "RLPROXY_LOOPBACK_STORE": "1",
    }
    log.info("starting %d training ranks (torch.distributed, rendezvous on 127.0.0.1:%d)", nproc, port)
    procs: list[subprocess.Popen] = []
    try:
        for rank in range(nproc):
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            fds: tuple[int, ...] = ()
            if rank == 0:
                env[STORE_FD_ENV] = str(listener.fileno())
                fds = (listener.fileno(),)
            cmd = [sys.executable, "-m", "gateway.cli", *argv]
            procs.append(subprocess.Popen(cmd, env=env, pass_fds=fds, preexec_fn=die_with_parent))
    finally:
        listener.close()  # rank 0 holds its own copy
    return _watch(procs)


def _watch(procs: list[subprocess.Popen]) -> int:
    stopping: list[float] = []  # when the ranks were asked to stop
    first_failed: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if stopping:  # a second signal: at once
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            return
        stopping.append(time.monotonic())
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while any(proc.poll() is None for proc in procs):
            failed = [p for p in procs if p.returncode not in (None, 0)]
            if failed and not stopping:
                first_failed.append(procs.index(failed[0]))
                stopping.append(time.monotonic())
                for proc in procs:
                    if proc.poll() is None:
                        proc.terminate()
            if stopping and time.monotonic() - stopping[0] > STOP_GRACE_SECONDS:
                for proc in procs:
                    if proc.poll() is None:
                        proc.kill()
            time.sleep(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    codes = [proc.returncode for proc in procs]
    if all(code == 0 for code in codes):
        return 0
    summary = "; ".join(f"rank {rank} {_exit(code)}" for rank, code in enumerate(codes))
    raise RanksFailed(
        f"training ranks ended with errors ({summary})"
        + (f"; rank {first_failed[0]} failed first and the launcher stopped the others" if first_failed else "")
        + ". See the ranks' log above; a restart continues from the last step",
        codes[first_failed[0]] if first_failed else next((code for code in codes if code), None),
    )
