"""Which vLLM replica a call goes to (pure functions; the replica set does the I/O).

`affinity` (the default) keeps a session on one replica, so that its growing multi-turn prompt
finds its prefix in that replica's KV cache: rendezvous hashing of the session key (Thaler and
Ravishankar 1998: every replica scores hash(key, replica), the highest wins), so adding or
losing a replica moves only the sessions that were on it. A load bound keeps one hot session
(or an unlucky hash) from pinning a replica: as in consistent hashing with bounded loads
(Mirrokni, Thorup and Zadimoghaddam 2018), a replica takes a call only while its calls in
flight are under `ceil(c * (total + 1) / replicas)`, else the key's next replica in its
rendezvous order does. A call without a session (RULER's self-judge) goes to the least loaded.

`least-loaded` and `round-robin` ignore the session, for comparison (bench/replicas.py).

Every policy returns a full preference order over the replicas that may serve the call: the
replica set sends the call to the first, and to the next when one is down or never answered.
"""

from __future__ import annotations

import hashlib
import itertools
import math

POLICIES = ("affinity", "least-loaded", "round-robin")
LOAD_BOUND = 1.25
"""c in the load bound: a replica takes a session's call while its load is under c times the
mean (plus the call). 1.25 is the paper's example value: at most 25 % above the mean."""


def score(key: str, replica: str) -> int:
    """The rendezvous weight of `replica` for `key` (stable across processes and restarts)."""
    return int.from_bytes(hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest(), "big")


def rendezvous(key: str, names: list[str]) -> list[int]:
    """Indices of `names`, the key's own replica first."""
    return sorted(range(len(names)), key=lambda i: score(key, names[i]), reverse=True)


def least_loaded(loads: list[int], candidates: list[int]) -> list[int]:
    """`candidates` by load, ties by index."""
    return sorted(candidates, key=lambda i: (loads[i], i))


def bounded(order: list[int], loads: list[int], bound: float = LOAD_BOUND) -> list[int]:
    """`order` with its first replica under the load bound moved to the front."""
    if not order:
        return order
    total = sum(loads[i] for i in order)
    cap = math.ceil(bound * (total + 1) / len(order))
    first = next((i for i in order if loads[i] < cap), order[0])
    return [first, *(i for i in order if i != first)]


class Router:
    """A routing policy over replicas named `names` (their order is their index)."""

    def __init__(self, policy: str, names: list[str], bound: float = LOAD_BOUND):
        if policy not in POLICIES:
            raise ValueError(f"routing policy {policy!r} is not one of {', '.join(POLICIES)}")
        self.policy = policy
        self.names = names
        self.bound = bound
        self._turn = itertools.count()

    def order(self, key: str | None, loads: list[int], eligible: list[int]) -> list[int]:
        """The replicas among `eligible` to try for a call keyed `key`, in order."""
        if not eligible:
            return []
        if self.policy == "round-robin":
            start = next(self._turn) % len(eligible)
            return eligible[start:] + eligible[:start]
        if self.policy == "least-loaded" or key is None:
            return least_loaded(loads, eligible)
        allowed = set(eligible)
        return bounded([i for i in rendezvous(key, self.names) if i in allowed], loads, self.bound)
