"""A tic-tac-toe agent, written the way an agent is written for any OpenAI-compatible
server, trained by pointing it at rlproxy.

    python examples/tictactoe/agent.py --base-url http://localhost:8000/v1 --groups 100

The agent plays X against a random opponent. Each move is one chat completion in one
growing conversation (board as the user turn, move as the assistant turn); an illegal or
unparseable move loses. The only rlproxy-specific parts are the session/group headers
(through `sdk`, which mints them and closes groups) and the reward the rollout returns.
"""

from __future__ import annotations

import argparse
import random

from sdk import RLProxy

SYSTEM = "You play tic-tac-toe as X. Reply with the number of a free square."
LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))


def render(board: list[str]) -> str:
    cells = [c if c != " " else str(i + 1) for i, c in enumerate(board)]
    return "\n".join(" ".join(cells[r * 3 : r * 3 + 3]) for r in range(3))


def winner(board: list[str]) -> str | None:
    for a, b, c in LINES:
        if board[a] != " " and board[a] == board[b] == board[c]:
            return board[a]
    return None


def play(client, model: str, opponent: random.Random, max_tokens: int) -> float:
    """One game: 1 win, 0.5 draw, 0 loss."""
    board = [" "] * 9
    messages = [{"role": "system", "content": SYSTEM}]
    while True:
        messages.append({"role": "user", "content": render(board)})
        reply = (
            client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=1.0)
            .choices[0]
            .message.content
            or ""
        )
        text = reply.strip()
        if not text or text[0] not in "123456789" or board[int(text[0]) - 1] != " ":
            return 0.0  # unparseable or illegal: a loss
        messages.append({"role": "assistant", "content": reply})
        board[int(text[0]) - 1] = "X"
        if winner(board) == "X":
            return 1.0
        if " " not in board:
            return 0.5
        board[opponent.choice([i for i, c in enumerate(board) if c == " "])] = "O"
        if winner(board) == "O":
            return 0.0


def main(argv: list[str] | None = None) -> list[list[float]]:
    """Play the groups; returns each group's rewards (for tests and scripts)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://localhost:8000/v1", help="rlproxy's /v1 URL")
    parser.add_argument("--api-key", default=None, help="rlproxy's --api-key, if it has one")
    parser.add_argument("--model", default="agent", help="served name: agent, agent@N, or the base model's id")
    parser.add_argument("--groups", type=int, default=50, help="groups to play (each trains once it closes)")
    parser.add_argument("--rollouts", type=int, default=8, help="games per group (GRPO compares them)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per move")
    parser.add_argument("--split", choices=["train", "val"], default="train", help="val: scored, never trained on")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    proxy = RLProxy(base_url=args.base_url, api_key=args.api_key)
    # Train and val games come from different dice: with one seed for both, val group N met
    # the opponent of train group N, so "val" scored games the model was trained on.
    rng = random.Random(f"{args.split}-{args.seed}")
    by_group: list[list[float]] = []
    try:
        for g in range(args.groups):
            dice = rng.getrandbits(32)  # one opponent per group: its rollouts face the same luck

            def rollout(session, dice: int = dice) -> float:
                return play(session.openai_client(), args.model, random.Random(dice), args.max_tokens)

            with proxy.group(split=args.split) as group:
                result = group.run(rollout, n=args.rollouts, concurrency=args.rollouts, max_exceptions=1)
            rewards = [r for r in result.rewards if r is not None]
            by_group.append(rewards)
            print(f"group {g}: mean reward {sum(rewards) / max(len(rewards), 1):.2f}", flush=True)
    finally:
        proxy.close()
    return by_group


if __name__ == "__main__":
    main()
