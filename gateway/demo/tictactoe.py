"""Demo task TIC-TAC-TOE (`rlproxy demo --task tictactoe`): a multi-turn game.

The agent plays X, and moves first, against a random opponent. Every move is one chat
completion in the same session, as an existing agent would make it: the conversation grows
(the board as the user turn, the agent's move as the assistant turn), so the trainer merges
a whole game into one sample in which only the move tokens are trained.

- board: three rows of squares, a free square shown as its number, a taken one as X or O:
  "1 2 3\\n4 X 6\\nO 8 9". Digits are single tokens of the built-in tokenizer, so the free
  squares are tokens the model can copy;
- move: the reply's first non-blank character, a digit 1-9; anything else (no digit, a
  taken square) loses the game at once;
- score: 1 win, 0.5 draw, 0 loss (what the demo reports, and the `val` reward);
- the model: the built-in instruct model (`rlproxy/tiny-qwen2-instruct`), which answers
  with an item of the user's last message: here a square's number, or X or O. The random
  built-in model never learnt to read the board through LoRA (docs/demo.md), so it cannot play;
- training reward (shaped): the score, except that a game lost by an illegal move earns
  0.02 per legal move before it and a game lost on the board 0.1. The untrained model
  loses nearly every game (it names X, O or a taken square within a few moves), so with
  the bare score most groups are all zeros and teach nothing; the shaped reward keeps the
  order win > draw > loss > illegal and gives longer legal play a signal;
- the opponent picks uniformly among the free squares, but with dice drawn once per group
  (`sample`): the rollouts of a group face the same luck, so the spread of their rewards
  is the agent's doing (less noise in the group-relative advantage).

A player that only knows the rules (uniform over free squares) scores about 0.65 against
this opponent; a fixed preference order over the squares (centre, then corners...) scores
up to about 0.88, so above 0.8 the agent has learnt to play, not only to answer legally.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from gateway.settings import TINY_INSTRUCT_MODEL_ID

NAME = "tictactoe"
DESCRIPTION = (
    "play X against a random opponent, one chat completion per move; "
    "reward 1 win, 0.5 draw, 0 loss (an illegal or unparseable move loses)"
)

# 16 rollouts a group, the built-in models' tuned learning rate (1e-2). Measured in process
# (no gateway, seed 0, val score on 64 games after 20 steps): 1e-2 0.88, 3e-3 0.70 (still
# rising), 3e-2 (what the random model needed) 0.02: too large for a model that already
# reads the board, it unlearns that.
# 480 s of rounds, so that with the final evaluation (128 games) a run ends within 10
# minutes (docs/demo.md: 0.83-0.93 in 9 runs of seeds 0-2, 62-86 steps, 486-489 s).
# A group is perfect when the dice let a near-deterministic policy win all 16 games, which it
# often does long before it plays every board well: 8 perfect groups in a row stopped seed 0
# at step 39 with a val score of 0.84; it takes 32 (eight steps' worth) to stop here.
OPTIONS = {"rollouts": 16, "max_tokens": 2, "steps": 200, "seconds": 480.0, "eval_groups": 8, "converge_after": 32}
SETTINGS = {"base_model": TINY_INSTRUCT_MODEL_ID, "default_max_tokens": 2, "max_tokens_per_row": 2048}

SYSTEM = "You play tic-tac-toe as X. Reply with the number of a free square."
LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
WIN, DRAW, LOSS = 1.0, 0.5, 0.0
PLAYED_LOSS_REWARD = 0.1
LEGAL_MOVE_REWARD = 0.02


@dataclass(frozen=True)
class Game:
    """One group's game: the opponent's dice (uniforms in [0, 1), one per opponent move)."""

    dice: tuple[float, ...]


def sample(rng: random.Random) -> Game:
    return Game(tuple(rng.random() for _ in range(4)))  # O moves at most 4 times


def render(board: list[str]) -> str:
    cells = [c if c != " " else str(i + 1) for i, c in enumerate(board)]
    return "\n".join(" ".join(cells[r * 3 : r * 3 + 3]) for r in range(3))


def parse_move(reply: str | None, board: list[str]) -> int | None:
    """The square (0-8) a reply plays, or None if it is not a free square's number."""
    text = (reply or "").strip()
    if not text or text[0] not in "123456789":
        return None
    square = int(text[0]) - 1
    return square if board[square] == " " else None


def winner(board: list[str]) -> str | None:
    for a, b, c in LINES:
        if board[a] != " " and board[a] == board[b] == board[c]:
            return board[a]
    return None


def opponent_move(board: list[str], die: float) -> int:
    free = [i for i, c in enumerate(board) if c == " "]
    return free[int(die * len(free))]


async def episode(game: Game, chat) -> tuple[float, float]:
    """One game; each of X's moves is one call in one growing conversation.
    Returns (shaped training reward, score)."""
    score, legal = await play(game, chat)
    if score == LOSS:
        return (PLAYED_LOSS_REWARD if legal == 5 else LEGAL_MOVE_REWARD * legal), score
    return score, score


async def play(game: Game, chat) -> tuple[float, int]:
    """(score, legal moves X made; 5 when X lost on the board rather than by a bad move)."""
    board = [" "] * 9
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(5):
        messages.append({"role": "user", "content": render(board)})
        reply = await chat(messages)
        square = parse_move(reply, board)
        if square is None:
            return LOSS, turn
        messages.append({"role": "assistant", "content": reply})
        board[square] = "X"
        if winner(board) == "X":
            return WIN, 5
        if " " not in board:
            return DRAW, 5
        board[opponent_move(board, game.dice[turn])] = "O"
        if winner(board) == "O":
            return LOSS, 5
    return DRAW, 5  # unreachable: X's fifth move fills the board


PREFERENCE = (4, 0, 2, 6, 8, 1, 3, 5, 7)
"""A teacher's fixed order over the squares: centre, corners, edges (about 0.88 against the
random opponent): `--warm-start sft` distils it before GRPO."""


def board_of(text: str) -> list[str]:
    """The board a user turn shows (`render`'s inverse)."""
    cells = text.split()
    return [" " if c.isdigit() else c for c in cells] if len(cells) == 9 else [" "] * 9


def teacher_reply(messages: list[dict]) -> str:
    """The teacher's move for the last board shown: the first free square in `PREFERENCE`."""
    board = board_of(str(messages[-1].get("content") or ""))
    return str(next(i for i in PREFERENCE if board[i] == " ") + 1)
