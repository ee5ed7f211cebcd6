"""Failed attempts at a step: counted in the store, a failing batch bisected, a failing group set aside.

Claiming groups for a step (`Store.claim_for_step`) counts one attempt on each before training
starts, so an attempt the trainer never came back from (killed, out of host memory) counts
too; a step that records its groups ends their story, and one that is taken back through no
fault of theirs (a discard, the engine or the store away) gives the attempt back.

A step that fails (a non-finite loss or gradient, out of memory, a bad batch) changes nothing
and its groups keep the error. One bad group must not set good ones aside, so a failed batch
is bisected: its halves are tried next, each as a step of its own, until the group that fails
is alone. Each half that trains advances the step, so the worker screens the next half for
staleness (`trainer.selection.without_stale`) before it trains: a group that went stale
meanwhile is marked skipped with the reason, never trained past `--max-staleness`. A group
that failed twice, or was in two steps the trainer died in (a restart forgets the halves
still to try), is a suspect: it trains alone. A group is set aside (marked
failed with the last error, visible in `GET /v1/groups/{id}`) once its attempts reach
`attempt_limit`: `MAX_ATTEMPTS` alone, plus the steps bisection needs to isolate it.
"""

from __future__ import annotations

import logging

from gateway.store import Store

log = logging.getLogger("rlproxy.trainer")

MAX_ATTEMPTS = 3
"""Failed attempts of a group on its own before it is set aside as failed."""

SUSPECT_AFTER = 2
"""Attempts after which a group trains alone: one step the trainer died in (a deploy's kill, a
Ctrl-C) is nobody's fault and retries as it was; a second points at the step's groups."""


def attempt_limit(groups_per_step: int) -> int:
    """Attempts after which a group is set aside: `MAX_ATTEMPTS` on its own, plus the halvings
    it takes to get there from a full step (ceil(log2(groups_per_step)))."""
    return MAX_ATTEMPTS + max(0, groups_per_step - 1).bit_length()


def set_aside_reason(attempts: int, last_error: str | None) -> str:
    return (
        f"training failed {attempts} times: "
        + (last_error or "the trainer stopped during each attempt (killed, or out of host memory)")
    )[:2000]


class Attempts:
    """The failed attempts of one worker: the counts are the store's; the halves of a failed
    batch still to try are this worker's (a restart tries each suspect alone instead)."""

    def __init__(self, store: Store, groups_per_step: int = 1) -> None:
        self.store = store
        self.limit = attempt_limit(groups_per_step)
        self.pending: list[list[str]] = []
        """Halves of failed batches, tried before any new group (front first)."""
        self.since_step = 0
        """Attempts that failed since the last step, for the log and the step metrics."""

    def next_half(self) -> list[dict] | None:
        """The next half of a failed batch whose groups can still train, read afresh."""
        while self.pending:
            ids = self.pending.pop(0)
            groups = [self.store.get_group(gid) for gid in ids]
            groups = [g for g in groups if g["trained_step"] is None and not g["skipped"] and not g["failed"]]
            if groups:
                return groups
        return None

    def screen(self, groups: list[dict]) -> tuple[list[dict], dict | None]:
        """`groups` (ready, in order) less those at the attempt limit, which are set aside now;
        and the first suspect among them (`SUSPECT_AFTER` attempts: it failed, or a trainer
        died training it, more than once), which trains alone."""
        keep = []
        for group in groups:
            attempts = int(group.get("attempts") or 0)
            if attempts >= self.limit:
                reason = set_aside_reason(attempts, group.get("last_error"))
                self.store.mark_failed([group["id"]], reason)
                log.error("group %s set aside: %s", group["id"], reason)
            else:
                keep.append(group)
        suspect = next((g for g in keep if int(g.get("attempts") or 0) >= SUSPECT_AFTER), None)
        if suspect is not None:
            log.info("group %s failed before (%d attempt(s)): training it alone", suspect["id"], suspect["attempts"])
        return keep, suspect

    def failed(self, group_ids: list[str], exc: Exception, step: int) -> None:
        """Step `step` failed on `group_ids`: give them back with the error (the attempt stays
        counted), then bisect the batch, or set a lone group aside at the limit."""
        reason = f"{type(exc).__name__}: {exc}"[:2000]
        self.since_step += 1
        self.store.release_step(group_ids, reason)
        if len(group_ids) > 1:
            half = (len(group_ids) + 1) // 2
            self.pending[:0] = [group_ids[:half], group_ids[half:]]
            log.warning(
                "step %d failed on %d groups (nothing was saved): trying each half alone to find the group at "
                "fault: %s",
                step,
                len(group_ids),
                reason,
            )
            return
        (group_id,) = group_ids
        attempts = int(self.store.get_group(group_id).get("attempts") or 0)
        if attempts >= self.limit:
            log.error("step %d failed on group %s %d times; setting it aside: %s", step, group_id, attempts, reason)
            self.store.mark_failed([group_id], set_aside_reason(attempts, reason))
            return
        log.warning(
            "step %d failed on group %s (attempt %d of %d; nothing was saved): %s",
            step,
            group_id,
            attempts,
            self.limit,
            reason,
        )
