"""Forgetting old recorded traffic (`rlproxy forget`): sessions, their calls, groups and judgements.

A session goes once its last activity (`sessions.updated_at`: every call, reward and discard sets
it) is older than the cutoff, unless training may still need it:

- a grouped session goes with its whole group, and a group goes only once it is done: trained, or
  set aside (skipped, failed) with no step claiming it, or of a split never trained (val); and only
  once the group itself and every one of its sessions are older than the cutoff;
- a trained group goes only with every other group of its step, so that the step's advantages can
  still be worked out again for the sessions kept (`rlproxy export` reads a step's groups together);
- a session whose call a shadow group still pending copies stays (the shadow group is judged and
  trained on that copy; the discard of the live session must still reach it);
- a session started since a candidate step was recorded stays (the canary compares their rewards).

Steps (metrics, lineage, decisions), checkpoints and the other tables are never touched. Work goes
in batches, each one transaction (a gateway's writes wait for one batch, never for the whole
run), each taking the locks a group decision takes (`gateway.store.locks`: group rows by id, then
session rows) and deciding again under them what it read before taking them. Portable SQL.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.store.locks import for_update, lock_group
from gateway.store.shadows import SHADOW_GROUP_PREFIX
from gateway.store.writer import Op

FORGETS = ("sessions", "calls", "groups", "judgements")
"""The tables forget deletes from, in the order a report lists them (PostgreSQL adds `group_claims`)."""

BATCH = 200
"""Groups (and ungrouped sessions) per transaction: a gateway's write waits for one batch at most."""

_IN_CHUNK = 500  # ids per `IN (...)`: well under SQLite's limit on a statement's parameters

# A group training may no longer need: trained, or set aside with no step claiming it, or val.
_DONE = (
    "(g.trained_step IS NOT NULL OR (g.claimed_step IS NULL"
    " AND (g.failed IS NOT NULL OR g.skipped IS NOT NULL OR g.split <> 'train')))"
)
# A call of session `s` that a shadow group still pending copies (`shadows.shadow_group_id`).
_SHADOWED = (
    "EXISTS (SELECT 1 FROM calls c JOIN groups sg ON sg.id = '" + SHADOW_GROUP_PREFIX + "' || c.id"
    " WHERE c.session_id = s.id AND sg.origin = 'shadow' AND sg.trained_step IS NULL"
    " AND sg.failed IS NULL AND sg.skipped IS NULL)"
)


@dataclass(frozen=True)
class Plan:
    """What to forget: sessions inactive before `cutoff` (Unix seconds), of `model` only if given."""

    cutoff: float
    model: str | None = None
    dry_run: bool = False
    extra_group_tables: tuple[str, ...] = ()  # the backend's own tables keyed by group (`group_claims`)
    batch: int = BATCH


@dataclass
class Progress:
    """Where the next batch starts: keyset cursors over (created_at, id), since a dry run (and a
    batch that keeps what it read) leaves rows in place; and the counts so far, by table."""

    groups_after: tuple[float, str] = (float("-inf"), "")
    sessions_after: tuple[float, str] = (float("-inf"), "")
    done: bool = False
    counts: Counter = field(default_factory=Counter)
    decided: set[tuple[str, int]] = field(default_factory=set)  # trained steps whose groups were decided


def _chunks(ids: Sequence[str]) -> list[Sequence[str]]:
    return [ids[i : i + _IN_CHUNK] for i in range(0, len(ids), _IN_CHUNK)]


def _marks(ids: Sequence[Any]) -> str:
    return ",".join("?" * len(ids))


def candidate_windows(conn: Any) -> list[tuple[str, float]]:
    """(model, since): each model's oldest candidate step's time; the canary reads the sessions
    started since then (`gateway.promotion.canary`)."""
    rows = conn.execute("SELECT model, MIN(created_at) FROM steps WHERE state = 'candidate' GROUP BY model")
    return [(row[0], float(row[1])) for row in rows.fetchall()]


def _kept_session(plan: Plan, windows: list[tuple[str, float]]) -> tuple[str, list[Any]]:
    """SQL true for a session `s` that stays whatever its group: active since the cutoff, shadowed
    by a pending shadow group, or inside a candidate's window."""
    sql = ["s.updated_at >= ?", _SHADOWED]
    params: list[Any] = [plan.cutoff]
    for model, since in windows:
        sql.append("(s.model = ? AND s.created_at >= ?)")
        params += [model, since]
    return "(" + " OR ".join(sql) + ")", params


def done_groups(
    conn: Any, plan: Plan, windows: list[tuple[str, float]], *, after: tuple[float, str] | None = None,
    ids: Sequence[str] | None = None, limit: int | None = None,
) -> list[tuple[str, str, int | None, float]]:  # fmt: skip
    """(id, model, trained step, created_at) of the groups that may go, oldest first (the
    `groups_created` index): `after` a cursor, among `ids`, at most `limit`."""
    kept, kept_params = _kept_session(plan, windows)
    sql = (
        "SELECT g.id, g.model, g.trained_step, g.created_at FROM groups g"
        f" WHERE g.created_at < ? AND g.updated_at < ? AND {_DONE}"
        f" AND NOT EXISTS (SELECT 1 FROM sessions s WHERE s.group_id = g.id AND {kept})"
    )
    sql, params = _page("g", sql, [plan.cutoff, plan.cutoff, *kept_params], plan, after, ids, limit)
    return [(r[0], r[1], r[2], float(r[3])) for r in conn.execute(sql, params).fetchall()]


def whole_steps(
    conn: Any, plan: Plan, windows: list[tuple[str, float]], found: list[tuple], decided: set[tuple[str, int]]
) -> dict[str, tuple[str, int] | None]:
    """Group id -> its trained step (None: untrained) of `found` (`done_groups` rows) that go: an
    untrained one, and a trained one only when every group of its step goes (those beyond this
    batch's rows too). A step is decided once (`decided`), at the first of its groups read."""
    out: dict[str, tuple[str, int] | None] = {row[0]: None for row in found if row[2] is None}
    for key in sorted({(row[1], row[2]) for row in found if row[2] is not None} - decided):
        decided.add(key)
        row = conn.execute("SELECT groups FROM steps WHERE model = ? AND step = ?", key).fetchone()
        every = sorted(set(json.loads(row[0] or "[]"))) if row is not None else []  # the groups it marked trained
        going = {r[0] for chunk in _chunks(every) for r in done_groups(conn, plan, windows, ids=chunk)}
        if every and going == set(every):
            out.update(dict.fromkeys(going, key))
    return out


def loose_sessions(
    conn: Any, plan: Plan, windows: list[tuple[str, float]], *, after: tuple[float, str] | None = None,
    ids: Sequence[str] | None = None, limit: int | None = None,
) -> list[tuple[str, float]]:  # fmt: skip
    """(id, created_at) of the sessions in no group that may go, oldest first (`sessions_created`)."""
    kept, kept_params = _kept_session(plan, windows)
    sql = (
        "SELECT s.id, s.created_at FROM sessions s"
        # The group test as an expression: SQLite took the group_id index (every loose session, sorted
        # each batch: quadratic) over `sessions_created`, which reads a batch in order and stops.
        f" WHERE (CASE WHEN s.group_id IS NULL THEN 1 ELSE 0 END) = 1 AND s.created_at < ? AND s.updated_at < ?"
        f" AND NOT {kept}"
    )
    sql, params = _page("s", sql, [plan.cutoff, plan.cutoff, *kept_params], plan, after, ids, limit)
    return [(r[0], float(r[1])) for r in conn.execute(sql, params).fetchall()]


def _page(
    alias: str, sql: str, params: list[Any], plan: Plan, after: tuple[float, str] | None,
    ids: Sequence[str] | None, limit: int | None,
) -> tuple[str, list[Any]]:  # fmt: skip
    """`sql` over table `alias` narrowed to the plan's model, past the cursor `after` (created_at,
    id), among `ids`, in created_at order (the table's `*_created` index) and at most `limit`."""
    a = alias
    if plan.model is not None:
        sql += f" AND {a}.model = ?"
        params.append(plan.model)
    if after is not None:
        sql += f" AND {a}.created_at >= ? AND ({a}.created_at > ? OR ({a}.created_at = ? AND {a}.id > ?))"
        params += [after[0], after[0], after[0], after[1]]
    if ids is not None:
        sql += f" AND {a}.id IN ({_marks(ids)})"
        params += list(ids)
    sql += f" ORDER BY {a}.created_at, {a}.id"
    if limit is not None:
        sql += f" LIMIT {int(limit)}"
    return sql, params


def _sessions_of(conn: Any, group_ids: Sequence[str]) -> list[str]:
    out: list[str] = []
    for chunk in _chunks(group_ids):
        found = conn.execute(f"SELECT id FROM sessions WHERE group_id IN ({_marks(chunk)})", list(chunk)).fetchall()
        out += [row[0] for row in found]
    return out


def _lock_sessions(conn: Any, session_ids: Sequence[str]) -> None:
    for chunk in _chunks(sorted(session_ids)):
        sql = f"SELECT id FROM sessions WHERE id IN ({_marks(chunk)}) ORDER BY id"
        conn.execute(sql + for_update(conn), list(chunk))


def _rows(conn: Any, table: str, column: str, ids: Sequence[str], dry_run: bool) -> int:
    """Delete (or, in a dry run, count) the rows of `table` whose `column` is one of `ids`."""
    total = 0
    for chunk in _chunks(ids):
        where = f"FROM {table} WHERE {column} IN ({_marks(chunk)})"
        if dry_run:
            total += int(conn.execute(f"SELECT COUNT(*) {where}", list(chunk)).fetchone()[0])
        else:
            total += int(conn.execute(f"DELETE {where}", list(chunk)).rowcount or 0)
    return total


def forget_batch(conn: Any, plan: Plan, progress: Progress) -> None:
    """One batch in the caller's transaction: up to `plan.batch` groups and as many loose
    sessions, read, locked, read again under the locks, then deleted (counted in a dry run)."""
    windows = candidate_windows(conn)
    found = done_groups(conn, plan, windows, after=progress.groups_after, limit=plan.batch)
    loose = loose_sessions(conn, plan, windows, after=progress.sessions_after, limit=plan.batch)
    progress.done = len(found) < plan.batch and len(loose) < plan.batch
    if found:
        progress.groups_after = (found[-1][3], found[-1][0])
    if loose:
        progress.sessions_after = (loose[-1][1], loose[-1][0])
    groups = whole_steps(conn, plan, windows, found, progress.decided)
    session_ids = [row[0] for row in loose]
    if for_update(conn) and not plan.dry_run:
        # PostgreSQL: the groups' locks, then the sessions', as a reward, a call or a claim takes them; what
        # changed before they were granted is seen by the reads below (each statement sees the latest commits).
        for group_id in sorted(groups):
            lock_group(conn, group_id)
        _lock_sessions(conn, [*_sessions_of(conn, sorted(groups)), *session_ids])
        windows = candidate_windows(conn)
        still = {row[0] for chunk in _chunks(sorted(groups)) for row in done_groups(conn, plan, windows, ids=chunk)}
        broken = {step for group_id, step in groups.items() if group_id not in still and step is not None}
        groups = {g: step for g, step in groups.items() if g in still and step not in broken}
        session_ids = [r[0] for chunk in _chunks(session_ids) for r in loose_sessions(conn, plan, windows, ids=chunk)]
    group_ids = sorted(groups)
    every_session = sorted({*_sessions_of(conn, group_ids), *session_ids})
    counts = progress.counts
    counts["judgements"] += _rows(conn, "judgements", "group_id", group_ids, plan.dry_run)
    counts["calls"] += _rows(conn, "calls", "session_id", every_session, plan.dry_run)
    counts["sessions"] += _rows(conn, "sessions", "id", every_session, plan.dry_run)
    for table in plan.extra_group_tables:
        counts[table] += _rows(conn, table, "group_id", group_ids, plan.dry_run)
    counts["groups"] += _rows(conn, "groups", "id", group_ids, plan.dry_run)


def older_sessions(conn: Any, plan: Plan) -> int:
    """Sessions (of `plan.model`) inactive since before the cutoff: what a report says was kept."""
    sql = "SELECT COUNT(*) FROM sessions WHERE updated_at < ?"
    params: list[Any] = [plan.cutoff]
    if plan.model is not None:
        sql += " AND model = ?"
        params.append(plan.model)
    return int(conn.execute(sql, params).fetchone()[0])


@dataclass(frozen=True)
class Forgotten:
    """What `RetentionRows.forget` did (or, in a dry run, would do)."""

    plan: Plan
    counts: dict[str, int]  # rows by table (`FORGETS`, and the backend's own)
    kept_older: int  # sessions older than the cutoff kept, because training may still need them
    free_bytes: int | None = None  # SQLite: bytes of the file's free pages, reused by new rows (not given back)


class RetentionRows:
    """Forgetting's part of `Store` (a mixin: the class stays within its size limit)."""

    backend: str
    group_tables: tuple[str, ...] = ()
    """The backend's own tables keyed by group id, forgotten with the group (PostgreSQL: `group_claims`)."""

    def _run_sync(self, op: Op) -> Any:  # implemented by each backend (`Store`)
        raise NotImplementedError

    def forget(
        self, cutoff: float, model: str | None = None, *, dry_run: bool = False, batch: int = BATCH
    ) -> Forgotten:
        """Delete the sessions inactive since before `cutoff` that training no longer needs, with their
        calls, groups and judgements, a batch per transaction (see this module); `dry_run`: count only."""
        if batch < 1:
            raise ValueError(f"batch must be 1 or more, not {batch}")  # LIMIT 0 would never finish
        plan = Plan(cutoff, model, dry_run, tuple(self.group_tables), batch)
        progress = Progress()
        while not progress.done:
            # On a copy: a transaction PostgreSQL reruns (a deadlock) starts from this batch's own start.
            def op(conn: Any, start: Progress = progress) -> Progress:
                attempt = copy.deepcopy(start)
                forget_batch(conn, plan, attempt)
                return attempt

            progress = self._run_sync(op)
        older = self._run_sync(lambda conn: older_sessions(conn, plan))
        counts = {table: int(progress.counts[table]) for table in (*FORGETS, *plan.extra_group_tables)}
        free = None
        if self.backend == "sqlite":
            free = self._run_sync(lambda conn: _free_pages(conn))
        return Forgotten(plan, counts, older - (counts["sessions"] if dry_run else 0), free)


def _free_pages(conn: Any) -> int:
    """Bytes of the SQLite file's free pages: a DELETE leaves the file its size and new rows fill them
    first; only VACUUM (an exclusive lock on the whole file) gives them back to the disk."""
    free = conn.execute("PRAGMA freelist_count").fetchone()[0]
    return int(free) * int(conn.execute("PRAGMA page_size").fetchone()[0])
