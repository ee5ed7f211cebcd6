"""Failed attempts at a step: counted per batch, and a batch that keeps failing set aside.

A step that fails (a non-finite loss or gradient, out of memory, a bad batch) changes
nothing, and its groups stay ready for the next attempt. The same batch (the same group
ids) failing `MAX_ATTEMPTS` times has its groups marked failed with the reason, visible in
`GET /v1/groups/{id}`, and is never tried again.
"""

from __future__ import annotations

import logging

from gateway.store import Store

log = logging.getLogger("rlproxy.trainer")

MAX_ATTEMPTS = 3
"""Failures of the same batch before its groups are set aside as failed."""


class Attempts:
    """The failed attempts of one worker."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.by_batch: dict[tuple[str, ...], int] = {}
        """A batch (its sorted group ids) -> its failed attempts so far."""
        self.since_step = 0
        """Attempts that failed since the last step, for the log and the step metrics."""

    def failed(self, batch: tuple[str, ...], exc: Exception, step: int) -> None:
        """Count a failed attempt at step `step` on `batch`; set the batch aside after
        `MAX_ATTEMPTS`."""
        attempts = self.by_batch.get(batch, 0) + 1
        self.by_batch[batch] = attempts
        self.since_step += 1
        reason = f"{type(exc).__name__}: {exc}"
        if attempts < MAX_ATTEMPTS:
            log.warning(
                "step %d failed (attempt %d of %d; nothing was saved): %s",
                step,
                attempts,
                MAX_ATTEMPTS,
                reason,
            )
            return
        log.error(
            "step %d failed %d times on the same groups; setting them aside as failed: %s",
            step,
            attempts,
            reason,
        )
        self.store.mark_failed(list(batch), f"training failed {attempts} times: {reason}"[:2000])
        self.by_batch.pop(batch, None)

    def forget(self, batch: tuple[str, ...]) -> None:
        """An attempt at `batch` did not fail (it trained, or a discard took it back)."""
        self.by_batch.pop(batch, None)
