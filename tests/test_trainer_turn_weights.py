"""Issue 38, item 6: with live groups and shadow samples both on, a shadowed live turn is in two
groups (its live group and, as the copy of the live answer, its shadow group); it carries the
same total weight as a turn that is in one: 1/2 in each when both groups train in one step, all
of it in the group that trains first otherwise. The weights are read back from the loss's
gradient in a real step of the tiny model."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest
import torch

from gateway.engines.base import ChoiceTokens, TokenRecord
from gateway.shadow.calls import group_id_for, shadow_calls
from gateway.store import CallRecord, LiveRule
from tests.helpers_trainer import Recorder, trainer_settings
from trainer import step as step_module
from trainer.worker import TrainerWorker

SAMPLING = {"temperature": 1.0}


def answered(recorder: Recorder, call_id: str, session_id: str, question: str, answer: str) -> CallRecord:
    """A live call of an ungrouped session, as the local engine records it (step 0)."""
    messages = [{"role": "user", "content": question}]
    text = recorder.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = recorder.encode(text)
    completion = recorder.encode(answer + recorder.tokenizer.eos_token)
    return CallRecord(
        id=call_id,
        session_id=session_id,
        group_id=None,
        split="train",
        model="agent",
        served="agent@0",
        step=0,
        engine="local",
        stream=False,
        status="ok",
        request={"model": "agent", "messages": messages},
        response={"choices": [{"index": 0, "message": {"role": "assistant", "content": answer}}]},
        latency_ms=1.0,
        prompt_ids=prompt,
        completion_ids=[completion],
        behaviour_logprobs=[recorder.logprobs(prompt, completion)],
        sampling=SAMPLING,
        task_key="support",
    )


def shadow(recorder: Recorder, live: CallRecord, answers: list[str], rewards: list[float]) -> str:
    """The shadow group of `live` (gateway.shadow.calls builds its rows), judged: the copy of the
    live answer first, then one session per shadow answer."""
    completions = [recorder.encode(a + recorder.tokenizer.eos_token) for a in answers]
    tokens = TokenRecord(
        live.prompt_ids,
        [ChoiceTokens(ids, recorder.logprobs(live.prompt_ids, ids)) for ids in completions],
        SAMPLING,
    )
    choices = [{"index": i, "message": {"role": "assistant", "content": a}} for i, a in enumerate(answers)]
    rows = shadow_calls(live, {"choices": choices}, tokens, latency_ms=1.0)
    group_id = asyncio.run(recorder.store.record_shadow_group(rows))
    for row, reward in zip(rows, rewards, strict=True):
        asyncio.run(recorder.store.set_reward(row.session_id, reward))
    asyncio.run(recorder.store.close_group(group_id))
    return group_id


class LossWeights:
    """The loss weight of every trained token of the next step, per session, read back from the
    gradient: with dapo at ratio 1 (one pass) and no importance correction,
    d loss / d logprob_t = -w_t * A_t / N (N: the batch's trained tokens)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.by_session: dict[str, list[float]] = defaultdict(list)
        real_pack, real_loss = step_module.pack, step_module.compute_loss
        packed: dict = {}

        def pack(samples, max_tokens_per_row):
            packed.update(samples=list(samples), rows=real_pack(samples, max_tokens_per_row), next=0)
            return packed["rows"]

        def compute_loss(**kw):
            loss, metrics = real_loss(**kw)
            (grad_T,) = torch.autograd.grad(loss, kw["logprobs"], retain_graph=True)
            row = packed["rows"][packed["next"]]
            packed["next"] += 1
            for t in torch.nonzero(row.loss_mask_T).flatten().tolist():
                session = packed["samples"][int(row.segment_ids_T[t])].trajectory_id
                weight = -float(grad_T[t]) * kw["norm"].num_loss_tokens / float(row.advantages_T[t])
                self.by_session[session].append(weight)
            return loss, metrics

        monkeypatch.setattr(step_module, "pack", pack)
        monkeypatch.setattr(step_module, "compute_loss", compute_loss)

    def of(self, session_id: str) -> float:
        """The weight of a session's tokens: one value for all of them."""
        weights = self.by_session.pop(session_id)
        assert max(weights) - min(weights) < 1e-4, weights
        return weights[0]


def test_a_shadowed_live_turn_weighs_as_much_as_an_unshadowed_one(tmp_path, monkeypatch):
    settings = trainer_settings(tmp_path, groups_per_step=2, loss_type="dapo", tis_cap=0.0, lora_dropout=0.0)
    recorder = Recorder(settings)
    live = [answered(recorder, f"c{i}", f"live-{i}", f"What is {i} + 1?", a) for i, a in enumerate(["1", "No.", "3"])]
    for call in live:
        recorder.store.record_call_sync(call)
    # Ready in this order: the shadow group of live-0's turn, the live group, the shadow group of live-1's.
    first_shadow = shadow(recorder, live[0], ["2", "Two."], [1.0, 0.0, 0.3])
    rule = LiveRule(group_size=3, max_staleness=2)
    rewards = zip(live, [1.0, 0.0, 0.2], strict=True)
    joined = [asyncio.run(recorder.store.set_reward(c.session_id, r, None, rule)) for c, r in rewards]
    live_group = joined[0]["group_id"]
    second_shadow = shadow(recorder, live[1], ["It is 2.", "2"], [0.0, 1.0, 0.6])
    recorder.close()
    assert first_shadow == group_id_for("c0") and {j["group_id"] for j in joined} == {live_group}
    weights = LossWeights(monkeypatch)
    worker = TrainerWorker(settings)
    worker.start()
    try:
        groups = worker.groups_to_train()
        assert [g["id"] for g in groups] == [first_shadow, live_group]
        assert worker.train_once(groups) is not None
        # Both groups of live-0's turn in one step: 1/2 in each, 1 in all, as an unshadowed turn's.
        assert weights.of("live-0") == pytest.approx(0.5, abs=1e-4)
        assert weights.of(f"{first_shadow}-0") == pytest.approx(0.5, abs=1e-4)
        # live-1's shadow group trains later: the live group, first, gives its turn the whole weight.
        for session in ("live-1", "live-2", f"{first_shadow}-1", f"{first_shadow}-2"):
            assert weights.of(session) == pytest.approx(1.0, abs=1e-4)
        assert not weights.by_session
        assert worker.train_once([worker.store.get_group(second_shadow)]) is not None
        # ... and the shadow group, later, keeps the copy for its advantages but trains it with weight 0.
        assert weights.of(f"{second_shadow}-0") == pytest.approx(0.0, abs=1e-4)
        for session in (f"{second_shadow}-1", f"{second_shadow}-2"):
            assert weights.of(session) == pytest.approx(1.0, abs=1e-4)
        assert [s["metrics"]["shared_turns"] for s in worker.store.steps("agent")[1:]] == [2, 1]
    finally:
        worker.close()
