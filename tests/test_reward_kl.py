"""`--reward-kl` (issue 39's guard against a gamed reward): each trajectory's reward less its KL to
the base, before the group's advantages, checked against hand-computed values and against the
base model scored directly with transformers."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers_trainer import Recorder, trainer_settings
from trainer import step as step_module
from trainer.advantages import kl_shaped_advantages
from trainer.packing import pack
from trainer.reward_kl import sample_kls, sample_sums, shape
from trainer.types import Sample
from trainer.worker import TrainerWorker


def test_the_kl_comes_off_the_reward_before_the_group_is_centred_and_scaled():
    # Equal rewards, so without the KL there is nothing to learn: the KL alone ranks them.
    # By hand: shaped = [1 - 0.1*10, 1 - 0.1*0] = [0, 1]; mean 0.5, std 0.5.
    advantages = kl_shaped_advantages({"g": {"a": 1.0, "b": 1.0}}, {"a": 10.0, "b": 0.0}, coef=0.1)
    assert advantages == pytest.approx({"a": -0.5 / 0.5001, "b": 0.5 / 0.5001})
    # Three rollouts: shaped = [0.9 - 0.05*4, 0.6 - 0.05*0, 0.3 - 0.05*2] = [0.7, 0.6, 0.2].
    advantages = kl_shaped_advantages({"g": {"a": 0.9, "b": 0.6, "c": 0.3}}, {"a": 4.0, "b": 0.0, "c": 2.0}, 0.05)
    mean = 0.5
    std = math.sqrt(((0.7 - mean) ** 2 + (0.6 - mean) ** 2 + (0.2 - mean) ** 2) / 3)
    assert advantages == pytest.approx({"a": 0.2 / (std + 1e-4), "b": 0.1 / (std + 1e-4), "c": -0.3 / (std + 1e-4)})
    # Dr. GRPO's scaling (none) only centres: [0.7, 0.6, 0.2] - 0.5.
    advantages = kl_shaped_advantages(
        {"g": {"a": 0.9, "b": 0.6, "c": 0.3}}, {"a": 4.0, "b": 0.0, "c": 2.0}, 0.05, scale_rewards="none"
    )
    assert advantages == pytest.approx({"a": 0.2, "b": 0.1, "c": -0.3})


def test_a_trajectorys_kl_sums_its_trained_tokens_with_a_known_behaviour_logprob():
    nan = math.nan

    def sample(trajectory: str, old: tuple[float, ...], mask: tuple[bool, ...]) -> Sample:
        return Sample(
            token_ids=tuple(range(1, len(old) + 1)),
            loss_mask=mask,
            old_logprobs=old,
            advantage=0.0,
            trajectory_id=trajectory,
            group_id="g",
            reward=0.0,
        )

    samples = [
        sample("a", (nan, nan, -1.0, -2.0), (False, False, True, True)),
        # its third token's behaviour logprob is unknown (an upstream's), its fourth is not trained
        sample("b", (nan, -0.5, nan, -3.0), (False, True, True, False)),
    ]
    (row,) = pack(samples, 64)
    ref_T = torch.tensor([-9.0, -9.0, -1.5, -1.0, -9.0, -0.25, -7.0, -9.0])  # row order: a's 4 tokens, then b's
    # a: (-1 - -1.5) + (-2 - -1) = -0.5; b: (-0.5 - -0.25) only = -0.25.
    assert sample_kls([row], [ref_T], 2) == pytest.approx([-0.5, -0.25])
    # log pi_ref over the same tokens: a: -1.5 + -1 = -2.5; b: -0.25.
    assert sample_sums([row], [ref_T], 2)[1] == pytest.approx([-2.5, -0.25])


def test_a_sharpened_kl_also_ranks_by_the_bases_own_likelihood():
    # Equal rewards and equal KLs: the plain KL cannot tell a from b; sharpened to pi_ref^1.5,
    # the penalty is KL - 0.5 log pi_ref: a: 2 - 0.5 * -10 = 7, b: 2 - 0.5 * -4 = 4. With C 0.5:
    # shaped [1 - 3.5, 1 - 2] = [-2.5, -1], mean -1.75, std 0.75.
    samples = [
        Sample(
            token_ids=(1, 2),
            loss_mask=(False, True),
            old_logprobs=(math.nan, 0.0),
            advantage=0.0,
            trajectory_id=t,
            group_id="g",
            reward=1.0,
        )
        for t in ("a", "b")
    ]
    per_sample, advantages, kls = shape(samples, [2.0, 2.0], 0.5, "group", [-10.0, -4.0], sharpen=1.5)
    assert advantages == pytest.approx({"a": -0.75 / 0.7501, "b": 0.75 / 0.7501})
    assert per_sample == pytest.approx([-0.75 / 0.7501, 0.75 / 0.7501])
    assert kls == {"a": 2.0, "b": 2.0}  # what the dashboard shows stays the plain KL
    plain, _, _ = shape(samples, [2.0, 2.0], 0.5, "group", [-10.0, -4.0])
    assert plain == [0.0, 0.0]
    with pytest.raises(ValueError, match="log pi_ref"):
        shape(samples, [2.0, 2.0], 0.5, "group", None, sharpen=1.5)


class OffsetRecorder(Recorder):
    """Records behaviour logprobs `offset[session]` nats per token above the base model's, as if a
    policy that had drifted from the base had sampled them: that session's KL to the base is then
    offset x its completion's length, whatever step the trainer is at (the reference is the base)."""

    offsets: dict[str, float] = {}

    def call(self, session_id, group_id, question, answer, step=0):
        real = self.logprobs
        shift = self.offsets.get(session_id, 0.0)
        self.logprobs = lambda prompt, completion: [x + shift for x in real(prompt, completion)]
        try:
            super().call(session_id, group_id, question, answer, step)
        finally:
            self.logprobs = real


@pytest.mark.parametrize("sharpen", [1.0, 1.5])
def test_the_step_trains_each_token_with_its_trajectorys_kl_shaped_advantage(tmp_path, monkeypatch, sharpen):
    coef = 0.05
    settings = trainer_settings(tmp_path, reward_kl=coef, reward_kl_sharpen=sharpen, lora_dropout=0.0)
    recorder = OffsetRecorder(settings)
    recorder.offsets = {"g1-s0": 0.3, "g1-s2": 0.1, "g2-s1": 0.2}
    recorder.group("g1", [1.0, 1.0, 0.5])
    recorder.group("g2", [0.0, 1.0])
    recorder.close()

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (segment ids, advantages) of each row the loss saw
    real_loss = step_module.compute_loss

    def spy(**kwargs):
        seen.append((kwargs["segment_ids"].clone(), kwargs["advantages"].clone()))
        return real_loss(**kwargs)

    monkeypatch.setattr(step_module, "compute_loss", spy)
    worker = TrainerWorker(settings)
    worker.start()
    try:
        metrics = worker.train_once(worker.groups_to_train())
        assert metrics is not None
        store = worker.store
        lengths, base = {}, {}
        for group, n in (("g1", 3), ("g2", 2)):
            for i in range(n):
                (call,) = store.session_calls(f"{group}-s{i}")
                lengths[f"{group}-s{i}"] = len(call["completion_ids"][0])
                # log pi_ref of the reply, scored directly with transformers
                base[f"{group}-s{i}"] = sum(recorder.logprobs(call["prompt_ids"], call["completion_ids"][0]))
        kl = {sid: recorder.offsets.get(sid, 0.0) * n for sid, n in lengths.items()}
        penalty = {sid: kl[sid] - (sharpen - 1.0) * base[sid] for sid in kl}
        expected = {}
        for group, rewards in (("g1", [1.0, 1.0, 0.5]), ("g2", [0.0, 1.0])):
            ids = [f"{group}-s{i}" for i in range(len(rewards))]
            shaped = [r - coef * penalty[sid] for r, sid in zip(rewards, ids, strict=True)]
            mean = sum(shaped) / len(shaped)
            std = math.sqrt(sum((x - mean) ** 2 for x in shaped) / len(shaped))
            expected.update({sid: (x - mean) / (std + 1e-4) for sid, x in zip(ids, shaped, strict=True)})
        if sharpen == 1.0:  # rewards 1.0 and 1.0 in g1: only the KL tells them apart, and the drifted one loses
            assert expected["g1-s0"] < expected["g1-s1"]
        stored = {s["id"]: s["advantage"] for g in ("g1", "g2") for s in store.get_group(g)["sessions"]}
        assert stored == pytest.approx(expected, abs=1e-5)
        assert metrics["reward_kl_max"] == pytest.approx(max(kl.values()), abs=1e-4)
        assert metrics["reward_kl_mean"] == pytest.approx(sum(kl.values()) / len(kl), abs=1e-4)
        # Every trained token went into the loss with its own trajectory's shaped advantage.
        plan_order = ["g1-s0", "g1-s1", "g1-s2", "g2-s0", "g2-s1"]  # the samples in the order packed
        trained = {}
        for segments, advantages in seen:
            for segment in segments.unique().tolist():
                if segment >= 0:
                    trained[segment] = set(advantages[segments == segment].tolist())
        assert sorted(trained) == list(range(len(plan_order)))
        for segment, values in trained.items():
            (value,) = values
            assert value == pytest.approx(expected[plan_order[segment]], abs=1e-5)
    finally:
        worker.close()
