"""`rlproxy train --nproc N`: the N ranks started by torchrun's own launcher on this machine.

The launcher (`torch.distributed.run`, what the `torchrun` command runs) starts N copies of the
same `rlproxy train` command with RANK, WORLD_SIZE and the rendezvous in their environment, so a
rank runs exactly what it would under `torchrun --nnodes M` across machines. It watches them:
when one exits with an error it stops the others and reports which rank failed and why. The
rendezvous and gloo's sockets stay on the loopback interface.
"""

from __future__ import annotations

import logging
import os
import socket

from gateway.errors import RLProxyError

log = logging.getLogger("rlproxy.trainer")


class RanksFailed(RLProxyError):
    """A training rank exited with an error; the launcher stopped the others."""

    status_code = 500
    error_type = "server_error"


def _free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(argv: list[str], nproc: int) -> int:
    """Run `python -m gateway.cli <argv>` on `nproc` ranks; 0 when every rank ended well."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # gloo picks the interface the host name resolves to; one machine's ranks meet on loopback.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    args = get_args_parser().parse_args(
        [
            "--nnodes=1",
            f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{_free_loopback_port()}",
            "--max-restarts=0",
            "--monitor-interval=0.5",
            "-m",
            "gateway.cli",
        ]
    )
    args.training_script_args = list(argv)  # set, not parsed: torchrun's parser would read them as its own
    log.info("starting %d training ranks (torch.distributed, rendezvous on 127.0.0.1)", nproc)
    try:
        run(args)
    except ChildFailedError as exc:
        failures = "; ".join(
            f"rank {rank} exit code {failure.exitcode}" + (f" ({failure.message})" if failure.message else "")
            for rank, failure in sorted(exc.failures.items())
        )
        raise RanksFailed(
            f"training rank(s) failed and the launcher stopped the others: {failures}. See the ranks' log "
            "above; a restart continues from the last step"
        ) from None
    return 0
