"""The trainer's rules in the corners (issue 27): dr_grpo's budget fixed for the run and saved
with the checkpoint, a new learning rate after a restart, AdamW without hidden weight decay,
cispo's cap as in TRL, reward_mean over the trained sessions, pi_old held across passes, and
a non-finite gradient norm refused like a non-finite loss."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.helpers_trainer import Recorder, trainer_settings
from trainer import step as step_module
from trainer.data import token_budget
from trainer.losses import compute_loss
from trainer.publish import plan_step
from trainer.step import NonFiniteStep, train_step
from trainer.types import CISPO_CAP, LossConfig
from trainer.worker import TrainerWorker


class BudgetRecorder(Recorder):
    """A `Recorder` whose calls ask for `max_tokens` (None: the client sets none)."""

    max_tokens: int | None = None

    def __init__(self, settings):
        super().__init__(settings)
        real = self.store.record_call_sync

        def record(call):
            if self.max_tokens is not None:
                call.request = {**call.request, "max_tokens": self.max_tokens}
            return real(call)

        self.store.record_call_sync = record


def record_groups(settings, groups: dict[str, list[float]], max_tokens: int | None = None) -> None:
    recorder = BudgetRecorder(settings)
    recorder.max_tokens = max_tokens
    for group_id, rewards in groups.items():
        recorder.group(group_id, rewards)
    recorder.close()


def started(settings) -> TrainerWorker:
    worker = TrainerWorker(settings)
    worker.start()
    return worker


def budgets_used(monkeypatch) -> list[int | None]:
    """The dr_grpo divisor of every step trained from now on."""
    seen: list[int | None] = []
    real = step_module.loss_config

    def spy(settings, token_budget=None):
        config = real(settings, token_budget)
        seen.append(config.max_tokens_norm)
        return config

    monkeypatch.setattr(step_module, "loss_config", spy)
    return seen


def saved_state(worker, step: int) -> dict:
    return json.loads((worker.root / f"{step:04d}" / "trainer_state.json").read_text())


# ------------------------------------------------------------------ dr_grpo's budget


def test_token_budget_counts_the_default_for_calls_that_set_none():
    calls = [{"sampling": {"max_tokens": 64}}, {"request": {"messages": []}}, {"sampling": {"max_tokens": None}}]
    assert token_budget(calls, default=256) == 256
    assert token_budget(calls[:1], default=32) == 64
    assert token_budget([], default=128) == 128


def test_dr_grpo_trains_calls_without_max_tokens_and_saves_the_budget(tmp_path):
    settings = trainer_settings(tmp_path, loss_type="dr_grpo", default_max_tokens=100)
    record_groups(settings, {"g1": [1.0, 0.0], "g2": [0.0, 1.0]})  # no client set max_tokens
    worker = started(settings)
    try:
        metrics = worker.train_once(worker.groups_to_train())
        assert metrics is not None and math.isfinite(metrics["loss"])
        assert worker.token_budget == 100 and saved_state(worker, 1)["token_budget"] == 100
    finally:
        worker.close()


def test_dr_grpo_budget_is_fixed_at_the_first_step_and_restored_on_restart(tmp_path, monkeypatch):
    settings = trainer_settings(tmp_path, loss_type="dr_grpo")
    record_groups(settings, {"a1": [1.0, 0.0], "a2": [0.0, 1.0]}, max_tokens=64)
    seen = budgets_used(monkeypatch)
    worker = started(settings)
    try:
        assert worker.train_once(worker.groups_to_train()) is not None
        record_groups(settings, {"b1": [1.0, 0.0], "b2": [0.0, 1.0]}, max_tokens=512)
        assert worker.train_once(worker.groups_to_train()) is not None
    finally:
        worker.close()
    assert seen == [64, 64]  # a larger max_tokens later does not change the step size
    record_groups(settings, {"c1": [1.0, 0.0], "c2": [0.0, 1.0]}, max_tokens=1024)
    worker = started(settings)
    try:
        assert worker.token_budget == 64  # restored from the checkpoint, not reset
        assert worker.train_once(worker.groups_to_train()) is not None
        assert saved_state(worker, 3)["token_budget"] == 64
    finally:
        worker.close()
    assert seen == [64, 64, 64]


def test_max_tokens_norm_is_the_budget_when_given(tmp_path, monkeypatch):
    settings = trainer_settings(tmp_path, loss_type="dr_grpo", max_tokens_norm=300)
    record_groups(settings, {"g1": [1.0, 0.0], "g2": [0.0, 1.0]}, max_tokens=64)
    seen = budgets_used(monkeypatch)
    worker = started(settings)
    try:
        assert worker.train_once(worker.groups_to_train()) is not None
        assert seen == [300] and saved_state(worker, 1)["token_budget"] == 300
    finally:
        worker.close()


# ------------------------------------------------------------------ restarts and the optimizer


def test_adamw_has_no_hidden_weight_decay(tmp_path):
    settings = trainer_settings(tmp_path)
    record_groups(settings, {})
    worker = started(settings)
    try:
        assert all(g["weight_decay"] == 0.0 for g in worker.backend.optimizer.param_groups)
    finally:
        worker.close()


def test_a_restart_with_a_new_learning_rate_trains_at_the_new_rate(tmp_path):
    settings = trainer_settings(tmp_path, learning_rate=1e-2)
    record_groups(settings, {"g1": [1.0, 0.0], "g2": [0.0, 1.0], "g3": [1.0, 0.0], "g4": [0.0, 1.0]})
    worker = started(settings)
    try:
        assert worker.train_once(worker.groups_to_train()) is not None
        saved = {k: v["exp_avg"].clone() for k, v in worker.backend.optimizer.state_dict()["state"].items()}
    finally:
        worker.close()
    worker = started(settings.model_copy(update={"learning_rate": 1e-3, "weight_decay": 0.05}))
    try:
        optimizer = worker.backend.optimizer
        assert all(g["lr"] == 1e-3 and g["weight_decay"] == 0.05 for g in optimizer.param_groups)
        state = optimizer.state_dict()["state"]  # the moments and step counts are kept
        assert all(torch.equal(state[k]["exp_avg"], saved[k]) for k in saved)
        assert all(float(s["step"]) == 1 for s in state.values())
        assert worker.train_once(worker.groups_to_train()) is not None
        assert all(g["lr"] == 1e-3 for g in optimizer.param_groups)
        assert all(float(s["step"]) == 2 for s in optimizer.state_dict()["state"].values())
    finally:
        worker.close()


# ------------------------------------------------------------------ cispo and reward_mean


def test_cispo_caps_the_ratio_at_epsilon_high_itself_as_trl_does():
    logp = torch.tensor([0.0, -1.0, -1.0, -1.0], requires_grad=True)
    ratios = [0.5, 3.0, 7.0]
    t = dict(
        logprobs=logp,
        old_logprobs=torch.tensor([math.nan] + [-1.0 - math.log(r) for r in ratios]),
        advantages=torch.ones(4),
        loss_mask=torch.tensor([False, True, True, True]),
        segment_ids=torch.zeros(4, dtype=torch.long),
        trajectory_tokens=torch.full((4,), 3.0),
    )

    def weights(config):
        logp.grad = None
        loss, metrics = compute_loss(config=config, **t)
        loss.backward()
        return [-3 * g for g in logp.grad.tolist()[1:]], metrics["clip_fraction"]

    assert CISPO_CAP == 5.0
    w, clipped = weights(LossConfig("cispo"))  # none given: TRL's recommended 5.0
    assert w == pytest.approx([0.5, 3.0, 5.0], rel=1e-5) and clipped == pytest.approx(1 / 3)
    w, clipped = weights(LossConfig("cispo", epsilon_high=2.0))  # the cap, not 1 + 2.0
    assert w == pytest.approx([0.5, 2.0, 2.0], rel=1e-5) and clipped == pytest.approx(2 / 3)


def test_reward_mean_counts_the_trained_sessions_only(tmp_path):
    settings = trainer_settings(tmp_path)
    record_groups(settings, {"g1": [1.0, 0.0, 0.5], "g2": [0.0, 1.0]})
    worker = started(settings)
    try:
        groups = sorted(worker.groups_to_train(), key=lambda g: g["id"])
        # a val session inside a train group, as a store from before the split check holds
        groups[0]["sessions"][2].update(split="val", reward=100.0)
        metrics = worker.train_once(groups)
        assert metrics is not None and metrics["reward_mean"] == pytest.approx(0.5)
    finally:
        worker.close()


# ------------------------------------------------------------------ pi_old and non-finite gradients


def test_pi_old_is_held_fixed_across_the_passes_of_a_step(tmp_path, monkeypatch):
    settings = trainer_settings(tmp_path, epochs_per_step=2)
    record_groups(settings, {"g1": [1.0, 0.0], "g2": [0.0, 1.0]})
    worker = started(settings)
    seen = []
    real = step_module.compute_loss

    def spy(**kw):
        mask = kw["loss_mask"].bool()
        seen.append((kw["logprobs"].detach()[mask].clone(), kw["old_logprobs"][mask].clone()))
        return real(**kw)

    monkeypatch.setattr(step_module, "compute_loss", spy)
    try:
        assert worker.train_once(worker.groups_to_train()) is not None
    finally:
        worker.close()
    rows = len(seen) // 2
    assert rows >= 1 and len(seen) == 2 * rows
    for first, second in zip(seen[:rows], seen[rows:], strict=True):
        assert torch.allclose(first[0], first[1], atol=1e-5)  # pass 1: pi_old is the policy
        assert torch.equal(second[1], first[1])  # pass 2: the same pi_old, not a new one
        assert (second[0] - second[1]).abs().max() > 1e-4  # while the policy has moved


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_gradient_norm_is_refused_like_a_non_finite_loss(tmp_path, bad):
    settings = trainer_settings(tmp_path)
    record_groups(settings, {"g1": [1.0, 0.0], "g2": [0.0, 1.0]})
    worker = started(settings)
    try:
        backend = worker.backend
        plan = plan_step(worker.store, settings, worker.render, worker.groups_to_train(), worker.next_step)
        real = backend.token_logprobs

        def bad_gradient(row):  # a finite loss whose gradient is not
            out = real(row)
            if out.requires_grad:
                out.register_hook(lambda g: g * bad)
            return out

        backend.token_logprobs = bad_gradient
        weights = [p.detach().clone() for p in backend._params]
        with pytest.raises(NonFiniteStep, match="gradient norm"):
            train_step(backend, plan.samples, settings)
        assert all(torch.equal(a, b) for a, b in zip(weights, backend._params, strict=True))
        assert backend.optimizer.state_dict()["state"] == {}  # AdamW never stepped
        # and through the worker: no step is published, the groups stay untrained
        assert worker.train_once(plan.groups) is None
        assert [s["step"] for s in worker.store.steps("agent")] == [0]
        assert all(worker.store.get_group(g["id"])["trained_step"] is None for g in plan.groups)
    finally:
        worker.close()


# ------------------------------------------------------------------ the KL to the base, at every step


@torch.no_grad()
def completion_logprobs(model, call: dict) -> torch.Tensor:
    """log p of each completion token of a recorded call, given everything before it."""
    prompt, completion = call["prompt_ids"], call["completion_ids"][0]
    logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + completion])).logits[0].float(), dim=-1)
    return torch.stack([logp[len(prompt) + i - 1, token] for i, token in enumerate(completion)])


def test_the_kl_to_the_base_is_reported_at_every_step_with_beta_0(tmp_path):
    """Issue 39: with no KL penalty the KL is still measured (the drift a gamed reward shows): the
    k3 mean over the step's trained tokens, of the adapter the step starts from against the base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from gateway.models.registry import resolve_base_model

    settings = trainer_settings(tmp_path, beta=0.0, lora_dropout=0.0)
    record_groups(settings, {"g1": [1.0, 0.0], "g2": [0.0, 1.0]})
    worker = started(settings)
    try:
        first = worker.train_once(worker.groups_to_train())
        record_groups(settings, {"g3": [1.0, 0.0, 0.5], "g4": [0.0, 1.0]})
        second = worker.train_once(worker.groups_to_train())
        store, root = worker.store, worker.root
        assert first is not None and second is not None
        # The fresh adapter is the base (LoRA's B starts at zero): no distance yet.
        assert first["kl"] == pytest.approx(0.0, abs=1e-7)
        # By hand with transformers: the base alone, and step 1's saved adapter on a base of its own.
        path = resolve_base_model(settings.base_model, settings.state_dir)
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        fresh = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        policy = PeftModel.from_pretrained(fresh, root / "0001").eval()
        k3 = []
        for group, n in (("g3", 3), ("g4", 2)):
            for i in range(n):
                (call,) = store.session_calls(f"{group}-s{i}")
                d = completion_logprobs(base, call) - completion_logprobs(policy, call)
                k3.append(torch.exp(d) - d - 1)
        expected = float(torch.cat(k3).mean())
        assert expected > 1e-4  # step 1 moved the adapter away from the base
        assert second["kl"] == pytest.approx(expected, rel=1e-3)
        assert [s["metrics"]["kl"] for s in store.steps("agent") if s["step"]] == [first["kl"], second["kl"]]
    finally:
        worker.close()
