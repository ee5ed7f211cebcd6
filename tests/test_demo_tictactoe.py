"""The tic-tac-toe demo task: its rules, and how a whole game trains.

The mask test plays a whole game through `tictactoe.episode` with a scripted player,
records each move as the local engine would (prompt ids from the real chat template, the
move's tokens as the completion), and checks that the merged sample trains exactly the
move tokens: reference positions come from lengths of separately encoded pieces, not from
the code under test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random

import pytest
from transformers import AutoTokenizer

from gateway.demo import load_task, tictactoe
from gateway.demo.options import add_arguments, options_from_args
from gateway.errors import ConfigError
from gateway.models.tiny import ensure_tiny_model
from gateway.store import SessionFilter
from trainer.data import trajectory_samples


def play(game, player) -> tuple[tuple[float, float], list[list[dict]], list[str]]:
    """Run one episode; returns (result, the messages of every call, every reply)."""
    calls, replies = [], []

    async def chat(messages):
        calls.append([dict(m) for m in messages])
        reply = player(messages)
        replies.append(reply)
        return reply

    return asyncio.run(tictactoe.episode(game, chat)), calls, replies


def script(*moves: str):
    """A player that plays `moves` in order (the n-th user turn gets the n-th move)."""
    return lambda messages: moves[sum(m["role"] == "user" for m in messages) - 1]


def free_squares(messages) -> list[str]:
    return [cell for cell in messages[-1]["content"].split() if cell.isdigit()]


def test_rules_moves_and_rewards():
    board = [" "] * 9
    assert tictactoe.parse_move("5", board) == 4 and tictactoe.parse_move(" 9 because", board) == 8
    assert tictactoe.parse_move("0", board) is None and tictactoe.parse_move("X", board) is None
    assert tictactoe.parse_move(None, board) is None
    board[4] = "O"
    assert tictactoe.parse_move("5", board) is None  # taken
    assert tictactoe.render(board) == "1 2 3\n4 O 6\n7 8 9"
    assert tictactoe.winner(list("XXX O O  ")) == "X" and tictactoe.winner(list("O  XO X O")) == "O"
    assert tictactoe.winner(list("XOXXOOOXX")) is None

    game = tictactoe.Game(dice=(0.0, 0.0, 0.0, 0.0))  # O always takes the lowest free square
    (reward, score), calls, _ = play(game, script("5", "9", "3", "7"))
    # X 5, O 1; X 9, O 2; X 3 (threatens 3-5-7 and 3-6-9... O takes 4); X 7 wins 3-5-7.
    assert (reward, score) == (1.0, 1.0) and len(calls) == 4
    (reward, score), calls, _ = play(game, script("5", "hello"))
    assert score == 0.0 and reward == pytest.approx(tictactoe.LEGAL_MOVE_REWARD)  # one legal move, then a bad one
    (reward, score), _, _ = play(game, lambda m: "1")  # 1 then 1 again: taken, loses at once
    assert score == 0.0 and reward < tictactoe.PLAYED_LOSS_REWARD


def test_a_group_shares_the_opponents_dice_and_the_scale_needs_real_play():
    assert tictactoe.sample(random.Random(3)) == tictactoe.sample(random.Random(3))
    rng = random.Random(0)
    games = [tictactoe.sample(rng) for _ in range(2000)]
    legal = random.Random(1)
    knows_rules = sum(play(g, lambda m: legal.choice(free_squares(m)))[0][1] for g in games) / len(games)
    order = "519738246"  # centre, corners, edges: a fixed preference that a model can learn
    prefers = sum(play(g, lambda m: next(s for s in order if s in free_squares(m)))[0][1] for g in games) / len(games)
    # The demo's aim (0.8) lies between playing by the rules only and playing with a plan.
    assert 0.6 < knows_rules < 0.7, knows_rules
    assert prefers > 0.85, prefers


def test_unknown_task_is_a_clear_error():
    with pytest.raises(ConfigError, match="choose one of: shout, tictactoe"):
        load_task("../etc/passwd")


def test_a_run_stops_as_converged_only_after_the_tasks_streak_of_perfect_groups():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert options_from_args(parser.parse_args(["--task", "tictactoe"])).converge_after == 32
    assert options_from_args(parser.parse_args([])).converge_after == 8  # SHOUT: the driver's default
    assert options_from_args(parser.parse_args(["--task", "tictactoe", "--converge-after", "4"])).converge_after == 4
    with pytest.raises(ConfigError, match="--converge-after must be at least 1"):
        options_from_args(parser.parse_args(["--converge-after", "0"]))


def test_a_demo_refuses_a_held_out_set_no_cpu_could_play_before_training():
    # `--rollouts 100000` played eval-groups x 100000 sessions before the first step, --seconds aside.
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert options_from_args(parser.parse_args(["--rollouts", "64", "--eval-groups", "64"])).rollouts == 64
    for flags, refusal in (
        (["--rollouts", "100000"], "--rollouts must be at most 64"),
        (["--eval-groups", "65"], "--eval-groups must be at most 64"),
    ):
        with pytest.raises(ConfigError, match=refusal):
            options_from_args(parser.parse_args(flags))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(ensure_tiny_model(tmp_path_factory.mktemp("tiny")))


def test_a_whole_game_merges_into_one_sample_that_trains_exactly_the_moves(tokenizer):
    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(messages) -> list[int]:
        return encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))

    game = tictactoe.Game(dice=(0.0, 0.0, 0.0, 0.0))
    (_, score), calls, replies = play(game, script("5", "9", "3", "7"))
    assert score == 1.0 and len(calls) == 4
    # As the local engine records them: the rendered prompt, the move and <|im_end|> sampled.
    recorded = []
    for i, (messages, reply) in enumerate(zip(calls, replies, strict=False)):
        completion = encode(reply + tokenizer.eos_token)
        recorded.append(
            {
                "status": "ok",
                "prompt_ids": prompt_ids(messages),
                "completion_ids": [completion],
                "behaviour_logprobs": [[-0.5 - i] * len(completion)],
            }
        )
    samples = trajectory_samples(recorded, trajectory_id="s", group_id="g", advantage=1.5)
    assert len(samples) == 1, "every move's prompt extends the game so far: one sample"
    sample = samples[0]

    # By hand: the whole game is the first prompt, then per move [move, <|im_end|>] and the
    # text the template puts between it and the next generation prompt (masked).
    full = tokenizer.apply_chat_template([*calls[-1], {"role": "assistant", "content": replies[-1]}], tokenize=False)
    assert full.endswith(tokenizer.eos_token + "\n")
    assert sample.token_ids == tuple(encode(full[:-1]))  # the last move's <|im_end|> is its last token
    expected_mask: list[bool] = []
    expected_old: list[float] = []
    for i, (messages, reply) in enumerate(zip(calls, replies, strict=False)):
        new_prompt = len(prompt_ids(messages)) - len(expected_mask)
        move = encode(reply + tokenizer.eos_token)
        assert move == [tokenizer.convert_tokens_to_ids(reply), tokenizer.eos_token_id]  # one digit, one end
        expected_mask += [False] * new_prompt + [True] * len(move)
        expected_old += [math.nan] * new_prompt + [-0.5 - i] * len(move)
    assert list(sample.loss_mask) == expected_mask
    trained = [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=False) if m]
    assert tokenizer.decode(trained) == "5<|im_end|>9<|im_end|>3<|im_end|>7<|im_end|>"
    assert sum(sample.loss_mask) == 8  # the four moves and their end-of-turn tokens, nothing else
    assert all(
        math.isnan(a) == math.isnan(b) and (math.isnan(a) or a == b)
        for a, b in zip(sample.old_logprobs, expected_old, strict=True)
    )
    assert sample.advantage == 1.5


def test_the_teacher_prefers_the_centre_then_the_corners():
    assert tictactoe.teacher_reply([{"role": "user", "content": "1 2 3\n4 5 6\n7 8 9"}]) == "5"
    assert tictactoe.teacher_reply([{"role": "user", "content": "O 2 3\n4 X 6\n7 8 9"}]) == "3"
    assert tictactoe.board_of("O 2 3\n4 X 6\n7 8 9") == ["O", " ", " ", " ", "X", " ", " ", " ", " "]


def test_a_warm_start_records_the_teacher_distils_it_then_grpo_goes_on(tmp_path):
    from gateway.store.sqlite import SQLiteStore
    from tests.test_demo import run_demo

    out = tmp_path / "warm"
    result = run_demo(
        out,
        "--task",
        "tictactoe",
        "--warm-start",
        "sft",
        "--teacher-games",
        "64",
        "--warm-start-epochs",
        "1",
        "--steps",
        "1",
        "--eval-groups",
        "1",
        "--seconds",
        "60",
        timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    warm = summary["warm_start"]
    assert warm["teacher_games"] == 64 and warm["teacher_score"] > 0.7  # the fixed preference plays well
    assert "after the warm start (sft) reward" in result.stdout
    store = SQLiteStore(out / "state" / "rlproxy.db")
    steps = store.steps("agent")
    objectives = [s["metrics"].get("objective", "grpo") for s in steps[1:]]
    # the train games that did not lose (one in eight is val), 8 a step, one epoch; then GRPO
    distilled = store.select_session_ids(SessionFilter(model="teacher", split="train", min_reward=0.5))
    n = math.ceil(len(distilled) / 8)
    assert 40 <= len(distilled) <= 56 and objectives[:n] == ["sft"] * n and set(objectives[n:]) == {"grpo"}
    assert all(s["metrics"]["val_loss"] is not None for s in steps[1 : n + 1])
    assert len(store.select_session_ids(SessionFilter(model="teacher"))) == 64
    assert summary["settings"]["learning_rate"] == 3e-3
    assert summary["final_step"] > n and summary["baseline_reward"] is not None


def test_a_warm_start_needs_a_task_with_a_teacher(tmp_path):
    from tests.test_demo import run_demo

    result = run_demo(tmp_path / "shout", "--task", "shout", "--warm-start", "sft", "--steps", "1", timeout=120)
    assert result.returncode == 2 and "has none (tictactoe has)" in result.stderr
