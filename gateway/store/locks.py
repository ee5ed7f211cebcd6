"""How writes that decide on a group's state serialise, on both backends.

A reward, a RULER judgement, a call and a live-group join each read a group's state (claimed,
trained, set aside, open) and write on it; the trainer's claim, its no-spread screen and its
step write that state. Each takes the group's row lock before reading what it decides on, in
its own transaction, so the two never interleave: a reward lands before the claim (and is
trained) or after it (and is refused, 409).

- SQLite: every write transaction is BEGIN IMMEDIATE, so it holds the file's one write lock
  from its first statement; the reads inside it are already serialised. These are no-ops.
- PostgreSQL (READ COMMITTED): `SELECT ... FOR UPDATE` on the groups row waits for a racing
  writer's commit, then reads the row as committed; a live group not yet formed has no row
  yet, so the joins of one task key take a transaction-scoped advisory lock on that key first.

Order, in every transaction, to keep deadlocks rare: the live key, then group rows by id, then
session rows (a call without X-Group-Id locks its session first: it learns the group from it).
A group-commit batch holds its ops' locks in the order the ops came, so two replicas' batches can
still wait on each other: a batch waits at most `BATCH_LOCK_WAIT` for a lock, and a deadlock or
that wait rolls it back and reruns its ops one by one (`PostgresStore._apply_batch`); nothing of
it was acknowledged before its COMMIT.
"""

from __future__ import annotations

from typing import Any, Protocol

_LIVE_KEYS = 0x6C697665  # "live": the advisory locks of live task keys (two-key space)
_TRAINERS = 0x7472616E  # "tran": one trainer per model (`try_lock_trainer`)
_BLOBS = 0x626C6F62  # "blob": file lists written, decisions' checks (shared) against prunes (exclusive)


def for_update(conn: Any) -> str:
    """The clause that locks the rows a SELECT reads: FOR UPDATE on PostgreSQL, none on SQLite."""
    return str(getattr(conn, "row_lock", ""))


def lock_group(conn: Any, group_id: str) -> tuple[Any, Any, Any] | None:
    """The group's (trained step, claimed step, why it was set aside) under its row lock, or
    None for a group that does not exist."""
    return conn.execute(
        "SELECT trained_step, claimed_step, COALESCE(failed, skipped) FROM groups WHERE id = ?" + for_update(conn),
        (group_id,),
    ).fetchone()


def lock_live_key(conn: Any, model: str, split: str, task_key: str) -> None:
    """Hold the live key `model/split/task_key` until the transaction ends (PostgreSQL)."""
    if for_update(conn):
        conn.execute(
            "SELECT pg_advisory_xact_lock(CAST(? AS integer), hashtext(?))", (_LIVE_KEYS, f"{model}/{split}/{task_key}")
        )


def try_lock_trainer(conn: Any, model: str) -> bool:
    """Take `model`'s trainer lock for as long as `conn` lives (PostgreSQL: a session advisory
    lock, which the server drops with the connection, so a killed trainer never leaves it
    behind); False where another connection holds it."""
    row = conn.execute("SELECT pg_try_advisory_lock(CAST(? AS integer), hashtext(?))", (_TRAINERS, model)).fetchone()
    return bool(row[0])


def try_lock_trainer_for_transaction(conn: Any, model: str) -> bool:
    """Take `model`'s trainer lock until this transaction ends, where no trainer holds it (PostgreSQL):
    how a gateway learns, exactly, that the trainer is gone (`gateway.store.trainer_lock`)."""
    row = conn.execute(
        "SELECT pg_try_advisory_xact_lock(CAST(? AS integer), hashtext(?))", (_TRAINERS, model)
    ).fetchone()
    return bool(row[0])


def lock_blobs(conn: Any, *, exclusive: bool) -> None:
    """Until the transaction ends (PostgreSQL): a step's file list is written under the shared
    lock, blobs no list names are collected under the exclusive one. Without it a trainer's blob
    committed (or found present) in its upload transaction could be collected before its step's
    list names it (`gateway.store.files`): the two never overlap, and the writer sees what a
    collection before it removed. A promotion decision looks for a step's files under the shared one
    too, so a `--keep-checkpoints` prune (exclusive, from its read of what serves to its commit) never
    drops the files of a step a decision made serve meanwhile (`StepRows.prune_checkpoints`)."""
    function = "pg_advisory_xact_lock" if exclusive else "pg_advisory_xact_lock_shared"
    conn.execute(f"SELECT {function}(CAST(? AS integer), 0)", (_BLOBS,))


class TrainerLock(Protocol):
    """`Store.lock_trainer`'s answer: `ensure` (still held? else taken again, or ConfigError where
    another trainer took it meanwhile), `release`."""

    def ensure(self) -> None: ...

    def release(self) -> None: ...


class NoTrainerLock:
    """SQLite's: nothing held in the store (its file lies in one state dir, whose lock file decides)."""

    def ensure(self) -> None:
        return None

    def release(self) -> None:
        return None
