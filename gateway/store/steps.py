"""Step rows and their promotion states: what the trainer records, what a policy decides.

A step row carries `state`, `parent` (the step it was trained from) and `decision` (JSON: who
decided, why, and the numbers behind it). States:

- `candidate`: recorded under `--promote canary|manual`; NAME does not serve it (yet);
- `promoted`: NAME serves the newest promoted step (the *serving* step, or incumbent);
- `superseded`: was promoted, a newer step took its place;
- `rejected`: a candidate a policy or an operator turned down; it never serves as NAME;
- `rolled_back`: was promoted, dropped against the step it replaced, which serves again.

Under `--promote always` (the default) a step is recorded `promoted` (today's behaviour). Every
decision is one conditional UPDATE on the step row (`WHERE state = <expected>`), so among gateway
replicas sharing one PostgreSQL exactly one decision lands and the others see it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.errors import Conflict, NotFound
from gateway.store import reads, training
from gateway.store.lineage import QueryConn, StepParents
from gateway.store.writer import Op

STATES = ("candidate", "promoted", "superseded", "rejected", "rolled_back")
TURNED_DOWN = ("rejected", "rolled_back")
# Where each decision may start from (the conditional UPDATE's expected state).
_FROM = {"promoted": ("candidate",), "rejected": ("candidate",), "rolled_back": ("promoted",)}


def paused_reason(rejected: int) -> str:
    """What /healthz, the dashboard and the trainer's log say while training is paused."""
    return (
        f"training is paused: {rejected} steps in a row were rejected or rolled back (--max-rejections); "
        "look at the steps' decisions (GET /v1/training/steps), fix the rewards or the data, then "
        "POST /v1/training/resume"
    )


def serving(conn: Any, model: str) -> int | None:
    row = conn.execute("SELECT MAX(step) FROM steps WHERE model = ? AND state = 'promoted'", (model,)).fetchone()
    return None if row is None else row[0]


def decisions_may_serve(conn: Any, model: str) -> set[int]:
    """The serving step and those one decision may make serve next: the candidates (a promotion)
    and the serving step's parent (a rollback). What `--keep-checkpoints` keeps, read inside its
    transaction (`StepRows.prune_checkpoints`), which decisions wait for: one made since the
    trainer last looked (a second rollback) is seen, one made after finds the files gone."""
    rows = conn.execute(
        "SELECT step, parent, state FROM steps WHERE model = ? AND state IN ('promoted', 'candidate')", (model,)
    ).fetchall()
    kept = {row[0] for row in rows if row[2] == "candidate"}
    promoted = [(row[0], row[1]) for row in rows if row[2] == "promoted"]
    if promoted:
        kept |= {step for step in max(promoted, key=lambda row: row[0]) if step is not None}
    return kept


def has_adapter(path: str) -> bool:
    """Whether a step's recorded path still holds its adapter (`--keep-checkpoints` removes old ones)."""
    return (Path(path) / "adapter_config.json").is_file()


# Whether step N's checkpoint can still be loaded, asked inside a decision's transaction: the
# recorded path (SQLite, whose trainer shares this machine) or the store's own files (PostgreSQL).
Kept = Callable[[Any, str, int, str], bool]


def _refuse_unloadable(conn: Any, model: str, step: int, to_state: str, parent: int | None, kept: Kept) -> None:
    """A decision that would make NAME serve a step nothing can load is refused (409) before it lands:
    else the store names a serving step every gateway fails to load, and each goes on serving the step
    just rolled back (or the incumbent of a promotion) while /healthz says ok."""
    if to_state == "rejected":
        return  # the serving step stays
    serves = step if to_state == "promoted" else parent
    row = None
    if serves is not None:
        row = conn.execute("SELECT state, path FROM steps WHERE model = ? AND step = ?", (model, serves)).fetchone()
    if to_state == "rolled_back" and (row is None or row[0] != "superseded"):
        why = f"step {serves}, which it replaced, is {row[0]}" if row is not None else "it replaced no step"
        raise Conflict(
            f"step {step} of '{model}' cannot be rolled back: {why}, so no step would serve; step {step} keeps serving",
            param="step",
            code="nothing_to_roll_back_to",
        )
    if row is None or serves is None or kept(conn, model, serves, row[1]):
        return
    if to_state == "promoted":
        message = f"step {step} of '{model}' cannot be promoted: its checkpoint is gone from {row[1]}"
        keeps = "the incumbent keeps serving"
    else:
        message = (
            f"step {step} of '{model}' cannot be rolled back: step {serves}, which it replaced and which would "
            "serve again, has no checkpoint any more (--keep-checkpoints removes old ones)"
        )
        keeps = f"step {step} keeps serving"
    raise Conflict(f"{message}, so no gateway could load it; {keeps}", param="step", code="checkpoint_removed")


def decide(conn: Any, model: str, step: int, to_state: str, decision: dict, kept: Kept) -> dict:
    """Move step `step` to `to_state` if it is still where that decision starts from; the
    serving step's neighbours follow (a promotion supersedes the incumbent; a rollback puts
    back the step it replaced). Conflict when another decision came first, or when the step
    that would serve has no checkpoint left (`kept`)."""
    found = conn.execute("SELECT state, parent FROM steps WHERE model = ? AND step = ?", (model, step)).fetchone()
    if found is None:
        raise NotFound(f"model '{model}' has no step {step}", param="step")
    if found[0] in _FROM[to_state]:  # else the conditional UPDATE below says it was decided already
        _refuse_unloadable(conn, model, step, to_state, found[1], kept)
    now = time.time()
    record = {**decision, "at": now, "from": found[0]}
    cursor = conn.execute(
        "UPDATE steps SET state = ?, decision = ? WHERE model = ? AND step = ? AND state IN ("
        + ",".join("?" * len(_FROM[to_state]))
        + ")",
        (to_state, json.dumps(record), model, step, *_FROM[to_state]),
    )
    if cursor.rowcount != 1:
        raise Conflict(
            f"step {step} of '{model}' is {found[0]}, not {' or '.join(_FROM[to_state])}: it was decided already",
            param="step",
        )
    if to_state == "promoted":
        conn.execute(
            "UPDATE steps SET state = 'superseded' WHERE model = ? AND state = 'promoted' AND step <> ?",
            (model, step),
        )
    elif to_state == "rolled_back" and found[1] is not None:
        conn.execute(
            "UPDATE steps SET state = 'promoted' WHERE model = ? AND step = ? AND state = 'superseded'",
            (model, found[1]),
        )
    return {"model": model, "step": step, "state": to_state, "decision": record}


def resume_training(conn: Any, model: str) -> int:
    """Clear the rejections that paused training (they stay rejected, they no longer count)."""
    cursor = conn.execute(
        "UPDATE steps SET resumed = 1 WHERE model = ? AND state IN ('rejected', 'rolled_back') AND resumed = 0",
        (model,),
    )
    return int(cursor.rowcount or 0)


class StepRows:
    """The step rows' part of `Store` (a mixin: the class stays within its size limit)."""

    def _run_sync(self, op: Op) -> Any:  # implemented by each backend (`Store`)
        raise NotImplementedError

    def _query(self, sql: str, params: tuple | dict = ()) -> list[dict]:  # implemented by each backend
        raise NotImplementedError

    def insert_step(
        self,
        model: str,
        step: int,
        path: str,
        metrics: dict,
        group_ids: list[str],
        session_ids: list[str] | None = None,
        *,
        advantages: dict[str, float] | None = None,
        left_out: dict[str, str] | None = None,
        rewards: dict[str, float] | None = None,
        state: str = "promoted",
        parent: int | None = None,
        also: Op | None = None,
        claimed: bool = False,
    ) -> None:
        """A step row and its groups marked trained, in one transaction (Conflict: one of `session_ids` was discarded
        meanwhile). By session id: what it trained with (`advantages`, `rewards`), or why it was `left_out`.
        `state`: `promoted` (serves at once; the incumbent is superseded) or `candidate` (a policy decides);
        `parent`: the step it was trained from (default: the serving step); `also`: the backend's own write in the
        same transaction (PostgreSQL: the step's file list); `claimed`: its groups must be claimed by `step` still
        (a trainer's step, whose claims a gateway gives back once the trainer no longer holds its lock)."""
        args = (model, step, path, metrics, group_ids, session_ids, advantages, left_out, rewards, claimed)

        def op(conn: Any) -> None:
            source = serving(conn, model) if parent is None else parent
            if source is not None and source >= step:
                source = None  # a step recorded out of order (a test, a restore) has no parent to name
            training.insert_step(conn, *args)
            if also is not None:
                also(conn)
            decision = {"by": "policy", "policy": "always", "at": time.time()} if state == "promoted" else None
            conn.execute(
                "UPDATE steps SET state = ?, parent = ?, decision = ? WHERE model = ? AND step = ?",
                (state, source, json.dumps(decision) if decision else None, model, step),
            )
            if state == "promoted":
                conn.execute(
                    "UPDATE steps SET state = 'superseded' WHERE model = ? AND state = 'promoted' AND step <> ?",
                    (model, step),
                )

        self._run_sync(op)

    def serving_step(self, model: str) -> int | None:
        """The step NAME serves: the newest promoted one (None: nothing recorded yet)."""
        found = self._query("SELECT MAX(step) AS step FROM steps WHERE model = ? AND state = 'promoted'", (model,))
        return found[0]["step"] if found else None

    def recent_steps(self, model: str, newest: int) -> list[dict]:
        """`steps(model)` less the superseded ones older than the newest `newest` (`reads.recent_steps`)."""
        return reads.recent_steps(self._query, model, newest)

    def step_history(self, model: str, after: int | None) -> tuple[int, list[dict]]:
        """How many steps `model` has, and the rows after step `after` (`reads.step_history`)."""
        return reads.step_history(self._query, model, after)

    def seeded_from(self, model: str) -> str | None:
        """The `--init-from NAME@N` whose adapter is `model`'s step 0, or None (`live.seeded_from`)."""
        rows = self._query("SELECT metrics FROM steps WHERE model = ? AND step = 0", (model,))
        return json.loads(rows[0]["metrics"] or "{}").get("init_from") if rows else None

    def undecided_step(self, model: str) -> int | None:
        """The newest candidate step still waiting for a decision, if any."""
        found = self._query("SELECT MAX(step) AS step FROM steps WHERE model = ? AND state = 'candidate'", (model,))
        return found[0]["step"] if found else None

    def decide_step(self, model: str, step: int, to_state: str, decision: dict) -> dict:
        """Promote, reject or roll back step `step`, once (Conflict if decided meanwhile)."""
        if to_state not in _FROM:
            raise ValueError(f"no decision moves a step to {to_state!r}")
        return self._run_sync(lambda conn: decide(conn, model, step, to_state, decision, self._checkpoint_kept))

    def _checkpoint_kept(self, conn: Any, model: str, step: int, path: str) -> bool:
        """Whether step `step`'s checkpoint can still be loaded (in `decide`'s transaction): its
        adapter at the recorded path, on this machine (the trainer's disk, beside SQLite's file).
        That transaction holds the file's write lock (BEGIN IMMEDIATE), as `prune_checkpoints` does."""
        return has_adapter(path)

    def rejections_in_a_row(self, model: str) -> int:
        """Steps turned down since the last one promoted (or the last resume)."""
        rows = self._query("SELECT state, resumed FROM steps WHERE model = ? ORDER BY step DESC", (model,))
        count = 0
        for row in rows:
            if row["state"] == "candidate":
                continue
            if row["state"] not in TURNED_DOWN or row["resumed"]:
                break
            count += 1
        return count

    def resume_training(self, model: str) -> int:
        return self._run_sync(lambda conn: resume_training(conn, model))

    def step_sessions(self, model: str, since: float, until: float) -> list[dict]:
        """Sessions of `model` started in [since, until) with an HTTP reward, each answered by one
        step throughout, oldest first: {"id", "reward", "task_key", "step"} (the canary's comparison).
        RULER's scores (relative within a group), shadow samples and discarded sessions are left out."""
        rows = self._query(
            "SELECT s.id, s.reward, COALESCE(s.task_key, '') AS task_key, s.metrics, MIN(c.step) AS step,"
            " MAX(c.step) AS last_step FROM sessions s JOIN calls c ON c.session_id = s.id"
            " WHERE s.model = ? AND s.created_at >= ? AND s.created_at < ? AND s.reward IS NOT NULL"
            " AND s.discarded = 0 AND s.shadow_of IS NULL AND c.status = 'ok' AND c.step IS NOT NULL"
            " GROUP BY s.id, s.reward, s.task_key, s.metrics, s.created_at ORDER BY s.created_at, s.id",
            (model, since, until),
        )
        return [
            r for r in rows if r["step"] == r["last_step"] and "ruler_score" not in json.loads(r["metrics"] or "{}")
        ]

    def first_step(self, session_id: str | None = None, group_id: str | None = None) -> int | None:
        """The adapter step that answered the first answered call of a session, or of any session
        of a harness group; None before one did (or where the base model answered)."""
        where = "c.session_id = ?" if session_id is not None else "s.group_id = ?"
        rows = self._query(
            "SELECT c.step FROM calls c JOIN sessions s ON s.id = c.session_id"
            f" WHERE {where} AND c.status = 'ok' AND c.step IS NOT NULL ORDER BY c.created_at LIMIT 1",
            (session_id if session_id is not None else group_id,),
        )
        return int(rows[0]["step"]) if rows else None

    def lineage(self, model: str) -> dict[int, int | None]:
        """Step -> parent step, for every step of `model`."""
        return {r["step"]: r["parent"] for r in self._query("SELECT step, parent FROM steps WHERE model = ?", (model,))}

    def step_parents(self, model: str) -> StepParents:
        """`model`'s step -> parent, read a range at a time as a walk down the chain asks
        (`lineage.further_than`), not every step row the run recorded."""
        return StepParents(QueryConn(self._query), model)

    # ------------------------------------------------------------ checkpoints kept in the store

    def fetch_step_files(self, model: str, step: int, raw_path: str, models_dir: Path) -> str:
        """A local directory holding step `step`'s adapter: fetched under `models_dir` from a database that keeps it."""
        return raw_path

    def forget_step_files(self, model: str, step: int, models_dir: Path) -> None:
        """Remove the local copy `fetch_step_files` made of a step's files (none here)."""
        return None

    def prune_checkpoints(
        self, model: str, keep: int, protected: set[int], set_aside: Callable[[set[int]], list[int]]
    ) -> tuple[list[int], list[int]]:
        """`--keep-checkpoints`, in one transaction a decision waits for (`_hold_off_decisions`): the
        steps a decision may make serve are read in it (`decisions_may_serve`) and kept with `protected`,
        then `set_aside(kept)` moves the trainer's old checkpoints out of their place and the store drops
        its own files of those steps (PostgreSQL). Read before it, by the trainer, a rollback landing
        meanwhile (a second in a row) made serve a step whose files went next; a decision after it
        finds them gone and is refused (409). Returns (steps set aside, steps whose files were dropped)."""

        def op(conn: Any) -> tuple[list[int], list[int]]:
            self._hold_off_decisions(conn)
            kept = protected | decisions_may_serve(conn, model)
            return set_aside(kept), self._drop_step_files(conn, model, keep, kept)

        return self._run_sync(op)

    def prune_step_files(self, model: str, keep: int, protected: set[int]) -> list[int]:
        """`prune_checkpoints` in the store alone (none on this machine's disk): the steps whose files were dropped."""
        return self.prune_checkpoints(model, keep, protected, lambda kept: [])[1]

    def _hold_off_decisions(self, conn: Any) -> None:
        """Make decisions wait for the rest of this transaction (SQLite: BEGIN IMMEDIATE holds the
        file's write lock already, which every decision takes)."""
        return None

    def _drop_step_files(self, conn: Any, model: str, keep: int, kept: set[int]) -> list[int]:
        """The store's own files of `model`'s steps older than the newest `keep`, except `kept`, dropped
        (none here: the checkpoints are on the trainer's disk). The steps dropped."""
        return []

    def stored_steps(self, model: str) -> set[int]:
        """`model`'s steps whose checkpoint files the store keeps (none here: they are on the trainer's disk)."""
        return set()

    def restore_checkpoint(
        self, model: str, step: int, dest: Path, wanted: Callable[[str], bool] = lambda name: True
    ) -> Path | None:
        """The step's checkpoint files (those whose name is `wanted`), from the store into `dest`;
        None where the store keeps none."""
        return None
