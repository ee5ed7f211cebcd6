"""Why a group's data can no longer change, in the words the API answers with.

A step claims a group before it reads it, and from then on its rewards and calls are frozen:
a reward is refused (409) and a call is kept, marked `untrainable`. A group set aside (skipped,
or failed: by the trainer, or by a shadow judge that gave up) is frozen for good. A session
whose every call came after that joined a group that was done already: the usual cause is a
harness that reused a group id for a new batch of rollouts, so its 409 says that.
"""

from __future__ import annotations

from typing import Any

JUDGE_GAVE_UP = "RULER could not judge it"
"""How the reason starts when the shadow sampler sets a group aside (`shadows.give_up_shadow_group`):
the trainer's reasons never do, so a 409 can say who set the group aside."""


def late_call_reason(
    group_id: str, trained_step: int | None, claimed_step: int | None, set_aside: str | None = None
) -> str | None:
    """Why a call recorded now can never be trained: its group's data is frozen once a step
    claimed it (the step reads the calls when it starts) or trained it, or once it was set aside."""
    if trained_step is not None:
        return f"late: group '{group_id}' was already trained (step {trained_step}) when this call was recorded"
    if claimed_step is not None:
        return f"late: group '{group_id}' was being trained (step {claimed_step}) when this call was recorded"
    if set_aside is not None:
        return f"late: group '{group_id}' was set aside ({set_aside}) when this call was recorded"
    return None


def frozen_group_reason(
    group_id: str, trained_step: int | None, claimed_step: int | None, set_aside: str | None = None
) -> str | None:
    """Why a group's rewards can no longer change: a step claimed it or trained it, or it was set
    aside (`set_aside`: why it was skipped or failed; by the trainer, or a shadow judge's give-up)."""
    if trained_step is not None:
        return (
            f"group '{group_id}' was already trained (step {trained_step}): a reward now would change nothing "
            "it learned from. Post rewards before the group is ready (closed and every session rewarded)."
        )
    if claimed_step is not None:
        return (
            f"group '{group_id}' is being trained (step {claimed_step}) with the rewards it had when the step "
            "took it: post rewards before the group is ready (closed and every session rewarded)."
        )
    if set_aside is not None and set_aside.startswith(JUDGE_GAVE_UP):
        # A shadow group: only its judge rewards it, and the judge gave up; not the trainer's doing.
        return f"group '{group_id}' was set aside once its RULER judge gave up ({set_aside}) and will not be trained."
    if set_aside is not None:
        return (
            f"group '{group_id}' was set aside by the trainer ({set_aside}) and will not be trained: "
            "post rewards before the group is ready (closed and every session rewarded)."
        )
    return None


def joined_late(conn: Any, session_id: str) -> bool:
    """Whether every call of the session came after its group was frozen (each marked `untrainable`
    as it was recorded): the session joined a group that was done, it did not miss its turn."""
    return (
        conn.execute(
            "SELECT COUNT(*) FROM calls WHERE session_id = ? AND untrainable IS NULL", (session_id,)
        ).fetchone()[0]
        == 0
    )


def joined_late_reason(
    session_id: str, group_id: str, trained_step: int | None, claimed_step: int | None, set_aside: str | None
) -> str:
    """The 409 for a reward to a session that `joined_late`: posting earlier could not have helped."""
    if trained_step is not None:
        done = f"was trained (step {trained_step})"
    elif claimed_step is not None:
        done = f"was taken by a step (step {claimed_step})"
    else:
        done = f"was set aside ({set_aside})"
    return (
        f"session '{session_id}' takes no reward: it joined group '{group_id}' after the group {done}, so its calls "
        "are kept and never trained. A group id names one batch of rollouts of a task: give each new batch a new "
        "group id (the SDK's proxy.group() makes one)."
    )
