"""Sessions as the trainer's own samples, each tied to the call whose conversation it is.

Samples come from the trainer's public functions (`trainer.data.build_batch`,
`trajectory_samples`), never re-derived here, so an export holds exactly the token ids,
loss masks and behaviour logprobs the trainer trains on:

- a session whose group was trained at step S gets the samples of step S's batch, rebuilt with
  the settings saved beside that step's checkpoint (`max_tokens_per_row` decides which samples
  were left out; a checkpoint `--keep-checkpoints` removed: those of the newest checkpoint of
  that model still there, the run's), and the advantage the step recorded for the session (the
  one it trained with, whatever settings the rebuilt batch would give);
- any other session (val, not yet trained, no reward spread) gets the samples the trainer
  would build from it, with no step and no advantage.

A sample merges consecutive calls of a session (`trainer.data`): its tokens are the last
merged call's prompt + completion, so that call's request messages plus its reply are the
sample's conversation.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.errors import ConfigError
from gateway.export.openai_format import reply_position
from gateway.store import Store
from trainer.data import build_batch, call_turn, trained_sessions, trajectory_samples
from trainer.retries import trainable_calls
from trainer.types import Sample

log = logging.getLogger("rlproxy.export")


@dataclass(frozen=True)
class ExportedSample:
    sample: Sample
    session: dict
    """The session row (`Store.get_session`, calls included)."""
    call: dict
    """The last call merged into the sample: its request + reply is the sample's conversation."""
    trained: frozenset[int]
    """Positions of the conversation's assistant messages the sample trains (`trained_replies`)."""
    index: int
    """Position of the sample among its session's samples."""
    step: int | None
    """The step that trained this sample; None if it was never trained."""
    advantage: float | None
    """The advantage it was trained with; None if it was never trained."""


class LazyRenderer:
    """`trainer.render.ChatTemplateRenderer` over the base model's tokenizer, loaded on the
    first call recorded without token ids (the `openai` engine); exports of sessions the
    local or vLLM engine answered never load a tokenizer."""

    def __init__(self, base_model: str, state_dir: Path, chat_template: str | None = None):
        self.base_model = base_model
        self.state_dir = state_dir
        self.chat_template = chat_template  # --chat-template: the one the trainer rendered with
        self._render = None

    def __call__(self, request: dict, response: dict):
        if self._render is None:
            from gateway.models.registry import resolve_base_model
            from gateway.models.templates import load_tokenizer
            from trainer.render import ChatTemplateRenderer

            path = resolve_base_model(self.base_model, self.state_dir)
            try:
                tokenizer = load_tokenizer(path, self.chat_template)
            except OSError as exc:  # an id not in this machine's cache (offline), or none on the Hub
                said = (str(exc).strip().splitlines() or [""])[0]
                raise ConfigError(
                    f"cannot load the tokenizer of --base-model '{self.base_model}' to render the calls recorded "
                    f"without token ids ({said}): give the model the gateway served, as a local path or a "
                    "Hugging Face id available offline"
                ) from None
            self._render = ChatTemplateRenderer(tokenizer)
        return self._render(request, response)


def _ends_with(partial: Sample, sample: Sample) -> bool:
    """Whether the calls so far, merged, reach the end of `sample`: they hold its tokens and mask
    as their start. Equal for a sample trained whole; longer for one the trainer cut to
    `max_tokens_per_row` (`fit_to_rows`), which the call whose reply crosses the cut ends."""
    n = len(sample.token_ids)
    return partial.token_ids[:n] == sample.token_ids and partial.loss_mask[:n] == sample.loss_mask


def last_calls(calls: list[dict], samples: list[Sample], render: Any) -> list[int | None]:
    """For each sample of a session, the position in `calls` of the call that ends it: the
    first prefix of the session's calls whose last sample reaches its end (`_ends_with`; a later
    call either extends it or starts a new one, which does not start with it). Quadratic in
    calls; sessions are short."""
    found: list[int | None] = [None] * len(samples)
    for k in range(len(calls)):
        partial = trajectory_samples(calls[: k + 1], trajectory_id="x", group_id="x", advantage=0.0, render=render)
        if not partial:
            continue
        for i, sample in enumerate(samples):
            if found[i] is None and _ends_with(partial[-1], sample):
                found[i] = k
                break
    return found


def trained_replies(calls: list[dict], first: int, last: int, render: Any) -> set[int]:
    """Where the replies that a sample trains stand in its conversation (the request of
    `calls[last]` plus its reply): those of the calls `first..last` merged into it whose
    completion is trained (not greedy, not a retry orphan or a call left by its client).
    The sample's other assistant messages are context the trainer never trained on."""
    kept = {id(call) for call in trainable_calls(calls)}
    positions = set()
    for call in calls[first : last + 1]:
        if id(call) in kept and (turn := call_turn(call, render)) is not None and turn.trained:
            positions.add(reply_position(call.get("request") or {}))
    return positions


def _read_settings(row: dict) -> dict | None:
    try:
        return json.loads((Path(row["path"]) / "settings.json").read_text())
    except (OSError, ValueError):
        return None


STEPS_KEPT = 8
"""Step batches `StepBatches` keeps rebuilt: sessions come oldest first, so those of one step
come together, and an export of many steps holds a few steps' samples, not every one."""


class StepBatches:
    """The batch each step trained on, rebuilt when a session of it comes and kept while
    recent (`STEPS_KEPT`)."""

    def __init__(self, store: Store, settings_dir: Path, render: Any):
        self.store = store
        self.render = render
        self.models_dir = Path(settings_dir)
        self._rows = {(row["model"], row["step"]): row for row in store.steps()}
        self._cache: OrderedDict[tuple[str, int], dict[str, list[Sample]]] = OrderedDict()

    def _settings(self, row: dict) -> dict:
        """The settings saved beside the step's checkpoint; where it is gone (--keep-checkpoints), those
        of the newest checkpoint of the model still there (the run's); defaults where none is left."""
        saved = _read_settings(row)
        if saved is not None:
            return saved
        steps = sorted((r for r in self._rows.values() if r["model"] == row["model"]), key=lambda r: -r["step"])
        found = next(((r["step"], s) for r in steps if (s := _read_settings(r)) is not None), None)
        log.warning(
            "step %s@%s: its checkpoint's settings.json is gone; rebuilding its batch with %s",
            row["model"],
            row["step"],
            f"the settings of step {found[0]}" if found else "default settings",
        )
        return found[1] if found else {}

    def samples(self, model: str, step: int) -> dict[str, list[Sample]]:
        """Session id -> its samples in step `step` of `model` (empty if the step is unknown)."""
        key = (model, step)
        if key not in self._cache:
            row = self._rows.get(key)
            by_session: dict[str, list[Sample]] = {}
            if row is not None:
                saved = self._settings(row)
                groups = [self.store.get_group(gid) for gid in row["groups"]]
                calls = {s["id"]: self.store.session_calls(s["id"]) for g in groups for s in trained_sessions(g)}
                batch = build_batch(
                    groups,
                    calls,
                    scale_rewards=saved.get("scale_rewards", "group"),
                    render=self.render,
                    max_tokens_per_row=saved.get("max_tokens_per_row"),
                )
                for sample in batch.samples:
                    by_session.setdefault(sample.trajectory_id, []).append(sample)
            self._cache[key] = by_session
            if len(self._cache) > STEPS_KEPT:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return self._cache[key]


def exported_samples(store: Store, sessions: Iterable[dict], render: Any, models_dir: Path) -> Iterator[ExportedSample]:
    batches = StepBatches(store, models_dir, render)
    groups: dict[str, dict] = {}
    for session in sessions:
        gid = session.get("group_id")
        trained_step = None
        if gid:
            if gid not in groups:
                groups[gid] = store.get_group(gid)
            trained_step = groups[gid].get("trained_step")
        calls = session["calls"]
        if trained_step is not None and not session.get("discarded"):
            samples = batches.samples(session["model"], trained_step).get(session["id"], [])
            step, trained = trained_step, True
        else:
            samples = trajectory_samples(
                calls, trajectory_id=session["id"], group_id=gid or "", advantage=0.0, render=render
            )
            step, trained = None, False
        first = 0
        for index, (sample, last) in enumerate(zip(samples, last_calls(calls, samples, render), strict=False)):
            if last is None:  # cannot happen with the trainer's merge rule; never guess a conversation
                log.warning("session %s: sample %d matches no call; left out", session["id"], index)
                continue
            yield ExportedSample(
                sample,
                session,
                calls[last],
                frozenset(trained_replies(calls, first, last, render)),
                index,
                step if trained else None,
                _trained_advantage(session, sample) if trained else None,
            )
            first = last + 1


def _trained_advantage(session: dict, sample: Sample) -> float:
    """The advantage the session trained with, as its step recorded it; the rebuilt batch's where
    none was recorded (a store from before that was kept)."""
    recorded = session.get("advantage")
    return float(recorded) if recorded is not None else sample.advantage
