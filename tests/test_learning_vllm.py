"""GRPO learns SHOUT through the real vLLM (its CPU build), and shuffled rewards do not.

The loop of `rlproxy demo --engine vllm` without the HTTP in front of it: each step's
rollouts are sampled by a real vLLM through the gateway's own `VLLMEngine` (managed: it
starts and stops vLLM), which records each rollout's token ids and vLLM's behaviour
logprobs; the peft backend trains on them with the worker's code (advantages, GRPO step);
the adapter, on the projections only, is saved and hot-swapped into vLLM as `agent@N`,
which samples the next step. The control deals the same rewards out at random.
"""

from __future__ import annotations

import asyncio
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from gateway.demo import shout as demo_task
from gateway.engines.base import EngineRequest
from gateway.engines.vllm.build import vllm_engine
from gateway.engines.vllm.engine import VLLMEngine
from gateway.settings import Settings
from tests.helpers import free_port
from tests.helpers_real_vllm import vllm_python
from tests.helpers_trainer import grpo_samples
from trainer.backends.peft import PeftBackend
from trainer.step import train_step

pytestmark = pytest.mark.timeout(900)

# Fewer steps than the demo runs, larger ones (as tests/test_learning.py, which measured
# the shuffled control's random walk): 8 groups of 8 a step. Measured (seed 0, 3 runs alike):
# 8 steps 0.076 -> 0.810, shuffled 0.076 -> 0.142; 12 steps 0.076 -> 1.000, shuffled -> 0.258.
STEPS = 8
GROUPS_PER_STEP = 8
ROLLOUTS = 8
MAX_TOKENS = 6
EVAL_ROLLOUTS = 64
MARGIN = 0.4


def settings_for(state_dir, seed: int = 0) -> Settings:
    return Settings(
        state_dir=state_dir,
        seed=seed,
        engine="vllm",
        vllm_python=vllm_python(),
        vllm_port=free_port(),
        learning_rate=1e-2,
        lora_rank=8,
        lora_alpha=16,
        max_tokens_per_row=1024,
    )


async def learn(
    engine: VLLMEngine, state_dir, name: str, *, shuffle_rewards: bool, seed: int = 0
) -> tuple[float, float, list[dict]]:
    """STEPS steps sampled by `engine` (a started vLLM) with a fresh LoRA hot-swapped in as
    NAME@N; returns (reward before, reward after, step metrics). It leaves no adapter loaded:
    the next run on the same vLLM starts from the base model as on a fresh one."""
    state_dir.mkdir(parents=True)
    settings = settings_for(state_dir, seed)
    torch.manual_seed(seed)
    backend = PeftBackend(settings)
    rng, shuffler = random.Random(seed), random.Random(seed + 1)
    calls = 0

    async def group(adapter: str | None) -> list[tuple[list[int], list[int], list[float], float]]:
        """ROLLOUTS rollouts of one prompt: (prompt ids, completion ids, vLLM's logprobs, reward)."""
        nonlocal calls
        messages = demo_task.messages_for(demo_task.sample(rng))
        calls += ROLLOUTS
        completions = await asyncio.gather(
            *(
                engine.complete(
                    EngineRequest(
                        body={
                            "model": "agent",
                            "messages": messages,
                            "max_tokens": MAX_TOKENS,
                            "temperature": 1.0,
                            "seed": seed * 1_000_000 + calls + i,
                        },
                        adapter=adapter,
                        request_id=f"r{calls + i}",
                    )
                )
                for i in range(ROLLOUTS)
            )
        )
        rollouts = []
        for completion in completions:
            (choice,) = completion.tokens.choices
            assert choice.logprobs is not None and len(choice.logprobs) == len(choice.completion_ids)
            reply = completion.response["choices"][0]["message"]["content"]
            rollouts.append(
                (completion.tokens.prompt_ids, choice.completion_ids, choice.logprobs, demo_task.reward(reply))
            )
        return rollouts

    async def evaluate(adapter: str | None) -> float:
        groups = await asyncio.gather(*(group(adapter) for _ in range(EVAL_ROLLOUTS // ROLLOUTS)))
        return sum(r for rollouts in groups for *_, r in rollouts) / EVAL_ROLLOUTS

    metrics: list[dict] = []
    adapter = None  # step 0: the base model (a fresh LoRA's B is zero)
    try:
        before = await evaluate(adapter)
        for step in range(1, STEPS + 1):
            groups = await asyncio.gather(*(group(adapter) for _ in range(GROUPS_PER_STEP)))
            rewards = [r for rollouts in groups for *_, r in rollouts]
            if shuffle_rewards:  # the control: same rewards, dealt out at random across the batch
                shuffler.shuffle(rewards)
            samples = grpo_samples(
                [[rollout[:3] for rollout in rollouts] for rollouts in groups],
                rewards,
                scale_rewards=settings.scale_rewards,
                step=step,
            )
            if samples:
                metrics.append(train_step(backend, samples, settings))
            directory = state_dir / f"{name}@{step}"
            directory.mkdir()
            backend.save(directory)
            await engine.load_adapter(f"{name}@{step}", directory)  # the hot swap: the next step samples it
            if adapter is not None:
                await engine.unload_adapter(adapter)
            adapter = f"{name}@{step}"
        return before, await evaluate(adapter), metrics
    finally:
        if adapter is not None:
            await engine.unload_adapter(adapter)


async def learn_and_control(tmp_path) -> tuple[tuple[float, float, list[dict]], tuple[float, float, list[dict]]]:
    """The learning run, then the control, on one managed vLLM (its start is most of a run's
    time on CPU): each samples only the base model and its own adapters (agent@N, then
    control@N), every request with its own seed."""
    engine = vllm_engine(settings_for(tmp_path / "vllm"), startup_timeout=600)
    await engine.start()
    try:
        learned = await learn(engine, tmp_path / "learn", "agent", shuffle_rewards=False)
        control = await learn(engine, tmp_path / "control", "control", shuffle_rewards=True)
        return learned, control
    finally:
        await engine.close()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # vLLM has the other core
    yield
    torch.set_num_threads(previous)


def test_grpo_learns_shout_through_vllm_and_shuffled_rewards_do_not(tmp_path):
    (before, after, metrics), (control_before, control_after, _) = asyncio.run(learn_and_control(tmp_path))
    mismatch = [m["mismatch_logprob_abs"] for m in metrics]
    print(
        f"through vLLM: {before:.3f} -> {after:.3f}; shuffled rewards: {control_before:.3f} -> "
        f"{control_after:.3f}; mismatch per step {[f'{x:.1e}' for x in mismatch]}"
    )
    assert before <= 0.3  # the untrained model rarely shouts
    assert after >= before + MARGIN, f"reward rose only {before:.3f} -> {after:.3f}"
    assert control_after < control_before + MARGIN, (
        f"shuffled rewards reached {control_before:.3f} -> {control_after:.3f}: the margin does not tell learning apart"
    )
    # vLLM samples in float32 like the trainer: its behaviour logprobs are the trainer's pi_old
    # to float error, at step 0 (no adapter) and after every hot swap (its LoRA kernels).
    assert all(m["behaviour_unknown_fraction"] == 0.0 for m in metrics)
    assert max(mismatch) < 1e-3, mismatch
