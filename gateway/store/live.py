"""Live groups: rewarded sessions that came without a group, gathered by task key as their
rewards arrive (`--live-group-size K`).

Production traffic has no harness to run a task K times: each user's session happens once and
its reward comes later, or never. A session without `X-Group-Id` is recorded under a task key
(`X-Task-Id`, or one derived from its system prompt: `gateway.chat.identity.task_key`); when its
reward arrives it joins the open live group of its key, and the group closes (ready) once it
holds K sessions. Two keys never share a group. A session joins only while the adapter step that
answered it is within `--live-max-staleness` steps of the one training goes on from (along the
parent chain, as the trainer counts: a rejected candidate never counts): a later reward is stored
(the API answers 200) with `trainable: false` and the reason, and the session is never trained.
A member that went stale while its group was filling leaves it, with the same reason. The base
model (a call's step None) is step 0 only where step 0 is the untrained LoRA: in a run seeded with
`--init-from`, a session the base model answered is never trained.

These are ops on the writer's connection, inside `rows.set_reward`'s transaction, which holds
the task key's lock (`gateway.store.locks`): joins of one key take turns, so a session never
joins a group another join has just closed (and a trainer may have claimed).

A join sets aside the members of its group that went stale, but a key that gets no more rewards
has no join: `set_aside_stale` does the same for every open live group of a model when the step
training goes on from moves (the gateway's `StoreUpkeep`), so such a group does not wait for ever
with members the trainer would never train, and they are counted stale where they can be seen.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from dataclasses import dataclass

from gateway.store.lineage import StepParents, further_than, training_step
from gateway.store.locks import for_update, lock_live_key


@dataclass(frozen=True)
class LiveRule:
    """How live groups are formed (`--live-group-size`, `--live-max-staleness`)."""

    group_size: int
    max_staleness: int


# The step that sampled a session: the oldest adapter step among its answered calls of an
# engine that serves our adapters, and how many of them the base model answered (step None);
# an upstream's calls (engine openai) have no step of ours and never go stale.
_SAMPLED_STEP = (
    "SELECT MIN(step), COUNT(*) - COUNT(step) FROM calls WHERE session_id = ? AND status = 'ok' AND engine != 'openai'"
)


# Whether a session has an answered call at all: one whose every call failed (the engine refused
# the prompt, say) has nothing to train, and in a live group it would take the place of one that has.
_ANSWERED = "SELECT COUNT(*) FROM calls WHERE session_id = ? AND status = 'ok'"

NO_ANSWER = (
    "no answered call: every call of the session failed, so it has nothing to train; it joins no live "
    "group (a later answered call and a reward posted again can)"
)

NO_ANSWER_IN_GROUP = (
    "no answered call: every call of the session failed, so it has nothing to train; its group trains "
    "without it (a later answered call can)"
)


def answered(conn: sqlite3.Connection, session_id: str) -> bool:
    """Whether the session has an answered call, something to train (`_ANSWERED`)."""
    return bool(conn.execute(_ANSWERED, (session_id,)).fetchone()[0])


def seeded_from(conn: sqlite3.Connection, model: str) -> str | None:
    """The `--init-from NAME@N` whose adapter is the run's step 0, or None. Only where step 0
    is the fresh adapter (B = 0) is the base model step 0: after `--init-from` a call the
    base model answered was sampled by no step of this run."""
    row = conn.execute("SELECT metrics FROM steps WHERE model = ? AND step = 0", (model,)).fetchone()
    return json.loads(row[0] or "{}").get("init_from") if row is not None else None


@dataclass(frozen=True)
class Policy:
    """Where training stands, as the trainer measures staleness (`trainer.selection.without_stale`):
    the step it goes on from and the parent chain, along which a step turned down never counts."""

    step: int
    parents: StepParents  # read as far down the chain as the sessions asked about need

    @classmethod
    def read(cls, conn: sqlite3.Connection, model: str) -> Policy:
        return cls(training_step(conn, model), StepParents(conn, model))


def stale_reason(
    conn: sqlite3.Connection, session_id: str, policy: Policy, rule: LiveRule, seeded: str | None = None
) -> str | None:
    """Why the session is too stale to train, or None. `seeded`: the run's `seeded_from`."""
    oldest, by_base_model = conn.execute(_SAMPLED_STEP, (session_id,)).fetchone()
    if by_base_model and seeded is not None:
        return (
            f"answered by the base model, which is not this run's policy: its step 0 is the adapter of --init-from "
            f"{seeded} (a gateway started with --init-from waits for it); it is kept, never trained"
        )
    sampled = 0 if by_base_model else oldest  # a cold run's step 0 is the untrained LoRA: the base model
    # Along the parent chain from the step training goes on from, not the newest step number:
    # under --promote canary|manual a rejected candidate moves neither, and counting it made
    # every reward of the step still serving stale after a few rejections.
    if sampled is None or not further_than(policy.parents, policy.step, sampled, rule.max_staleness):
        return None
    return (
        f"stale: answered by step {sampled}, training goes on from step {policy.step} (--live-max-staleness "
        f"{rule.max_staleness}): the policy has moved too far for this reward to train it; it is kept"
    )


def _leave(conn: sqlite3.Connection, session_id: str, reason: str | None, now: float) -> None:
    conn.execute(
        "UPDATE sessions SET group_id = NULL, untrained_reason = ?, updated_at = ? WHERE id = ?",
        (reason, now, session_id),
    )
    conn.execute("UPDATE calls SET group_id = NULL WHERE session_id = ?", (session_id,))


# A live group that can take one more session: not closed, nor full by the `expected_sessions` a
# client's close gave it (`POST /v1/groups/{id}/close`, which leaves `closed` 0: such a group is
# ready, and a trainer may claim and train it, once it holds that many, sessions discarded counted
# as READY_GROUPS counts them), nor claimed, trained or set aside. A session joining one of those
# was answered `trainable: true` and never trained, and so were the next ones of its key.
_CAN_TAKE = (
    "origin = 'live' AND closed = 0"
    " AND claimed_step IS NULL AND trained_step IS NULL AND skipped IS NULL AND failed IS NULL"
    " AND (expected_sessions IS NULL"
    " OR expected_sessions > (SELECT COUNT(*) FROM sessions s WHERE s.group_id = groups.id))"
)
_OPEN = (
    f"SELECT id FROM groups WHERE model = ? AND split = ? AND task_key = ? AND {_CAN_TAKE} ORDER BY created_at LIMIT 1"
)


def _open_group(conn: sqlite3.Connection, model: str, split: str, task_key: str) -> str | None:
    row = conn.execute(
        _OPEN + for_update(conn),  # a close (POST .../close) waits, or is seen
        (model, split, task_key),
    ).fetchone()
    return row[0] if row is not None else None


def join_live_group(
    conn: sqlite3.Connection, session_id: str, model: str, split: str, task_key: str, rule: LiveRule
) -> dict:
    """Put a just-rewarded ungrouped session into the open live group of its task key (made
    when there is none; closed once it holds `rule.group_size` sessions). Returns what the
    reward's answer adds: {"trainable": True, "group_id"} or {"trainable": False, "reason"}."""
    now = time.time()
    policy, seeded = Policy.read(conn, model), seeded_from(conn, model)
    reason = stale_reason(conn, session_id, policy, rule, seeded) if answered(conn, session_id) else NO_ANSWER
    if reason is not None:
        _leave(conn, session_id, reason, now)
        return {"trainable": False, "reason": reason}
    group_id = _open_group(conn, model, split, task_key)
    if group_id is not None:
        members = [r[0] for r in conn.execute("SELECT id FROM sessions WHERE group_id = ?", (group_id,)).fetchall()]
        for member in members:  # the policy moved on while the group was filling
            went_stale = stale_reason(conn, member, policy, rule, seeded)
            if went_stale is not None:
                _leave(conn, member, went_stale, now)
    else:
        group_id = "live-" + uuid.uuid4().hex[:20]
        conn.execute(
            "INSERT INTO groups (id, model, split, created_at, updated_at, origin, task_key)"
            " VALUES (?,?,?,?,?,'live',?)",
            (group_id, model, split, now, now, task_key),
        )
    conn.execute(
        "UPDATE sessions SET group_id = ?, untrained_reason = NULL, updated_at = ? WHERE id = ?",
        (group_id, now, session_id),
    )
    conn.execute("UPDATE calls SET group_id = ? WHERE session_id = ?", (group_id, session_id))
    size = conn.execute("SELECT COUNT(*) FROM sessions WHERE group_id = ? AND discarded = 0", (group_id,)).fetchone()[0]
    if size >= rule.group_size:
        conn.execute(
            "UPDATE groups SET closed = 1, expected_sessions = ?, updated_at = ? WHERE id = ?",
            (size, now, group_id),
        )
    else:
        conn.execute("UPDATE groups SET updated_at = ? WHERE id = ?", (now, group_id))
    return {"trainable": True, "group_id": group_id}


# Every live group of a model still filling (as `_OPEN`, of any key and split), with its key.
_FILLING = f"SELECT id, split, task_key FROM groups WHERE model = ? AND {_CAN_TAKE} ORDER BY id"


def set_aside_stale(conn: sqlite3.Connection, model: str, rule: LiveRule) -> list[str]:
    """Take the members that went stale out of every live group of `model` still filling, each
    with its reason, as a join into its group would (`join_live_group`). Returns their ids."""
    policy, seeded = Policy.read(conn, model), seeded_from(conn, model)
    left: list[str] = []
    for group_id, split, task_key in conn.execute(_FILLING, (model,)).fetchall():
        lock_live_key(conn, model, split, task_key)  # the key's joins wait, or are seen (locks.py's order)
        still = conn.execute(f"SELECT id FROM groups WHERE id = ? AND {_CAN_TAKE}" + for_update(conn), (group_id,))
        if still.fetchone() is None:  # closed, claimed or filled meanwhile: no longer ours to change
            continue
        members = [r[0] for r in conn.execute("SELECT id FROM sessions WHERE group_id = ?", (group_id,)).fetchall()]
        for member in members:
            reason = stale_reason(conn, member, policy, rule, seeded)
            if reason is not None:
                _leave(conn, member, reason, time.time())
                left.append(member)
    return left
