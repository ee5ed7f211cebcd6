"""`--promote canary`: a sticky share of sessions tries the candidate; live rewards decide.

Routing: a request for NAME whose key (its harness group's id, else its session id) hashes
below `--canary-share` is answered by the candidate, the rest by the incumbent (the serving
step). The hash (SHA-256 of the key) is the same on every replica, so a session's calls, and
the sessions of one harness group, all see one step wherever they land.

Deciding: every `poll_interval` each gateway compares the rewards of the sessions started since
the candidate's row was recorded, by the step that answered them (`gateway.promotion.rule`), and
acts at a look: promote, reject, or wait; a candidate undecided after `--canary-max-wait`
seconds is rejected. Only HTTP rewards count (train and val): a RULER score is relative within
its group, and a group never holds both steps here. The decision is one conditional UPDATE of
the step row (`Store.decide_step`): among replicas on one PostgreSQL one lands, the others
get Conflict and follow the store.

Watching: a step the canary promoted stays watched for `--watch-sessions` sessions; a
significant drop against the step it replaced (its sessions during the canary; the same
rule's reject test) rolls it back, recorded like any decision. Where the step it replaced has no
checkpoint left (`--keep-checkpoints`: a second rollback in a row), the store refuses the rollback
and the watched step keeps serving: a warning and /healthz (`rollback_refused`) say why.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import time
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Any

from gateway.errors import Conflict, EngineUnavailable, RLProxyError, StoreUnavailable
from gateway.promotion import rule
from gateway.settings import Settings
from gateway.store import Store
from gateway.store.steps import TURNED_DOWN
from gateway.store.waits import read_within
from gateway.tasks import stop_task

if TYPE_CHECKING:
    from gateway.adapters import AdapterRegistry, Target

log = logging.getLogger("rlproxy.promotion")

# A decision the store refuses because the step that would serve has no checkpoint left
# (`gateway.store.steps`): not a race another gateway won, and trying again changes nothing.
UNSERVABLE = ("checkpoint_removed", "nothing_to_roll_back_to")
PINNED_KEYS = 100_000  # sessions (and groups) remembered with their step, oldest forgotten first


def share_of(key: str) -> float:
    """Where `key` falls in [0, 1): the same on every replica and across restarts."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def by_key(sessions: list[dict], step: int) -> dict[str, list[float]]:
    """Rewards of the sessions `step` answered, by task key."""
    out: dict[str, list[float]] = {}
    for s in sessions:
        if s["step"] == step:
            out.setdefault(s["task_key"], []).append(float(s["reward"]))
    return out


class Canary:
    """The candidate being tried, the routing of NAME to it, and the decisions."""

    def __init__(self, registry: AdapterRegistry, store: Store, settings: Settings) -> None:
        self.registry = registry
        self.store = store
        self.settings = settings
        self.name = settings.model_name
        self.step: int | None = None  # the candidate answering its share (loaded)
        self.decisions: Counter[str] = Counter()  # promoted, rejected, rolled_back: this gateway's (for /metrics)
        self._looked: dict[int, int] = {}  # step -> the last look acted on
        self._watched: set[int] = set()  # promoted steps whose watch is over
        self._pinned: OrderedDict[str, int | None] = OrderedDict()  # key -> the step its first call saw
        self._task: asyncio.Task | None = None
        self.progress: dict | None = None  # the undecided candidate's last look, for /healthz (`canary`)
        self.refused: dict | None = None  # the last decision the store refused as unservable, for /healthz

    def route(self, key: str, target: Target) -> Target:
        """NAME's target for the request keyed `key`: the step its first call saw while that step is
        loaded (a decision between two calls of a session does not move it), else the candidate
        for its share, else `target` (the serving step)."""
        step = self._pinned.get(key)
        if step is None or step not in self.registry.loaded:
            step = self.step if self.step is not None and share_of(key) < self.settings.canary_share else target.step
            self._remember(key, step)
        adapter = self.registry.loaded.get(step) if step is not None else None
        if adapter is None or step == target.step:
            return target
        return dataclasses.replace(target, model=adapter, adapter=adapter, step=step)

    def _remember(self, key: str, step: int | None) -> None:
        self._pinned[key] = step
        while len(self._pinned) > PINNED_KEYS:
            self._pinned.popitem(last=False)

    async def recall(self, key: str) -> None:
        """Pin a key this gateway has not routed yet to the step that answered its first call, as
        the store recorded it: after a restart, or on another replica, a session (or harness
        group) keeps the step it started on, as it does in one gateway's memory, rather than mix
        two policies in one trajectory. Not a step since rejected or rolled back (its sessions
        move on, as they do once it unloads), nor one so old the trainer would skip the group as
        stale anyway (`--max-staleness`). The step is loaded on demand if it is not."""
        if key in self._pinned:
            return
        kind, _, name = key.partition(":")
        ids = (name, None) if kind == "session" else (None, name)
        try:
            step = await read_within(self.store, self.store.first_step, *ids)
        except StoreUnavailable:  # serving goes on without the store: the key routes as a new one
            return
        current = self.registry.current
        if step is None or key in self._pinned or step in self.registry.turned_down or current is None:
            return
        if current - step > self.settings.max_staleness:
            return
        try:
            await self.registry.ensure(f"{self.name}@{step}")
        except RLProxyError as exc:  # its checkpoint is gone or does not load: the key routes as a new one
            log.warning("session key %s stays unpinned: step %d does not load (%s)", key, step, exc.message)
            return
        self._remember(key, step)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._poll(), name="rlproxy-canary")

    async def close(self) -> None:
        await stop_task(self._task)
        self._task = None

    async def _poll(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop outlives any one failure
                log.exception("canary look failed; retrying in %.1f s", self.settings.poll_interval)
            await asyncio.sleep(self.settings.poll_interval)

    async def tick(self) -> None:
        """One look: route to the newest candidate, decide on it, or watch the serving step."""
        rows = await read_within(self.store, self.store.steps, self.name)
        candidates = [r for r in rows if r["state"] == "candidate"]
        serving = max((r for r in rows if r["state"] == "promoted"), key=lambda r: r["step"], default=None)
        if not candidates:
            self.step, self.progress = None, None
            if serving is not None and serving["step"] not in self._watched:
                await self._watch(serving, {r["step"]: r for r in rows})
            return
        row = max(candidates, key=lambda r: r["step"])
        parent = next((r for r in rows if r["step"] == row["parent"]), None)
        if serving is not None and parent is not None and parent["state"] in TURNED_DOWN:
            # Trained on top of a step rolled back as it trained (the trainer takes such a step back;
            # this is the moment between its check and its record): never served, whatever its rewards.
            reason = f"trained from step {parent['step']}, which was {parent['state']}"
            found = rule.compare({}, {}, self.settings.canary_margin, self.settings.canary_min_sessions)
            await self._decide(row["step"], "rejected", found, reason, incumbent=serving["step"])
            return
        failed = await self._load(row["step"])
        self.step = row["step"] if failed is None else None  # unloaded, its share stays on the incumbent
        if serving is None:
            return
        sessions = await read_within(self.store, self.store.step_sessions, self.name, row["created_at"], time.time())
        found = rule.compare(
            by_key(sessions, row["step"]),
            by_key(sessions, serving["step"]),
            self.settings.canary_margin,
            self.settings.canary_min_sessions,
        )
        # What it waits for, said: rewards that never come (RULER-judged or unrewarded sessions do
        # not count) otherwise look like a healthy canary until --canary-max-wait rejects it.
        self.progress = {
            "step": row["step"],
            **{k: getattr(found, k) for k in ("candidate_sessions", "incumbent_sessions", "look")},
            "sessions_for_next_look": self.settings.canary_min_sessions * (found.look + 1)
            if found.look < rule.LOOKS
            else None,
            "max_wait_ends_at": row["created_at"] + self.settings.canary_max_wait,
        }
        verdict, reason = "wait", ""
        if found.look > self._looked.get(row["step"], 0) and found.incumbent_sessions >= 2:
            verdict = rule.decide(found)
            self._looked[row["step"]] = found.look
            reason = {"promote": "non-inferior within the margin", "reject": "the incumbent is better"}.get(verdict, "")
        if verdict == "wait" and time.time() - row["created_at"] > self.settings.canary_max_wait:
            verdict, reason = "reject", f"undecided after --canary-max-wait {self.settings.canary_max_wait:g} s"
            if failed is not None:
                reason += f": its adapter did not load ({failed})"
        if verdict != "wait":
            to_state = "promoted" if verdict == "promote" else "rejected"
            await self._decide(row["step"], to_state, found, reason, incumbent=serving["step"])

    async def _load(self, step: int) -> str | None:
        """Load the candidate on every replica (its share spans them); None once loaded, else why not.
        A load that fails is retried every look, and `--canary-max-wait` still bounds the wait: a
        candidate whose files are broken is rejected, not waited on forever (the trainer waits on it).
        The registry logs each distinct failure once and `/healthz` shows it (`candidate_load_error`)."""
        if self.registry.loaded_everywhere(step):
            return None
        try:
            await self.registry.ensure(f"{self.name}@{step}", everywhere=True)
        except EngineUnavailable:
            return self.registry.load_errors.get(step) or "the engine is unavailable"
        return None

    async def _watch(self, serving: dict, rows: dict[int, dict]) -> None:
        decision = serving.get("decision") or {}
        parent = rows.get(serving["parent"]) if serving["parent"] is not None else None
        if decision.get("policy") != "canary" or parent is None or "candidate_since" not in decision:
            self._watched.add(serving["step"])  # promoted by `always` or by hand: nothing to compare with
            return
        now = time.time()
        since, at = decision["candidate_since"], decision["at"]
        before = await read_within(self.store, self.store.step_sessions, self.name, since, at)
        after = await read_within(self.store, self.store.step_sessions, self.name, at, now)
        # Its first --watch-sessions sessions only: a gateway restarted long after the watch ended
        # (this set is in memory) must not judge a step by everything it has served since.
        watched = [s for s in after if s["step"] == serving["step"]][: self.settings.watch_sessions]
        mine = by_key(watched, serving["step"])
        if len(watched) >= self.settings.watch_sessions:
            self._watched.add(serving["step"])
        found = rule.compare(mine, by_key(before, parent["step"]), 0.0, self.settings.canary_min_sessions)
        if found.look > self._looked.get(-serving["step"], 0):
            self._looked[-serving["step"]] = found.look
            if rule.decide(found) == "reject":
                reason = f"dropped against step {parent['step']}, which it replaced"
                await self._decide(serving["step"], "rolled_back", found, reason, incumbent=parent["step"])

    async def _decide(self, step: int, to_state: str, found: rule.Comparison, reason: str, incumbent: int) -> None:
        record: dict[str, Any] = {
            "by": "policy",
            "policy": "canary",
            "reason": reason,
            "incumbent": incumbent,
            "test": f"Welch z, one-sided, alpha {rule.ALPHA} over {rule.LOOKS} looks",
            **found.as_dict(),
        }
        if to_state == "promoted":
            row = next(r for r in await read_within(self.store, self.store.steps, self.name) if r["step"] == step)
            record["candidate_since"] = row["created_at"]
        try:
            await asyncio.to_thread(self.store.decide_step, self.name, step, to_state, record)
        except Conflict as exc:
            if exc.code not in UNSERVABLE:
                log.info("step %d of %s was decided by another gateway or the API meanwhile", step, self.name)
            else:  # the step that would serve cannot load (--keep-checkpoints removed it): serving stays as it is
                self._watched.add(step)  # a watch's verdict would not change: said once, not every look
                self.refused = {"step": step, "decision": to_state, "reason": f"{reason}, but {exc.message}"}
                log.warning("the canary did not record step %d of %s as %s: %s", step, self.name, to_state, exc.message)
        else:
            self.decisions[to_state] += 1
            log.info("step %d of %s %s by the canary: %s (%s)", step, self.name, to_state, reason, json.dumps(record))
        self.step, self.progress = None, None
        await self.registry.refresh()
