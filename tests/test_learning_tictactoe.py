"""A short learning run on the tic-tac-toe task: the real peft backend and GRPO step teach
the built-in instruct model to play, and the same run with shuffled rewards does not.

What is measured is the game score on fresh games (1 win, 0.5 draw, 0 loss; an illegal
move loses), as the demo reports it. The untrained instruct model names an item of the
board (a free square's number, or X or O) and so loses nearly every game by a taken
square; GRPO has to teach it to pick free squares, and good ones.

As in tests/test_learning.py, no gateway: the moves are sampled straight from the backend's
model, one chat completion per move in one growing conversation (the task's own
`episode`), each call recorded as the local engine records it (prompt ids from the real
chat template, sampled ids, their sampling logprobs); then the worker's own code:
`trainer.data.trajectory_samples` merges a game into one sample that trains only the move
tokens, `trainer.advantages.compute_advantages`, `trainer.step.train_step`.
"""

from __future__ import annotations

import asyncio
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from gateway.demo import tictactoe
from gateway.engines.local.jobs import Sampling
from gateway.engines.local.sampling import processed_logprobs
from gateway.models.tuning import TINY_MODEL_SETTINGS
from gateway.settings import Settings
from trainer.advantages import compute_advantages
from trainer.backends.peft import PeftBackend
from trainer.data import trajectory_samples
from trainer.step import train_step

# The demo's recipe for this task (its OPTIONS and SETTINGS: the instruct model, the built-in
# models' tuned learning rate), fewer steps. Groups without a reward spread are skipped and
# resampled, as the trainer and the demo driver do. Measured here (score before -> after,
# 64 games): seed 0, 8 steps, 0.05 -> 0.66; shuffled rewards 0.05 -> 0.08.
STEPS = 8
GROUPS_PER_STEP = TINY_MODEL_SETTINGS["groups_per_step"]
ROLLOUTS = tictactoe.OPTIONS["rollouts"]
MAX_TOKENS = tictactoe.OPTIONS["max_tokens"]
LEARNING_RATE = tictactoe.SETTINGS.get("learning_rate", TINY_MODEL_SETTINGS["learning_rate"])
EVAL_GAMES = 64
MAX_TRIES = 10 * GROUPS_PER_STEP  # groups sampled at most per step
MARGIN = 0.3  # the trained score must beat the untrained one's by this much


class Player:
    """Plays the task's games with the backend's current policy (adapter on), recording
    every call as the local engine does."""

    def __init__(self, backend: PeftBackend, seed: int):
        self.backend = backend
        self.tokenizer = backend.tokenizer
        self.eos_id = self.tokenizer.eos_token_id
        self.sampling = Sampling(
            max_new_tokens=MAX_TOKENS,
            temperature=1.0,
            top_p=1.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            stops=[],
            top_logprobs=0,
        )
        self.generator = torch.Generator().manual_seed(seed)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    @torch.no_grad()
    def complete(self, prompt: list[int]) -> tuple[list[int], list[float]]:
        ids, completion, logprobs = list(prompt), [], []
        for _ in range(MAX_TOKENS):
            logits_1V = self.backend.model(input_ids=torch.tensor([ids])).logits[:, -1].float()
            logp_1V = processed_logprobs(logits_1V, [self.sampling], [prompt], [completion])
            token = int(torch.multinomial(logp_1V.exp(), 1, generator=self.generator)[0, 0])
            completion.append(token)
            logprobs.append(float(logp_1V[0, token]))
            ids.append(token)
            if token == self.eos_id:
                break
        return completion, logprobs

    def chat_for(self, calls: list[dict]):
        """The task's `chat`: one sampled move per call, recorded into `calls`."""

        async def chat(messages: list[dict]) -> str:
            prompt = self.prompt_ids(messages)
            completion, logprobs = self.complete(prompt)
            calls.append(
                {
                    "status": "ok",
                    "prompt_ids": prompt,
                    "completion_ids": [completion],
                    "behaviour_logprobs": [logprobs],
                    "request": {"temperature": 1.0},
                }
            )
            return self.tokenizer.decode(completion, skip_special_tokens=True)

        return chat

    def game(self, spec: tictactoe.Game) -> tuple[float, list[dict]]:
        """One game: (shaped training reward, recorded calls)."""
        calls: list[dict] = []
        reward, _score = asyncio.run(tictactoe.episode(spec, self.chat_for(calls)))
        return reward, calls

    def score(self, n_games: int, rng: random.Random) -> float:
        """Mean game score (not the shaped training reward) over `n_games` fresh games."""
        total = 0.0
        for _ in range(n_games):
            chat = self.chat_for(calls=[])
            total += asyncio.run(tictactoe.play(tictactoe.sample(rng), chat))[0]
        return total / n_games


def task_settings(tmp_path, seed: int) -> Settings:
    """The demo's recipe for the task: the instruct model, the built-in models' LoRA and rate."""
    return Settings(
        state_dir=tmp_path,
        seed=seed,
        learning_rate=LEARNING_RATE,
        base_model=tictactoe.SETTINGS["base_model"],
        lora_rank=TINY_MODEL_SETTINGS["lora_rank"],
        lora_alpha=TINY_MODEL_SETTINGS["lora_alpha"],
        max_tokens_per_row=tictactoe.SETTINGS["max_tokens_per_row"],
    )


def run(tmp_path, *, shuffle_rewards: bool, seed: int = 0, steps: int = STEPS) -> tuple[float, float]:
    """Train `steps` steps; returns the score (before, after) on fresh games."""
    settings = task_settings(tmp_path, seed)
    torch.manual_seed(seed)
    backend = PeftBackend(settings)
    player = Player(backend, seed)
    games, shuffler = random.Random(seed), random.Random(seed + 1)
    before = player.score(EVAL_GAMES, random.Random(1000 + seed))
    for step in range(steps):
        groups: list[tuple[str, list[float], list[list[dict]]]] = []
        for tries in range(MAX_TRIES):
            if len(groups) == GROUPS_PER_STEP:
                break
            spec = tictactoe.sample(games)  # the opponent's dice, shared by the group
            played = [player.game(spec) for _ in range(ROLLOUTS)]
            rewards = [reward for reward, _ in played]
            if max(rewards) - min(rewards) > 1e-6:  # no spread teaches nothing: sample another
                groups.append((f"s{step}-g{tries}", rewards, [calls for _, calls in played]))
        rewards = [r for _, group_rewards, _ in groups for r in group_rewards]
        if shuffle_rewards:  # the control: same rewards, dealt out at random across the batch
            shuffler.shuffle(rewards)
        by_group = {gid: rewards[i * ROLLOUTS : (i + 1) * ROLLOUTS] for i, (gid, _, _) in enumerate(groups)}
        advantages, _ = compute_advantages(by_group, settings.scale_rewards)
        samples = [
            sample
            for gid, _, sessions in groups
            if gid in advantages
            for i, calls in enumerate(sessions)
            for sample in trajectory_samples(
                calls, trajectory_id=f"{gid}-r{i}", group_id=gid, advantage=advantages[gid][i]
            )
        ]
        if samples:
            train_step(backend, samples, settings)
    return before, player.score(EVAL_GAMES, random.Random(2000 + seed))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Small matrices: one thread is fastest and leaves the other core to the rest of the suite.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_grpo_learns_to_play_and_shuffled_rewards_do_not(tmp_path):
    before, after = run(tmp_path / "learn", shuffle_rewards=False)
    control_before, control_after = run(tmp_path / "control", shuffle_rewards=True)
    print(f"score: learning {before:.3f} -> {after:.3f}; shuffled rewards {control_before:.3f} -> {control_after:.3f}")
    assert before <= 0.3  # the demo's baseline aim: the untrained model loses nearly every game
    assert after >= before + MARGIN, f"the score rose only {before:.3f} -> {after:.3f}"
    assert control_after < control_before + MARGIN, (
        f"shuffled rewards reached {control_before:.3f} -> {control_after:.3f}: the margin does not tell learning apart"
    )
