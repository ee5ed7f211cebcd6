"""The trainer's ranks as one team: the process group, the device of each rank, the collectives.

Ranks are started by `rlproxy train --nproc N` on this machine (`trainer.distributed.launch`;
`torchrun --nnodes M ...` across machines), which sets RANK, WORLD_SIZE, LOCAL_RANK and the
rendezvous in the environment. Rank 0 leads: it alone talks to the store and writes checkpoints,
and it announces each collective step of the run (`announce`) so the other ranks, which wait in
`receive`, run the same one at the same time (`trainer.follower`).

Commands and scalars travel over a gloo group (CPU tensors) whatever the backend: on CUDA the
gradients go over NCCL, the small control messages stay off the GPU streams.

A collective that fails (a rank died, its connection dropped, nothing came within
`--dist-timeout`) raises `TeamBroken` with the reason: the team cannot take another step together.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from gateway.errors import ConfigError, RLProxyError
from trainer.backends import torch_threads

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from gateway.settings import Settings

log = logging.getLogger("rlproxy.trainer")


class TeamBroken(RLProxyError):
    """A rank of the training team is gone or out of step: the run ends on every rank."""

    status_code = 503
    error_type = "service_unavailable"
    exit_code = 1  # a rank died: a restart trains again from the last step


class TeamNotFormed(TeamBroken):
    """The ranks never became a team: a rendezvous address or a network interface that is wrong,
    which a restart meets again (`rlproxy train` exits 2, as for any setting it refuses)."""

    exit_code = 2


def world_size_from_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> int:
    """WORLD_SIZE as torchrun set it; 1 when this process was not started by it."""
    try:
        return max(1, int(environ.get("WORLD_SIZE", "1")))
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={environ.get('WORLD_SIZE')!r} is not a number of processes") from None


@dataclass
class Team:
    """This process's place in the team and the collectives the trainer uses."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    shard: str
    """"none" (DDP: every rank holds the whole model) or "full" (FSDP2)."""
    control: ProcessGroup | None = None
    """gloo group for commands and scalars (None: the default group is gloo)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Seconds counted since the last `take_seconds`: "sync_backward" (the backward passes that reduce
    the gradients, their compute included) and, under DDP, "allreduce" (each gradient all-reduce from
    its launch to its end, from DDP's communication hook)."""
    _depth: int = field(default=0)
    """Commands under way: what a command does inside is not announced again (every rank does it)."""

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # -- commands (rank 0 -> every rank)
    def announce(self, name: str, *args: Any) -> None:
        """Rank 0: tell the other ranks which collective step comes next (no-op elsewhere, and
        inside a command, whose every rank reaches the same calls by itself)."""
        if self.is_leader and self._depth == 0:
            self._broadcast([name, args])

    @contextlib.contextmanager
    def command(self, name: str, *args: Any, agreed: tuple[type[Exception], ...] = ()) -> Iterator[None]:
        """Announce `name` (rank 0) and run the block as that command on this rank. An exception
        the ranks did not all raise together (`agreed` lists those they do) leaves the others inside
        the command's collectives: it becomes `TeamBroken`, which ends the run."""
        self.announce(name, *args)
        self._depth += 1
        passed_on: tuple[type[Exception], ...] = (TeamBroken, *agreed)
        try:
            yield
        except passed_on:
            raise
        except Exception as exc:
            raise TeamBroken(
                f"training rank {self.rank} of {self.world_size}: the team broke during a {name} step "
                f"({type(exc).__name__}: {_first_line(exc)}): this rank failed, or another one left the team. The step "
                "is not recorded; the run ends on every rank"
            ) from exc
        finally:
            self._depth -= 1

    def receive(self) -> tuple[str, tuple]:
        """Another rank: wait for rank 0's next command."""
        name, args = self._broadcast([None, None])
        return name, tuple(args)

    def _broadcast(self, message: list) -> list:
        import torch.distributed as dist

        with self.collective("waiting for rank 0's next command" if not self.is_leader else "sending a command"):
            dist.broadcast_object_list(message, src=0, group=self.control)
        return message

    # -- scalars (every rank)
    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over the ranks (float64)."""
        import torch
        import torch.distributed as dist

        tensor = torch.tensor(values, dtype=torch.float64)
        with self.collective("summing metrics"):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.control)
        return tensor.tolist()

    def max(self, value: float) -> float:
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.float64)
        with self.collective("agreeing on a maximum"):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.control)
        return float(tensor.item())

    def gather(self, value: float) -> list[float]:
        """Every rank's `value`, in rank order, on every rank."""
        import torch
        import torch.distributed as dist

        out = [torch.zeros(1, dtype=torch.float64) for _ in range(self.world_size)]
        with self.collective("gathering per-rank figures"):
            dist.all_gather(out, torch.tensor([value], dtype=torch.float64), group=self.control)
        return [float(t.item()) for t in out]

    def union(self, keys: object) -> list[str]:
        """The sorted union of every rank's `keys` (a rank with no rows has no metrics of its own)."""
        import torch.distributed as dist

        out: list[list[str]] = [[] for _ in range(self.world_size)]
        with self.collective("gathering metric names"):
            dist.all_gather_object(out, sorted(keys), group=self.control)  # type: ignore[call-overload]
        return sorted({key for rank_keys in out for key in rank_keys})

    def any(self, flag: bool) -> bool:
        """Whether `flag` is true on at least one rank."""
        return self.max(1.0 if flag else 0.0) > 0

    @contextlib.contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Turn a failed collective into `TeamBroken`, naming what the team was doing."""
        try:
            yield
        except TeamBroken:
            raise
        except Exception as exc:  # gloo/NCCL raise RuntimeError subclasses: a peer gone, a time-out
            raise TeamBroken(
                f"training rank {self.rank} of {self.world_size}: the team broke while {what} ({exc}); "
                "a rank died or stalled past --dist-timeout. The step is not recorded; restart the trainer"
            ) from exc

    @contextlib.contextmanager
    def timed(self, what: str) -> Iterator[None]:
        """Count the seconds spent in the block under `what` (`take_seconds`)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.count(what, time.perf_counter() - started)

    def count(self, what: str, seconds: float) -> None:
        self.seconds[what] = self.seconds.get(what, 0.0) + seconds

    def take_seconds(self, what: str) -> float:
        return self.seconds.pop(what, 0.0)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def rank_from_env(world: int, environ: dict[str, str] | os._Environ[str] = os.environ) -> tuple[int, int, int]:
    """RANK, LOCAL_RANK and LOCAL_WORLD_SIZE as torchrun set them, checked with the rendezvous address:
    a WORLD_SIZE set by hand without the rest would otherwise end in torch's traceback (or a KeyError)."""
    # `rlproxy train --nproc` gives its ranks a loopback store of its own; torchrun (env://) needs both.
    needed = ["RANK"] if environ.get("RLPROXY_LOOPBACK_STORE") else ["RANK", "MASTER_ADDR", "MASTER_PORT"]
    missing = [name for name in needed if not environ.get(name)]
    if missing:
        raise ConfigError(
            f"WORLD_SIZE={world} says this trainer is one rank of {world}, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set: start the ranks with `torchrun` (which sets RANK, "
            "LOCAL_RANK, MASTER_ADDR and MASTER_PORT) or `rlproxy train --nproc N`, or unset WORLD_SIZE to train "
            "in one process"
        )
    values = {}
    for name, default in (("RANK", None), ("LOCAL_RANK", environ["RANK"]), ("LOCAL_WORLD_SIZE", str(world))):
        text = environ.get(name) or default
        if not str(text).isdigit():
            raise ConfigError(f"{name}={text!r} is not a rank number (torchrun sets it)")
        values[name] = int(str(text))
    if values["RANK"] >= world:
        raise ConfigError(f"RANK={values['RANK']} is not a rank of WORLD_SIZE={world} (0 to {world - 1})")
    return values["RANK"], values["LOCAL_RANK"], max(1, values["LOCAL_WORLD_SIZE"])


def device_for_rank(settings: Settings, local_rank: int) -> str:
    """The device a rank trains on: `--device cuda` gives rank r the r-th visible GPU."""
    import torch

    if not settings.device.startswith("cuda"):
        return settings.device
    visible = torch.cuda.device_count()
    if local_rank >= visible:
        raise ConfigError(
            f"training rank {local_rank} needs a GPU of its own, but {visible} are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): give --trainer-devices "
            "as many GPUs as --nproc, or fewer processes"
        )
    return f"cuda:{local_rank}"


def join(settings: Settings) -> Team | None:
    """Join the team torchrun started this process in (None when it runs alone). Sets the rank's
    device in `settings.device` terms and its share of the CPU threads."""
    world = world_size_from_env()
    if world <= 1:
        return None
    if settings.backend == "unsloth":
        raise ConfigError("--backend unsloth trains in one process: leave out --nproc (or use --backend peft)")
    rank, local_rank, local_world = rank_from_env(world)
    import torch
    import torch.distributed as dist

    device = torch.device(device_for_rank(settings, local_rank))
    if device.type == "cpu":
        # Each rank its share of this machine's cores: N ranks each spinning one thread per core
        # run many times slower than N ranks of cores/N threads.
        cores = torch_threads() or os.cpu_count() or 1  # the share `serve` or the demo gives the trainer
        torch.set_num_threads(max(1, cores // local_world))
    else:
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=settings.dist_timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    options: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    try:
        with _signals_end_at_once():
            log.info(
                "trainer rank %d of %d: meeting the others at %s (up to --dist-timeout %g s)",
                rank,
                world,
                where,
                settings.dist_timeout,
            )
            if os.environ.get("RLPROXY_LOOPBACK_STORE"):  # `rlproxy train --nproc`: the store listens on loopback only
                store_fd = os.environ.get("RLPROXY_STORE_FD")  # rank 0's: the socket the launcher bound
                fd = int(store_fd) if rank == 0 and store_fd else None
                port = int(os.environ["MASTER_PORT"])
                store = dist.TCPStore(
                    "127.0.0.1", port, world, is_master=rank == 0, timeout=timeout, master_listen_fd=fd
                )
                options.update(store=store, rank=rank, world_size=world)
            dist.init_process_group(backend, timeout=timeout, **options)
            control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    except RuntimeError as exc:  # torch's DistNetworkError / DistStoreError: an address no one answers, a rank missing
        raise not_met(exc, rank, world, where, settings.dist_timeout) from exc
    log.info(
        "trainer rank %d of %d (pid %d) on %s, %s, shard %s", rank, world, os.getpid(), device, backend, settings.shard
    )
    return Team(
        rank=rank, world_size=world, local_rank=local_rank, device=device, shard=settings.shard, control=control
    )


def not_met(exc: BaseException, rank: int, world: int, where: str, timeout: float) -> TeamNotFormed:
    """Why the ranks did not become a team, and what to change. The rendezvous (`where`) is one
    address; after it each rank's gloo (the control group, on GPUs too) listens on an address of
    its own and the others connect to it: GLOO_SOCKET_IFNAME's interface, or, unset, the address
    this machine's hostname resolves to, often 127.0.x.1 (Debian's /etc/hosts), which no other
    machine reaches. Both failures once read "did not all meet at the rendezvous", which had worked."""
    said, who = _first_line(exc), f"training rank {rank} of {world}"
    named = os.environ.get("GLOO_SOCKET_IFNAME")
    interfaces = "`ip -br addr` lists this machine's interfaces"
    if "Unable to find address for" in said:
        return TeamNotFormed(
            f"{who}: GLOO_SOCKET_IFNAME={named!r} names no network interface of this machine ({said}). Set it to "
            f"the interface the ranks reach each other on ({interfaces}), or unset it"
        )
    if "connectFullMesh" in said or "Connect timeout" in said:
        listened = (
            f"GLOO_SOCKET_IFNAME={named}'s address" if named else f"{_hostname_address()} (GLOO_SOCKET_IFNAME unset)"
        )
        return TeamNotFormed(
            f"{who}: the ranks met at {where} but could not connect to each other ({said}). This rank's gloo "
            f"listened on {listened}. Across machines, set GLOO_SOCKET_IFNAME (and, on GPUs, NCCL_SOCKET_IFNAME) "
            f"on every machine to the interface they reach each other on ({interfaces}), and let the ranks' ports "
            "through"
        )
    return TeamNotFormed(
        f"{who}: the ranks did not all meet at {where} within --dist-timeout {timeout:g} s ({said}). Start all "
        f"{world} ranks with the same rendezvous address (torchrun's --rdzv-endpoint, or MASTER_ADDR and "
        "MASTER_PORT), reachable from every machine"
    )


def _hostname_address() -> str:
    """The address gloo takes when GLOO_SOCKET_IFNAME is unset: the hostname's, else loopback."""
    import socket

    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        address = "127.0.0.1"  # gloo's fallback for a hostname that does not resolve
    if address.startswith("127."):
        return f"{address}, where hostname {name!r} resolves: a loopback address, which no other machine reaches"
    return f"{address}, where hostname {name!r} resolves"


@contextlib.contextmanager
def _signals_end_at_once() -> Iterator[None]:
    """While the ranks meet, SIGTERM and SIGINT end this process at once: the wait is inside torch's
    C++ (up to --dist-timeout), where the trainer's Python handler, which lets a step finish, never
    runs, and there is no step to finish yet."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _first_line(exc: BaseException) -> str:
    """What torch says of a failure, one line of it (its messages run to whole C++ traces)."""
    return (str(exc).strip().splitlines() or [""])[0][:500]
