"""Which vLLM replica a call goes to (gateway/engines/vllm/routing.py), against references
computed here: rendezvous order straight from blake2b as the module documents it, the load
bound worked by hand, and what adding or losing a replica moves."""

from __future__ import annotations

import hashlib
import math

import pytest

from gateway.engines.vllm.routing import Router

KEYS = [f"session-{i}" for i in range(2000)]


def names(n: int) -> list[str]:
    return [f"replica-{i}" for i in range(n)]


def reference_order(key: str, replicas: list[str]) -> list[int]:
    """Rendezvous hashing as documented: each replica weighs blake2b-64(key NUL replica), big-endian;
    the heaviest first."""

    def weight(name: str) -> int:
        digest = hashlib.blake2b(key.encode() + b"\0" + name.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    return sorted(range(len(replicas)), key=lambda i: -weight(replicas[i]))


def owner(router: Router, key: str, eligible: list[int]) -> int:
    return router.order(key, [0] * len(router.names), eligible)[0]


def test_an_idle_set_orders_replicas_by_rendezvous_weight():
    for n in (2, 3, 5):
        router = Router("affinity", names(n))
        for key in KEYS[:200]:
            assert router.order(key, [0] * n, list(range(n))) == reference_order(key, names(n))


def test_sessions_spread_over_the_replicas():
    router = Router("affinity", names(4))
    counts = [0] * 4
    for key in KEYS:
        counts[owner(router, key, [0, 1, 2, 3])] += 1
    assert all(400 <= count <= 600 for count in counts), counts  # 500 each, give or take


def test_adding_a_replica_moves_only_the_sessions_the_new_one_takes():
    before, after = Router("affinity", names(4)), Router("affinity", names(5))
    moved = [key for key in KEYS if owner(before, key, [0, 1, 2, 3]) != owner(after, key, [0, 1, 2, 3, 4])]
    assert all(owner(after, key, [0, 1, 2, 3, 4]) == 4 for key in moved)  # none between the old four
    assert 0.15 <= len(moved) / len(KEYS) <= 0.25  # ~1/5: the new replica's share


def test_losing_a_replica_moves_only_the_sessions_that_were_on_it():
    router = Router("affinity", names(4))
    for lost in range(4):
        left = [i for i in range(4) if i != lost]
        moved = [key for key in KEYS if owner(router, key, [0, 1, 2, 3]) != owner(router, key, left)]
        assert all(owner(router, key, [0, 1, 2, 3]) == lost for key in moved)
        assert 0.20 <= len(moved) / len(KEYS) <= 0.30  # ~1/4
        # each moved session goes to its own next choice, so the lost replica's load is spread
        assert all(owner(router, key, left) == reference_order(key, names(4))[1] for key in moved)


def test_a_busy_replica_over_the_load_bound_passes_the_call_to_the_next():
    router = Router("affinity", names(2))
    key = next(k for k in KEYS if reference_order(k, names(2))[0] == 0)
    # loads [2, 0], c = 1.25: cap = ceil(1.25 * (2 + 1) / 2) = ceil(1.875) = 2; replica 0 has 2, not under it
    assert router.order(key, [2, 0], [0, 1]) == [1, 0]
    # loads [1, 0]: cap = ceil(1.25 * 2 / 2) = 2; replica 0 has 1, under it: the session stays
    assert router.order(key, [1, 0], [0, 1]) == [0, 1]
    # the bound applies to the key's own order over three replicas too: the next choice, not the idlest
    key3 = next(k for k in KEYS if reference_order(k, names(3)) == [0, 1, 2])
    # loads [3, 1, 0]: cap = ceil(1.25 * 5 / 3) = 3; replica 0 is at it, replica 1 under it
    assert Router("affinity", names(3)).order(key3, [3, 1, 0], [0, 1, 2]) == [1, 0, 2]


def test_a_hot_session_cannot_take_more_than_the_cap():
    router = Router("affinity", names(2))
    key = KEYS[0]
    home = reference_order(key, names(2))[0]
    loads = [0, 0]
    for _ in range(40):  # 40 calls of one session, none finishing
        cap = math.ceil(1.25 * (sum(loads) + 1) / 2)
        chosen = router.order(key, loads, [0, 1])[0]
        assert loads[chosen] < cap
        loads[chosen] += 1
    assert loads[home] == math.ceil(1.25 * 40 / 2) and loads[1 - home] == 40 - loads[home]  # 25 and 15


def test_least_loaded_breaks_ties_by_index():
    router = Router("least-loaded", names(3))
    assert router.order("any", [1, 0, 0], [0, 1, 2]) == [1, 2, 0]
    assert router.order("any", [0, 0, 0], [2, 1]) == [1, 2]
    assert router.order("other", [5, 2, 9], [0, 1, 2]) == [1, 0, 2]  # the session does not matter


def test_round_robin_cycles_over_the_eligible():
    router = Router("round-robin", names(3))
    firsts = [router.order("same-session", [0, 0, 0], [0, 1, 2]) for _ in range(6)]
    assert firsts == [[0, 1, 2], [1, 2, 0], [2, 0, 1]] * 2
    two = [router.order("same-session", [9, 0, 0], [0, 2])[0] for _ in range(4)]
    assert sorted(two[:2]) == [0, 2] and two[2:] == two[:2]  # both, in turn, whatever their load


def test_a_call_without_a_session_goes_to_the_least_loaded():
    router = Router("affinity", names(3))
    assert router.order(None, [3, 1, 2], [0, 1, 2]) == [1, 2, 0]
    assert router.order(None, [0, 1, 1], [1, 2]) == [1, 2]


def test_only_eligible_replicas_are_tried_and_an_unknown_policy_is_refused():
    router = Router("affinity", names(3))
    for key in KEYS[:100]:
        assert router.order(key, [0, 0, 0], [0, 2]) == [i for i in reference_order(key, names(3)) if i != 1]
    assert router.order("k", [0, 0, 0], []) == []
    with pytest.raises(ValueError, match="affinity, least-loaded, round-robin"):
        Router("random", names(2))
