"""A 2048 agent, written the way an agent is written for any OpenAI-compatible server,
trained by pointing it at rlproxy.

    python examples/game2048/agent.py --base-url http://localhost:8000/v1 --groups 100

Each move is one chat completion in one growing conversation (the board as the user turn,
the move as the assistant turn), up to `--max-moves`. A reply that names no direction, or
a move that changes nothing, is an invalid move and ends the game. The reward (`reward`)
is half the share of the move budget played, half the largest tile built on a log scale.
The only rlproxy-specific parts are the session/group headers (through `sdk`, which mints
them and closes groups) and the reward posted at the end.
"""

from __future__ import annotations

import argparse
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from sdk import RLProxy

if __package__:  # imported: examples.game2048.agent
    from .game import Board, game_over, new_game, render, step
else:  # run as a script: python examples/game2048/agent.py
    from game import Board, game_over, new_game, render, step

SYSTEM = (
    "You play 2048 on a 4x4 board ('.' is an empty cell). A move slides every tile to one side; "
    "two equal tiles that meet merge into their sum. Build the largest tile you can. "
    "Reply with one word: up, down, left or right."
)
MAX_MOVES = 40
TARGET_TILE = 64  # about the largest tile 40 moves can build (the board then holds ~90 in all)

_DIRECTION_WORD = re.compile(r"\b(up|down|left|right)\b", re.IGNORECASE)


def parse_move(reply: str | None) -> str | None:
    """The direction a reply names, or None (an invalid move).

    Case and surrounding words are tolerated ("Left.", "I move UP"); a reply that names
    no direction, or two different ones ("not up but left"), names none.
    """
    named = {word.lower() for word in _DIRECTION_WORD.findall(reply or "")}
    return named.pop() if len(named) == 1 else None


@dataclass(frozen=True)
class Episode:
    """One game as the agent played it."""

    moves: int  # moves that changed the board (the invalid one that ended a game is not counted)
    largest_tile: int  # the largest tile a merge made; 0 if nothing merged
    score: int  # the game's own score: the sum of every tile a merge made
    board: Board  # the board at the end
    ended: str  # "invalid" (unparseable or no-op reply), "game_over", or "max_moves"
    replies: tuple[str, ...]  # every reply, the invalid one included


def reward(moves: int, largest_tile: int, max_moves: int = MAX_MOVES, target_tile: int = TARGET_TILE) -> float:
    """0.5 x the share of the move budget played + 0.5 x tile progress, in [0, 1].

    Tile progress is (log2(tile) - 1) / (log2(target) - 1), capped at 1, for the largest
    tile a merge made (0 when nothing merged): 4 -> 0.2, 8 -> 0.4, ..., 64 -> 1 for the
    default target 64. Every valid move earns something, so a model that first has to learn
    to answer with a move that changes the board sees its reward rise move by move; an
    invalid move costs the rest of the budget; merging into larger tiles earns the other half.
    """
    if max_moves < 1 or target_tile < 4:
        raise ValueError("max_moves must be at least 1 and target_tile at least 4")
    played = min(moves, max_moves) / max_moves
    tile = 0.0 if largest_tile < 4 else min(1.0, (math.log2(largest_tile) - 1) / (math.log2(target_tile) - 1))
    return 0.5 * played + 0.5 * tile


def play(ask: Callable[[list[dict]], str], seed: int, max_moves: int = MAX_MOVES) -> Episode:
    """One game: `ask(messages)` is the model (one chat completion), `seed` the tiles' dice."""
    rng = random.Random(seed)
    board = new_game(rng)
    messages = [{"role": "system", "content": SYSTEM}]
    moves = largest = score = 0
    replies: list[str] = []
    ended = "max_moves"
    while moves < max_moves:
        messages.append({"role": "user", "content": render(board)})
        reply = ask(messages)
        replies.append(reply)
        direction = parse_move(reply)
        moved = step(board, direction, rng) if direction else None
        if moved is None or not moved.changed:
            ended = "invalid"
            break
        messages.append({"role": "assistant", "content": reply})
        board, moves, score = moved.board, moves + 1, score + moved.gained
        largest = max(largest, *moved.merged, 0)
        if game_over(board):
            ended = "game_over"
            break
    return Episode(moves=moves, largest_tile=largest, score=score, board=board, ended=ended, replies=tuple(replies))


def openai_ask(client, model: str, max_tokens: int) -> Callable[[list[dict]], str]:
    """`ask` over an OpenAI client: one chat completion, the reply's text."""

    def ask(messages: list[dict]) -> str:
        return (
            client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=1.0)
            .choices[0]
            .message.content
            or ""
        )

    return ask


def main(argv: list[str] | None = None) -> list[list[float]]:
    """Play the groups; returns each group's rewards (for tests and scripts)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://localhost:8000/v1", help="rlproxy's /v1 URL")
    parser.add_argument("--api-key", default=None, help="rlproxy's --api-key, if it has one")
    parser.add_argument("--model", default="agent", help="served name: agent, agent@N, or the base model's id")
    parser.add_argument("--groups", type=int, default=50, help="groups to play (each trains once it closes)")
    parser.add_argument("--rollouts", type=int, default=8, help="games per group (GRPO compares them)")
    parser.add_argument("--max-moves", type=int, default=MAX_MOVES, help="moves per game (calls per session)")
    parser.add_argument("--target-tile", type=int, default=TARGET_TILE, help="the tile that earns full tile reward")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per move")
    parser.add_argument("--split", choices=["train", "val"], default="train", help="val: scored, never trained on")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.max_moves < 1 or args.target_tile < 4 or args.target_tile & (args.target_tile - 1):
        parser.error("--max-moves must be at least 1 and --target-tile a power of two, at least 4")

    proxy = RLProxy(base_url=args.base_url, api_key=args.api_key)
    # Train and val games come from different dice, so val scores games never trained on.
    rng = random.Random(f"{args.split}-{args.seed}")
    by_group: list[list[float]] = []
    try:
        for g in range(args.groups):
            dice = rng.getrandbits(32)  # one game per group: its rollouts start from the same board and dice
            rewards: list[float] = []

            def rollout(session, dice: int = dice, rewards: list[float] = rewards) -> None:
                episode = play(openai_ask(session.openai_client(), args.model, args.max_tokens), dice, args.max_moves)
                value = reward(episode.moves, episode.largest_tile, args.max_moves, args.target_tile)
                session.reward(
                    value,
                    metrics={
                        "moves": float(episode.moves),
                        "score": float(episode.score),
                        "largest_tile": float(episode.largest_tile),
                        "invalid": float(episode.ended == "invalid"),
                    },
                )
                rewards.append(value)

            with proxy.group(split=args.split) as group:
                group.run(rollout, n=args.rollouts, concurrency=args.rollouts, max_exceptions=1)
            by_group.append(rewards)
            print(f"group {g}: mean reward {sum(rewards) / max(len(rewards), 1):.3f}", flush=True)
    finally:
        proxy.close()
    return by_group


if __name__ == "__main__":
    main()
