"""Distillation learns: supervised steps on a teacher's recorded tic-tac-toe games teach the
built-in instruct model to play, which it cannot do cold; the same steps on the teacher's
answers shuffled across the games do not.

The teacher (`tictactoe.teacher_reply`: a fixed preference over the squares) is recorded the
way the `openai` engine records a hosted model: request and response only, no token ids, so
every call is re-rendered with the student's chat template (`trainer.sft.samples`), and the
steps are the worker's own (`trainer.sft.step.sft_step`). The student is scored by sampling
its moves, as in tests/test_learning_tictactoe.py.
"""

from __future__ import annotations

import asyncio
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from gateway.demo import tictactoe
from tests.test_learning_tictactoe import EVAL_GAMES, Player, one_thread, task_settings  # noqa: F401 (fixture)
from trainer.backends.peft import PeftBackend
from trainer.render import ChatTemplateRenderer
from trainer.sft.samples import session_samples
from trainer.sft.step import sft_step

TEACHER_GAMES = 160
SESSIONS_PER_STEP = 8
EPOCHS = 2
MARGIN = 0.3


def teacher_sessions(n: int, seed: int) -> list[list[dict]]:
    """`n` games of the teacher, each a session of calls as the openai engine records them."""
    rng = random.Random(seed)
    sessions = []
    for _ in range(n):
        calls: list[dict] = []

        async def chat(messages: list[dict], calls=calls) -> str:
            reply = tictactoe.teacher_reply(messages)
            calls.append(
                {
                    "id": f"call-{len(calls)}",
                    "status": "ok",
                    "http_status": 200,
                    "request": {"model": "teacher", "messages": [dict(m) for m in messages]},
                    "response": {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]},
                }
            )
            return reply

        asyncio.run(tictactoe.play(tictactoe.sample(rng), chat))
        sessions.append(calls)
    return sessions


def shuffled_answers(sessions: list[list[dict]], seed: int) -> list[list[dict]]:
    """The control: every reply dealt out at random to another call of the dataset (same
    replies, same histories otherwise), so what a reply answers is lost."""
    replies = [c["response"] for calls in sessions for c in calls]
    random.Random(seed).shuffle(replies)
    dealt = iter(replies)
    out = []
    for calls in sessions:
        history: list[dict] = []
        new_calls = []
        for call in calls:
            reply = next(dealt)
            messages = [*history, *call["request"]["messages"][len(history) :]]
            new_calls.append({**call, "request": {**call["request"], "messages": messages}, "response": reply})
            history = [*messages, reply["choices"][0]["message"]]
        out.append(new_calls)
    return out


def distil(tmp_path, sessions: list[list[dict]], seed: int = 0) -> tuple[float, float, int]:
    """SFT on `sessions`; (score before, score after, sessions trained)."""
    settings = task_settings(tmp_path, seed)
    torch.manual_seed(seed)
    backend = PeftBackend(settings)
    render = ChatTemplateRenderer(backend.tokenizer)
    player = Player(backend, seed)
    before = player.score(EVAL_GAMES, random.Random(1000 + seed))
    found = [session_samples(f"s{i}", calls, render) for i, calls in enumerate(sessions)]
    trained = [item.samples[0] for item in found if item.skipped is None]
    order = random.Random(seed)
    for _ in range(EPOCHS):
        order.shuffle(trained)
        for start in range(0, len(trained), SESSIONS_PER_STEP):
            sft_step(backend, trained[start : start + SESSIONS_PER_STEP], settings)
    return before, player.score(EVAL_GAMES, random.Random(2000 + seed)), len(trained)


def test_sft_on_a_teachers_games_teaches_the_cold_model_to_play_and_shuffled_answers_do_not(tmp_path):
    sessions = teacher_sessions(TEACHER_GAMES, seed=0)
    before, after, n = distil(tmp_path / "teacher", sessions)
    control_before, control_after, n_control = distil(tmp_path / "shuffled", shuffled_answers(sessions, seed=1))
    print(f"sft: {before:.3f} -> {after:.3f} ({n} sessions); shuffled: {control_before:.3f} -> {control_after:.3f}")
    assert n == TEACHER_GAMES and n_control == TEACHER_GAMES  # every game renders, none skipped
    assert before <= 0.3  # cold, the instruct model loses nearly every game
    assert after >= before + MARGIN, f"the score rose only {before:.3f} -> {after:.3f}"
    assert control_after < control_before + MARGIN, f"shuffled answers reached {control_after:.3f}"
