"""The rules of 2048, as pure functions over an immutable board (no I/O, no model).

A board is a tuple of 16 ints, row-major, 0 for an empty cell. The rules are the original
game's (gabrielecirulli/2048):

- a move slides every tile as far as it goes towards one side; two equal tiles that meet
  merge into one of twice the value, merging from the side moved towards
  ([2, 2, 2, 0] left gives [4, 2, 0, 0]), and a tile made by a merge does not merge again
  in the same move ([2, 2, 4, 0] left gives [4, 4, 0, 0], not [8, 0, 0, 0]);
- the score grows by the value of every tile a merge makes;
- after a move that changed the board a new tile appears on an empty cell chosen
  uniformly: a 2 nine times in ten, else a 4; a move that changes nothing is no move;
- the game starts with two such tiles and is over when no move changes the board.

Randomness comes only from the `random.Random` passed in, so a seed replays a game.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SIZE = 4
DIRECTIONS = ("up", "down", "left", "right")
Board = tuple[int, ...]  # SIZE * SIZE cells, row-major; 0 is empty

# For each direction, the cells of each line listed from the side the tiles move towards,
# so that every direction is "slide the line to its start".
_LINES: dict[str, tuple[tuple[int, ...], ...]] = {
    "left": tuple(tuple(r * SIZE + c for c in range(SIZE)) for r in range(SIZE)),
    "right": tuple(tuple(r * SIZE + c for c in reversed(range(SIZE))) for r in range(SIZE)),
    "up": tuple(tuple(r * SIZE + c for r in range(SIZE)) for c in range(SIZE)),
    "down": tuple(tuple(r * SIZE + c for r in reversed(range(SIZE))) for c in range(SIZE)),
}


@dataclass(frozen=True)
class Moved:
    """What one move did."""

    board: Board  # the board after sliding and merging, before a new tile appears
    gained: int  # score gained: the sum of the tiles its merges made
    merged: tuple[int, ...]  # the value of every tile its merges made
    changed: bool  # False: the move changes nothing (a no-op, not a legal move)


def empty_board() -> Board:
    return (0,) * (SIZE * SIZE)


def slide_line(line: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Slide one line towards its start: (the new line, the tiles its merges made)."""
    tiles = [v for v in line if v]
    out: list[int] = []
    merged: list[int] = []
    i = 0
    while i < len(tiles):
        if i + 1 < len(tiles) and tiles[i] == tiles[i + 1]:
            out.append(tiles[i] * 2)  # the merged tile is placed and skipped: it merges once
            merged.append(tiles[i] * 2)
            i += 2
        else:
            out.append(tiles[i])
            i += 1
    return tuple(out + [0] * (len(line) - len(out))), tuple(merged)


def move(board: Board, direction: str) -> Moved:
    """Slide the whole board; no new tile yet (see `step`)."""
    if direction not in _LINES:
        raise ValueError(f"direction '{direction}' is not one of {', '.join(DIRECTIONS)}")
    _check(board)
    cells = list(board)
    merged: list[int] = []
    for indices in _LINES[direction]:
        line, made = slide_line(tuple(board[i] for i in indices))
        merged.extend(made)
        for i, value in zip(indices, line, strict=False):
            cells[i] = value
    new = tuple(cells)
    return Moved(board=new, gained=sum(merged), merged=tuple(merged), changed=new != board)


def spawn(board: Board, rng: random.Random) -> Board:
    """Put a new tile on a uniformly chosen empty cell: 2 with probability 0.9, else 4.

    The value is drawn before the cell, as in the original game; a full board is returned
    unchanged (no draw is made).
    """
    empty = [i for i, v in enumerate(board) if v == 0]
    if not empty:
        return board
    value = 2 if rng.random() < 0.9 else 4
    cell = empty[rng.randrange(len(empty))]
    return board[:cell] + (value,) + board[cell + 1 :]


def new_game(rng: random.Random) -> Board:
    """An empty board with two random tiles, as the original game starts."""
    return spawn(spawn(empty_board(), rng), rng)


def step(board: Board, direction: str, rng: random.Random) -> Moved:
    """One turn: the move, then a new tile if the move changed the board."""
    moved = move(board, direction)
    if not moved.changed:
        return moved
    return Moved(board=spawn(moved.board, rng), gained=moved.gained, merged=moved.merged, changed=True)


def legal_moves(board: Board) -> tuple[str, ...]:
    """The directions that change the board."""
    return tuple(d for d in DIRECTIONS if move(board, d).changed)


def game_over(board: Board) -> bool:
    return not legal_moves(board)


def render(board: Board) -> str:
    """The board as text, one row a line, '.' for an empty cell, columns right-aligned."""
    _check(board)
    width = max(len(str(v)) for v in board)
    return "\n".join(
        " ".join((str(v) if v else ".").rjust(width) for v in board[r * SIZE : (r + 1) * SIZE]) for r in range(SIZE)
    )


def parse_board(text: str) -> Board:
    """The inverse of `render`: a board from its text (for scripted players and tests)."""
    cells = [0 if token == "." else int(token) for token in text.split()]
    _check(tuple(cells))
    return tuple(cells)


def _check(board: Board) -> None:
    if len(board) != SIZE * SIZE:
        raise ValueError(f"a board has {SIZE * SIZE} cells, got {len(board)}")
