"""Demo task SHOUT (`rlproxy demo --task shout`): one call per episode.

The agent is asked to shout; its reward is the fraction of its reply's characters that
are capital letters. Why this task, for a randomly initialised tiny model on a CPU:

- the signal is dense and smooth: the untrained model writes byte-level noise in which
  about one character in twenty is a capital, so almost every group of rollouts has a
  reward spread for GRPO to learn from, and every extra capital counts;
- the baseline is low (about 0.05) and the ceiling is 1.0, so learning is unmistakable;
- it needs no knowledge, only a shift of the output distribution towards the 26
  single-capital tokens, which LoRA can learn in a few dozen small steps;
- replies are short (a few tokens), so a step's rollouts take well under a second.

The task shape is documented in `gateway.demo`; the driver does the HTTP.
"""

from __future__ import annotations

import random

NAME = "shout"
DESCRIPTION = "reply in CAPITAL LETTERS; reward = fraction of the reply's characters that are capitals A-Z"

PROMPTS = (
    "Shout! Reply in capital letters only.",
    "ANSWER IN UPPERCASE: what is your name?",
    "Yell the first thing that comes to mind, all caps.",
    "Say hello, but SHOUT it.",
    "Write a short headline in capital letters.",
    "Call out the alphabet, loudly.",
    "Respond with one loud word, all uppercase.",
    "Make some noise: capitals only!",
)

OPTIONS = {"rollouts": 8, "max_tokens": 6, "steps": 60}
SETTINGS = {"default_max_tokens": 8, "max_tokens_per_row": 1024}

SYSTEM = "You are a loud agent. You always answer in CAPITAL LETTERS."


def messages_for(prompt: str) -> list[dict]:
    """The chat a rollout sends: a fixed system message and one user prompt."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]


def sample(rng: random.Random) -> str:
    """The task of one group (every rollout of a group gets the same prompt)."""
    return rng.choice(PROMPTS)


sample_prompt = sample


async def episode(prompt: str, chat) -> float:
    """One rollout: ask once, score the reply."""
    return reward(await chat(messages_for(prompt)))


def reward(reply: str | None) -> float:
    """Fraction of the reply's characters that are capital letters A-Z (0 for an empty
    reply, so saying nothing is never the easy way out)."""
    if not reply:
        return 0.0
    return sum("A" <= ch <= "Z" for ch in reply) / len(reply)
