"""Mean reward of scripted players, to read a trained model's reward against.

    python examples/game2048/baselines.py [--games 500]

The players see only what the model sees (the board as text) and play through the same
`play` and `reward` as the agent, with the same dice for every player.
"""

from __future__ import annotations

import argparse
import random
import statistics

if __package__:
    from .agent import play, reward
    from .game import DIRECTIONS, legal_moves, move, parse_board
else:
    from agent import play, reward
    from game import DIRECTIONS, legal_moves, move, parse_board


def any_direction(board, rng: random.Random) -> str:
    """Knows the answer format, not the rules: no-op moves end its games early."""
    return rng.choice(DIRECTIONS)


def random_legal(board, rng: random.Random) -> str:
    """Knows the rules, no strategy."""
    return rng.choice(legal_moves(board))


def greedy(board, rng: random.Random) -> str:
    """One move of look-ahead: the largest merge, then the most empty cells, then left/down."""

    def value(direction: str) -> tuple:
        moved = move(board, direction)
        return moved.gained, moved.board.count(0), direction in ("left", "down")

    return max(legal_moves(board), key=value)


def mean_reward(player, games: int, max_moves: int, target_tile: int) -> tuple[float, float]:
    """(mean reward, mean moves played) over `games` seeded games."""
    rewards, moves = [], []
    for seed in range(games):
        rng = random.Random(10_000 + seed)
        episode = play(lambda messages, rng=rng: player(parse_board(messages[-1]["content"]), rng), seed, max_moves)
        rewards.append(reward(episode.moves, episode.largest_tile, max_moves, target_tile))
        moves.append(episode.moves)
    return statistics.mean(rewards), statistics.mean(moves)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--games", type=int, default=500)
    args = parser.parse_args()
    print("| player | --max-moves | --target-tile | mean reward | mean moves |")
    print("| --- | --- | --- | --- | --- |")
    for max_moves, target in ((40, 64), (150, 256)):
        for player in (any_direction, random_legal, greedy):
            mean, moves = mean_reward(player, args.games, max_moves, target)
            print(f"| {player.__name__} | {max_moves} | {target} | {mean:.3f} | {moves:.1f} |", flush=True)


if __name__ == "__main__":
    main()
