"""The ranks other than 0: each step of the run as rank 0 announces it.

Rank 0 runs the worker (store, selection, checkpoints); before each collective step it
announces what comes next (`Team.announce`), and every other rank runs the same call here on
its own copy or shard of the model. "idle" keeps the others from timing out while rank 0
waits for groups; "stop" ends the run. A step that rank 0 refuses as non-finite is refused on
every rank alike (`NonFiniteStep`, agreed inside the step): the follower goes on to the next
command. Anything else that fails here ends this rank, and the launcher (ours, or torchrun's) then stops the team.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

from trainer.publish import _test_pause as test_pause
from trainer.sft.step import sft_loss, sft_step
from trainer.step import NonFiniteStep, train_step

if TYPE_CHECKING:
    from gateway.settings import Settings
    from trainer.backends.base import TrainingBackend
    from trainer.distributed.team import Team

log = logging.getLogger("rlproxy.trainer")

KEPT_SNAPSHOTS = 4
"""Snapshots a follower keeps (rank 0 nests at most two: the step's and its passes')."""


def run_follower(settings: Settings, team: Team) -> int:
    """A rank other than 0, from start to end: the backend loaded, wrapped with the team's, then
    rank 0's commands followed. Returns the number of steps trained."""
    from trainer.backends import load_backend, rows_within_context

    try:
        backend = load_backend(settings, team)
        # every rank packs the step's samples into the same rows, and rank 0 caps them so
        return follow(backend, rows_within_context(settings, backend))
    finally:
        team.close()


def follow(backend: TrainingBackend, settings: Settings) -> int:
    """Run rank 0's commands until it says stop; returns the number of steps trained."""
    team = backend.team
    if team is None or team.is_leader:
        raise RuntimeError("follow runs on the ranks other than 0 of a team")
    snapshots: OrderedDict[int, dict] = OrderedDict()
    steps = 0
    while True:
        name, args = team.receive()
        if name == "stop":
            log.info("trainer rank %d: rank 0 ended the run after %d step(s)", team.rank, steps)
            return steps
        if name == "idle":
            continue
        if name in ("grpo", "sft"):
            test_pause("follower", steps)
            try:
                if name == "grpo":
                    train_step(backend, args[0], settings, token_budget=args[1])
                else:
                    sft_step(backend, args[0], settings)
                steps += 1
            except NonFiniteStep:
                pass  # refused on every rank: rank 0 logs it
        elif name == "sft_loss":
            sft_loss(backend, args[0], settings)
        elif name == "snapshot":
            snapshot = backend.snapshot()
            if snapshot["id"] != args[0]:
                raise RuntimeError(f"snapshot {snapshot['id']} on rank {team.rank}, {args[0]} on rank 0")
            snapshots[args[0]] = snapshot
            while len(snapshots) > KEPT_SNAPSHOTS:
                snapshots.popitem(last=False)
        elif name == "restore":
            backend.restore(snapshots[args[0]])
        elif name == "save":
            backend.save(None)
        elif name == "load":
            backend.load_full(args[0])
        elif name == "init_optimizer":
            backend.init_optimizer()
        else:
            raise RuntimeError(f"rank 0 announced an unknown command {name!r}: ranks of different rlproxy versions?")
