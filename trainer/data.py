"""Recorded calls -> training samples.

A session (one trajectory) is a list of calls. Each call gives one turn: prompt ids,
the completion ids of choice 0 (the one an agent continues with) and their sampling-time
logprobs. Consecutive turns merge into one sequence when the next prompt's ids start with
everything so far (previous prompt + completion): the new tokens in between (tool
results, user turns, template tokens) are prompt, and only sampled completion tokens are
trained on. A turn whose prompt does not extend the sequence (`extends`: the agent rewrote
its history, a reasoning template dropped an earlier turn's <think> block, or a tokenizer
merged across the boundary) starts a new sample of the same trajectory, with the same
advantage; supervised samples split there too (`trainer.sft.samples`).

Each token keeps the temperature its call sampled at (`Sample.temperatures`): the trainer
scores pi_old at it, so the policy it compares against is the one that sampled. Greedy
calls (temperature below 1e-5, `gateway.settings.GREEDY_BELOW`, as vLLM decides it; any
engine, any protocol) are not trained: a point mass has no distribution for a ratio, and
pi_old at T = 1e-6 would inflate it ~10^6. Their completion stays in the sequence as
context (masked, like a prompt), so the trajectory's later turns still merge and train;
each is counted (`GREEDY`, `Batch.greedy_calls`, the step's `greedy_calls` metric).

A call can carry a loss weight (`call_weights`, call id -> weight, 1 for the others) that each
of its completion tokens takes into the loss (`Sample.weights`): a live turn that is trained in
two groups, its live group and its shadow group, weighs 1 in all (`trainer.publish`).

Calls recorded without token ids (the `openai` engine) are re-rendered with the base
model's chat template (`trainer.render`) and trained without behaviour logprobs
(NaN: the behaviour policy is unknown, so no importance weight applies). Calls that failed
are skipped, and so are discarded sessions (rollouts that failed:
`POST /v1/sessions/{id}/discard`).

Everything here but `load_groups` is a pure function over the store's plain dicts, so
tests feed hand-made rows.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from trainer.advantages import compute_advantages, has_reward_spread
from trainer.retries import (
    GREEDY,
    greedy_calls,
    is_greedy_call,
    sampling_temperature,
    trainable_calls,
    untrained_reason,
)
from trainer.types import Sample

if TYPE_CHECKING:
    from gateway.store import Store

log = logging.getLogger("rlproxy.trainer")

NAN = math.nan


@dataclass(frozen=True)
class Turn:
    """What one call adds to a trajectory."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    """The sampled tokens of choice 0."""
    completion_logprobs: tuple[float, ...]
    """Same length as `completion_ids`; behaviour logprobs, NaN where unknown."""
    temperature: float = 1.0
    """The temperature the completion was sampled at (1 for greedy or unknown)."""
    trained: bool = True
    """False for a greedy call: its completion is context, never trained on."""
    weight: float = 1.0
    """The loss weight of each completion token (below 1: the turn also trains elsewhere)."""


Render = Callable[[dict, dict], "Turn | None"]
"""(request, response) -> Turn, for calls recorded without token ids."""


# ------------------------------------------------------------------ calls -> turns


def call_turn(call: dict, render: Render | None = None) -> Turn | None:
    """The turn a recorded call contributes, or None (failed call, or nothing usable). A
    greedy call's turn is context only (`trained=False`, no logprobs)."""
    if call.get("status") != "ok":
        return None
    if is_greedy_call(call):
        turn = _call_turn(call, render)
        return (
            dataclasses.replace(turn, completion_logprobs=(NAN,) * len(turn.completion_ids), trained=False)
            if turn
            else None
        )
    return _call_turn(call, render)


def _call_turn(call: dict, render: Render | None) -> Turn | None:
    temperature = sampling_temperature(call)
    prompt_ids = call.get("prompt_ids")
    completions = call.get("completion_ids")
    if prompt_ids is not None and completions:
        ids = completions[0]
        logprobs = (call.get("behaviour_logprobs") or [None])[0]
        if logprobs is None or len(logprobs) != len(ids):
            logprobs = [NAN] * len(ids)
        return Turn(tuple(prompt_ids), tuple(ids), tuple(float(x) for x in logprobs), temperature)
    if render is None or not call.get("response"):
        return None
    turn = render(call["request"], call["response"])
    return dataclasses.replace(turn, temperature=temperature) if turn is not None else None


def extends(ids: Sequence[int], prompt_ids: Sequence[int]) -> bool:
    """Whether a turn's prompt continues the token sequence so far, so that the two merge into
    one sample; where it does not, a new sample starts (GRPO's and supervised samples alike)."""
    n = len(ids)
    return len(prompt_ids) >= n and list(prompt_ids[:n]) == list(ids)


def merge_turns(turns: Sequence[Turn], *, trajectory_id: str, group_id: str, advantage: float) -> list[Sample]:
    """One trajectory's turns as samples: merged while each prompt extends the sequence."""
    samples: list[Sample] = []
    ids: list[int] = []
    mask: list[bool] = []
    old: list[float] = []
    temps: list[float] = []
    weights: list[float] = []

    def flush() -> None:
        # A sample needs a trained token, and a first token that is context (no logprob).
        if ids and any(mask) and not mask[0]:
            samples.append(
                Sample(
                    tuple(ids),
                    tuple(mask),
                    tuple(old),
                    advantage,
                    trajectory_id,
                    group_id,
                    temperatures=tuple(temps),
                    weights=tuple(weights) if any(w != 1.0 for w in weights) else None,
                )
            )
        for values in (ids, mask, old, temps, weights):
            values.clear()

    for turn in turns:
        if not turn.prompt_ids:
            continue  # nothing to condition on; an engine never records this
        if not extends(ids, turn.prompt_ids):
            flush()
        new_prompt = turn.prompt_ids[len(ids) :]
        ids.extend(new_prompt)
        mask.extend([False] * len(new_prompt))
        old.extend([NAN] * len(new_prompt))
        temps.extend([1.0] * len(new_prompt))
        weights.extend([1.0] * len(new_prompt))
        ids.extend(turn.completion_ids)
        mask.extend([turn.trained] * len(turn.completion_ids))
        old.extend(turn.completion_logprobs)
        temps.extend([turn.temperature] * len(turn.completion_ids))
        weights.extend([turn.weight] * len(turn.completion_ids))
    flush()
    return samples


def trajectory_samples(
    calls: Sequence[dict],
    *,
    trajectory_id: str,
    group_id: str,
    advantage: float,
    render: Render | None = None,
    call_weights: Mapping[str, float] | None = None,
) -> list[Sample]:
    """A session's calls (in call order) as samples; retry orphans and calls the client never
    got an answer to (`trainer.retries`) are left out. `call_weights`: call id -> loss weight."""
    weights = call_weights or {}
    turns = [
        dataclasses.replace(turn, weight=weights[call["id"]]) if call.get("id") in weights else turn
        for call in trainable_calls(calls)
        if (turn := call_turn(call, render)) is not None
    ]
    return merge_turns(turns, trajectory_id=trajectory_id, group_id=group_id, advantage=advantage)


# ------------------------------------------------------------------ groups -> batch


@dataclass(frozen=True)
class Batch:
    """What one training step trains on."""

    samples: list[Sample]
    group_ids: list[str]
    """Groups that contributed samples: marked trained with the step."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Group id -> why it was not trained (too few sessions with a sample, no reward spread)."""
    rewards: list[float] = field(default_factory=list)
    """Rewards of the sessions trained (those of `group_ids` that stayed in their group)."""
    greedy_calls: int = 0
    """Calls of the sessions trained left untrained for `GREEDY`."""
    sessions: dict[str, list[str]] = field(default_factory=dict)
    """Group id (of `group_ids`) -> the ids of its sessions trained, in session order."""
    advantages: dict[str, float] = field(default_factory=dict)
    """Session id -> the advantage it trained with (over exactly the sessions trained)."""
    left_out: dict[str, str] = field(default_factory=dict)
    """Session id -> why it left its group before advantages were computed (no trainable sample)."""
    cut: int = 0
    """Samples longer than a row, trained on their first `max_tokens_per_row` tokens."""


NO_SPREAD = "no reward spread: every rollout of the group scored the same"
NO_TOKENS = "no trainable tokens: every call failed, was greedy or had no completion"
NO_SAMPLE = (
    "no trainable sample: every call failed, was left by its client (499), was a retry orphan, "
    "was greedy, came after its group was claimed, or could not be re-rendered"
)
TOO_LONG = (
    "too long: each sample's prompt alone fills a training row; raise --max-tokens-per-row, up to the base "
    "model's context (the trainer's log says when that is the shorter)"
)


def too_few(kept: int, total: int) -> str:
    """Why a group with fewer than 2 sessions left to train is skipped."""
    return (
        f"too few sessions to compare: {kept} of its {total} session(s) had a trainable sample; "
        "a group needs 2 for a group-relative advantage"
    )


def trained_sessions(group: dict) -> list[dict]:
    """The sessions of a group that are trained on, in session order (`Store.get_group`
    layout). `get_group` lists discarded sessions apart already; filtering here too keeps
    a hand-made or older dict from putting a failed rollout's tokens into a batch. A `val`
    session is never trained, even one a store from before the split check let into a
    train group."""
    return [s for s in group["sessions"] if not s.get("discarded") and s.get("split", "train") != "val"]


def group_rewards(group: dict) -> list[float]:
    """Rewards of a group's trained sessions, in session order (`Store.get_group` layout)."""
    return [float(s["reward"]) for s in trained_sessions(group)]


def spread_groups(groups: Sequence[dict]) -> tuple[list[dict], list[dict]]:
    """(groups with a reward spread, groups without): the latter have nothing to teach."""
    keep: list[dict] = []
    drop: list[dict] = []
    for group in groups:
        (keep if has_reward_spread(group_rewards(group)) else drop).append(group)
    return keep, drop


def build_batch(
    groups: Sequence[dict],
    calls_by_session: dict[str, list[dict]],
    *,
    scale_rewards: str = "group",
    render: Render | None = None,
    max_tokens_per_row: int | None = None,
    call_weights: Mapping[str, float] | None = None,
) -> Batch:
    """Samples of `groups` (`Store.get_group` dicts) with their group-relative advantages,
    computed over exactly the sessions that train.

    A session that yields no trainable sample (every call failed or was left by its client,
    greedy, orphaned, too long for a row) leaves its group first: its reward would otherwise
    move the others' advantages with no sample of its own to push down (rewards [1, 1, 0] whose
    0 failed would train both 1s at +0.71, "push everything up"). The rest train with
    advantages over them; a group left with fewer than 2 sessions, or without a reward spread
    among them, is skipped with the reason. `calls_by_session` maps a session id to its calls
    in order (`Store.session_calls`); with `max_tokens_per_row`, samples are fitted to rows
    first (`fit_to_rows`). `call_weights`: call id -> the loss weight of its tokens (1 if absent).
    """
    by_id = {g["id"]: g for g in groups}
    skipped: dict[str, str] = {}
    left_out: dict[str, str] = {}
    staying: dict[str, list[tuple[dict, list[Sample]]]] = {}
    cut = 0
    for gid, group in by_id.items():
        stay = []
        for session in trained_sessions(group):
            samples = trajectory_samples(
                calls_by_session.get(session["id"], []),
                trajectory_id=session["id"],
                group_id=gid,
                advantage=0.0,  # set below, once the group's sessions are known
                render=render,
                call_weights=call_weights,
            )
            if max_tokens_per_row is not None and samples:
                samples, dropped, n_cut = fit_to_rows(samples, max_tokens_per_row)
                cut += n_cut
                if not samples:
                    left_out[session["id"]] = TOO_LONG
                    continue
            if samples:
                stay.append((session, samples))
            else:
                left_out[session["id"]] = untrained_reason(calls_by_session.get(session["id"], [])) or NO_SAMPLE
        total = len(trained_sessions(group))
        if len(stay) < 2:
            skipped[gid] = NO_TOKENS if not stay else too_few(len(stay), total)
        else:
            staying[gid] = stay
    advantages_by_group, no_spread = compute_advantages(
        {gid: [float(session["reward"]) for session, _ in stay] for gid, stay in staying.items()}, scale_rewards
    )
    skipped.update({gid: NO_SPREAD for gid in no_spread})
    out: list[Sample] = []
    trained: list[str] = []
    rewards: list[float] = []
    sessions: dict[str, list[str]] = {}
    advantages: dict[str, float] = {}
    greedy = 0
    for gid, advantages_G in advantages_by_group.items():
        trained.append(gid)
        sessions[gid] = []
        for (session, samples), advantage in zip(staying[gid], advantages_G, strict=True):
            reward = float(session["reward"])
            out += [dataclasses.replace(sample, advantage=advantage, reward=reward) for sample in samples]
            sessions[gid].append(session["id"])
            advantages[session["id"]] = advantage
            rewards.append(reward)
            greedy += len(greedy_calls(calls_by_session.get(session["id"], [])))
    if greedy:
        log.info("%d greedy call(s) not trained (%s); their turns stay as context", greedy, GREEDY)
    return Batch(out, trained, skipped, rewards, greedy, sessions, advantages, left_out, cut)


def fit_to_rows(samples: Sequence[Sample], max_tokens: int) -> tuple[list[Sample], int, int]:
    """Samples that fit in a packed row: an over-long one keeps its first `max_tokens`
    tokens (the sampled prefix: attention is causal, so the kept tokens' logprobs do not
    change; the completion tokens cut off are simply not trained); one that would keep no
    trained token is dropped.

    Returns (samples, number dropped, number cut)."""
    fitted: list[Sample] = []
    cut = dropped = 0
    for sample in samples:
        if len(sample.token_ids) > max_tokens:
            if not any(sample.loss_mask[:max_tokens]):
                dropped += 1
                continue
            cut += 1
            sample = dataclasses.replace(
                sample,
                token_ids=sample.token_ids[:max_tokens],
                loss_mask=sample.loss_mask[:max_tokens],
                old_logprobs=sample.old_logprobs[:max_tokens],
                temperatures=sample.temperatures[:max_tokens] if sample.temperatures is not None else None,
                weights=sample.weights[:max_tokens] if sample.weights is not None else None,
            )
        fitted.append(sample)
    return fitted, dropped, cut


def token_budget(calls: Sequence[dict], default: int) -> int:
    """The largest completion budget (`max_tokens`) these calls asked for, `default`
    (`--default-max-tokens`) for a call that set none: on the run's first step, dr_grpo's
    fixed divisor when `--max-tokens-norm` is not set. Never None."""
    budgets = []
    for call in calls:
        value = (call.get("sampling") or {}).get("max_tokens")
        if value is None:
            request = call.get("request") or {}
            value = request.get("max_completion_tokens") or request.get("max_tokens")
        budgets.append(value if isinstance(value, int) and value > 0 else default)
    return max(budgets, default=default)


def answered_since(calls: Sequence[dict], since_step: int) -> bool:
    """Whether every answered call was answered by adapter step `since_step` or a later one
    (the base model counts as step 0): `--since-step`, for export and distillation alike."""
    answered = [c for c in calls if c.get("status") == "ok"]
    return bool(answered) and sampling_step(answered) >= since_step


def sampling_step(calls: Sequence[dict]) -> int:
    """The oldest adapter step that answered any of these calls (None, the base model,
    counts as step 0): how stale a group's logprobs are."""
    return min((c.get("step") or 0 for c in calls), default=0)


def load_groups(store: Store, group_ids: Sequence[str]) -> tuple[list[dict], dict[str, list[dict]]]:
    """Read groups and their sessions' calls from the store (the one I/O function here)."""
    groups = [store.get_group(gid) for gid in group_ids]
    calls = {s["id"]: store.session_calls(s["id"]) for g in groups for s in trained_sessions(g)}
    return groups, calls
