"""The 2048 example (examples/game2048/): its rules on hand-computed boards, the reply
parser, the reward on hand-made histories, and the agent end to end through a real gateway
(openai engine) in front of a scripted upstream that answers a fixed cycle of moves.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from examples.game2048 import agent, game
from tests.helpers import ThreadServer
from tests.helpers_upstream import openai_gateway

ROOT = Path(__file__).resolve().parents[1]


def board(*rows: list[int]) -> tuple[int, ...]:
    assert len(rows) == 4 and all(len(r) == 4 for r in rows)
    return tuple(v for r in rows for v in r)


def row(line: list[int]) -> tuple[int, ...]:
    """A board whose first row is `line`, the rest empty."""
    return board(line, [0] * 4, [0] * 4, [0] * 4)


# ---------------------------------------------------------------- rules, by hand


@pytest.mark.parametrize(
    "line, direction, expected, gained",
    [
        ([2, 2, 2, 2], "left", [4, 4, 0, 0], 8),
        ([2, 2, 4, 0], "left", [4, 4, 0, 0], 4),  # the new 4 does not merge again with the 4
        ([2, 2, 2, 0], "left", [4, 2, 0, 0], 4),  # merging from the side moved towards
        ([2, 2, 2, 0], "right", [0, 0, 2, 4], 4),
        ([4, 0, 4, 8], "right", [0, 0, 8, 8], 8),
        ([4, 0, 4, 8], "left", [8, 8, 0, 0], 8),
        ([0, 0, 0, 2], "left", [2, 0, 0, 0], 0),
        ([2, 2, 4, 4], "left", [4, 8, 0, 0], 12),
        ([8, 4, 2, 2], "right", [0, 8, 4, 4], 4),
    ],
)
def test_a_row_slides_and_merges_as_in_the_original_game(line, direction, expected, gained):
    moved = game.move(row(line), direction)
    assert moved.board == row(expected)
    assert moved.gained == gained and moved.changed


def test_up_and_down_move_columns():
    start = board([2, 0, 0, 8], [2, 4, 0, 0], [4, 0, 0, 8], [4, 4, 2, 0])
    assert game.move(start, "up").board == board([4, 8, 2, 16], [8, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0])
    assert game.move(start, "down").board == board([0, 0, 0, 0], [0, 0, 0, 0], [4, 0, 0, 0], [8, 8, 2, 16])
    assert game.move(start, "up").merged == (4, 8, 8, 16)


def test_a_move_that_changes_nothing_is_no_move_and_spawns_nothing():
    start = board([2, 4, 8, 16], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0])
    assert not game.move(start, "left").changed and not game.move(start, "right").changed
    assert not game.move(start, "up").changed
    assert game.move(start, "down").changed
    assert game.legal_moves(start) == ("down",)
    rng = random.Random(3)
    state = rng.getstate()
    moved = game.step(start, "left", rng)
    assert moved.board == start and not moved.changed and rng.getstate() == state  # no dice thrown


def test_game_over_only_when_no_move_changes_the_board():
    stuck = board([2, 4, 2, 4], [4, 2, 4, 2], [2, 4, 2, 4], [4, 2, 4, 2])
    assert game.game_over(stuck) and game.legal_moves(stuck) == ()
    pair = board(
        [2, 4, 2, 4], [4, 2, 4, 2], [2, 4, 2, 4], [8, 8, 4, 2]
    )  # full, but the two 8s merge (and nothing merges up or down)
    assert not game.game_over(pair) and set(game.legal_moves(pair)) == {"left", "right"}
    hole = stuck[:15] + (0,)
    assert not game.game_over(hole) and set(game.legal_moves(hole)) == {"down", "right"}


def test_spawn_is_seeded_lands_on_an_empty_cell_and_is_a_4_one_time_in_ten():
    assert game.new_game(random.Random(11)) == game.new_game(random.Random(11))
    start = game.new_game(random.Random(11))
    assert sum(v != 0 for v in start) == 2 and set(start) <= {0, 2, 4}
    one_hole = (2,) * 7 + (0,) + (2,) * 8
    for seed in range(20):
        new = game.spawn(one_hole, random.Random(seed))
        assert new[:7] == one_hole[:7] and new[8:] == one_hole[8:] and new[7] in (2, 4)
    full = (2,) * 16
    assert game.spawn(full, random.Random(0)) == full
    rng = random.Random(5)
    values = [max(game.spawn(game.empty_board(), rng)) for _ in range(20_000)]
    assert 0.08 < values.count(4) / len(values) < 0.12  # deterministic for this seed


def test_every_cell_can_receive_the_new_tile():
    rng = random.Random(9)
    hit = {next(i for i, v in enumerate(game.spawn(game.empty_board(), rng)) if v) for _ in range(2_000)}
    assert hit == set(range(16))


def test_a_seeded_game_replays_identically():
    def run(seed):
        rng, boards = random.Random(seed), []
        b = game.new_game(rng)
        for direction in ["left", "up", "right", "down"] * 5:
            b = game.step(b, direction, rng).board
            boards.append(b)
        return boards

    assert run(4) == run(4) and run(4) != run(5)


def test_render_by_hand_and_back():
    b = board([0, 2, 0, 0], [0, 0, 16, 0], [128, 0, 0, 4], [0, 0, 0, 2])
    assert game.render(b) == ("  .   2   .   .\n  .   .  16   .\n128   .   .   4\n  .   .   .   2")
    assert game.parse_board(game.render(b)) == b
    assert game.render(board([2, 0, 0, 0], [0] * 4, [0] * 4, [0] * 4)).splitlines()[0] == "2 . . ."


def test_bad_input_is_refused_with_what_to_fix():
    with pytest.raises(ValueError, match="not one of up, down, left, right"):
        game.move(game.empty_board(), "north")
    with pytest.raises(ValueError, match="16 cells"):
        game.move((2, 2), "left")


# ---------------------------------------------------------------- the reply parser


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("left", "left"),
        ("LEFT", "left"),
        ("Up.", "up"),
        ("  right\n", "right"),
        ("I move DOWN now", "down"),
        ("down, down", "down"),
        ("**Left**", "left"),
        ("Move: up!", "up"),
        ("up or left", None),
        ("not up but left", None),
        ("", None),
        (None, None),
        ("3", None),
        ("leftward", None),
        ("upper", None),
        ("north", None),
    ],
)
def test_the_parser_finds_one_direction(reply, expected):
    assert agent.parse_move(reply) == expected


# ---------------------------------------------------------------- the reward


@pytest.mark.parametrize(
    "moves, largest, max_moves, target, expected",
    [
        (0, 0, 40, 64, 0.0),  # first reply invalid: nothing played, nothing built
        (40, 64, 40, 64, 1.0),  # the whole budget and the target tile
        (20, 8, 40, 64, 0.25 + 0.5 * 0.4),  # half the budget; 8 is 2 of the 5 doublings from 2 to 64
        (10, 0, 40, 64, 0.125),  # moves without a merge
        (40, 128, 40, 64, 1.0),  # past the target is capped
        (40, 32, 40, 64, 0.5 + 0.5 * 0.8),
        (75, 16, 150, 256, 0.25 + 0.5 * 3 / 7),
    ],
)
def test_reward_by_hand(moves, largest, max_moves, target, expected):
    assert agent.reward(moves, largest, max_moves, target) == pytest.approx(expected)


def test_reward_refuses_a_budget_or_target_that_makes_no_sense():
    with pytest.raises(ValueError, match="max_moves"):
        agent.reward(1, 4, max_moves=0)
    with pytest.raises(ValueError, match="target_tile"):
        agent.reward(1, 4, target_tile=2)


def _scripted(replies_by_turn):
    """A model that answers `replies_by_turn(board, turn)`, recording every conversation it saw."""
    seen = []

    def ask(messages):
        seen.append([dict(m) for m in messages])
        return replies_by_turn(game.parse_board(messages[-1]["content"]), len(seen) - 1)

    return ask, seen


def test_a_hand_made_history_that_ends_on_a_no_op_move():
    # Two legal moves, then a move that changes nothing (or, if none exists, a reply naming none).
    merged = []

    def player(b, turn):
        if turn < 2:
            direction = game.legal_moves(b)[0]
            merged.extend(game.move(b, direction).merged)
            return f"I move {direction.upper()}."
        no_ops = [d for d in game.DIRECTIONS if d not in game.legal_moves(b)]
        return no_ops[0] if no_ops else "I pass"

    ask, seen = _scripted(player)
    episode = agent.play(ask, seed=2, max_moves=40)
    assert episode.ended == "invalid" and episode.moves == 2 and len(seen) == 3
    assert episode.largest_tile == max(merged, default=0)
    tile = 0.0 if not merged else (max(merged).bit_length() - 2) / 5  # log2(tile) - 1 over log2(64) - 1
    assert agent.reward(episode.moves, episode.largest_tile) == pytest.approx(0.5 * 2 / 40 + 0.5 * tile)
    # the conversation grows: system, then board/move pairs; the invalid reply is the last call's answer
    assert [m["role"] for m in seen[2]] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert seen[2][: len(seen[1])] == seen[1] and seen[1][: len(seen[0])] == seen[0]
    assert seen[2][2]["content"] == episode.replies[0] and seen[2][4]["content"] == episode.replies[1]


def test_an_unparseable_first_reply_scores_zero():
    ask, seen = _scripted(lambda b, turn: "I am not sure")
    episode = agent.play(ask, seed=0)
    assert (episode.moves, episode.largest_tile, episode.ended, len(seen)) == (0, 0, "invalid", 1)
    assert agent.reward(episode.moves, episode.largest_tile) == 0.0


def test_a_game_played_to_the_end_and_one_cut_at_the_budget():
    rng = random.Random(1)
    ask, seen = _scripted(lambda b, turn: rng.choice(game.legal_moves(b)))
    episode = agent.play(ask, seed=6, max_moves=10_000)
    assert episode.ended == "game_over" and game.game_over(episode.board)
    assert episode.moves == len(seen) and 4 <= episode.largest_tile <= max(episode.board)
    assert max(episode.board) <= 4 or episode.largest_tile == max(episode.board)  # tiles past 4 come from merges
    ask, seen = _scripted(lambda b, turn: game.legal_moves(b)[-1])
    episode = agent.play(ask, seed=6, max_moves=5)
    assert episode.ended == "max_moves" and episode.moves == 5 and len(seen) == 5


# ---------------------------------------------------------------- end to end through the gateway


# What the scripted upstream answers, by the model name the agent asks for: "cycle" plays
# four directions in turn (games run to the budget), "gives-up" answers no direction at its
# third move (an unparseable reply ends the game).
SCRIPTS = {"cycle": ("left", "Down.", "I move RIGHT", "up"), "gives-up": ("left", "Down.", "no idea")}


class ScriptedUpstream:
    """An OpenAI-chat-compatible server whose n-th answer in a conversation is script[n % len]
    (n = the assistant turns already in the request), so every rollout is reproducible."""

    def __init__(self):
        self.requests: list[dict] = []
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
            ]
        )

    async def chat(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.requests.append(body)
        script = SCRIPTS[body["model"]]
        text = script[sum(m.get("role") == "assistant" for m in body["messages"]) % len(script)]
        return JSONResponse(
            {
                "id": f"chatcmpl-{len(self.requests)}",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model"} for name in SCRIPTS]})


def _replay(session: dict, max_moves: int, target: int) -> tuple[int, str, float]:
    """From the recorded calls alone: check each board follows from the last by the move and one
    new 2 or 4, and that each call's conversation extends the previous one; (moves, how it
    ended, the reward by the README's formula)."""
    calls = session["calls"]
    moves, largest, ended = 0, 0, "max_moves"
    for k, call in enumerate(calls):
        messages = call["request"]["messages"]
        reply = call["response"]["choices"][0]["message"]["content"]
        script = SCRIPTS[call["request"]["model"]]
        assert reply == script[k % len(script)]
        assert messages[0]["role"] == "system" and messages[-1]["role"] == "user"
        assert len(messages) == 2 + 2 * k  # one board/move pair more per call
        if k:
            previous = calls[k - 1]
            assert messages[:-2] == previous["request"]["messages"]
            assert messages[-2] == {
                "role": "assistant",
                "content": previous["response"]["choices"][0]["message"]["content"],
            }
        direction = {"left": "left", "Down.": "down", "I move RIGHT": "right", "up": "up"}.get(reply)
        moved = game.move(game.parse_board(messages[-1]["content"]), direction) if direction else None
        if moved is None or not moved.changed:
            assert k == len(calls) - 1  # an invalid move is the last call
            ended = "invalid"
            break
        moves, largest = moves + 1, max(largest, *moved.merged, 0)
        if k + 1 < len(calls):
            after = game.parse_board(calls[k + 1]["request"]["messages"][-1]["content"])
            diff = [i for i in range(16) if after[i] != moved.board[i]]
            assert len(diff) == 1 and moved.board[diff[0]] == 0 and after[diff[0]] in (2, 4)
    tile = 0.0 if largest < 4 else min(1.0, (largest.bit_length() - 2) / (target.bit_length() - 2))
    return moves, ended, 0.5 * moves / max_moves + 0.5 * tile


def test_the_agent_through_a_gateway_records_one_call_per_move_and_posts_the_game_reward(tmp_path, capsys):
    upstream = ScriptedUpstream()
    common = ["--groups", "2", "--rollouts", "3", "--max-moves", "6", "--target-tile", "16"]
    with ThreadServer(upstream.app) as up, openai_gateway(up.url + "/v1", tmp_path / "state") as (gw, _):
        returned = agent.main(["--base-url", gw.url + "/v1", "--model", "cycle", "--seed", "3", *common])
        returned += agent.main(["--base-url", gw.url + "/v1", "--model", "gives-up", "--seed", "4", *common])
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            listed = http.get("/v1/sessions", params={"limit": 100}).json()["data"]
            sessions = [http.get(f"/v1/sessions/{s['id']}").json() for s in listed]
            groups = {s["group_id"] for s in sessions}
            group_states = [http.get(f"/v1/groups/{g}").json() for g in groups]

    assert len(sessions) == 12 and len(groups) == 4 and [len(r) for r in returned] == [3, 3, 3, 3]
    assert sorted(r for rs in returned for r in rs) == pytest.approx(sorted(s["reward"] for s in sessions))
    assert all(g["closed"] for g in group_states), group_states
    endings = []
    for session in sessions:
        moves, ended, expected = _replay(session, max_moves=6, target=16)
        endings.append(ended)
        assert session["split"] == "train"
        assert session["reward"] == pytest.approx(expected)
        assert session["metrics"]["moves"] == moves and session["metrics"]["invalid"] == (ended == "invalid")
        assert len(session["calls"]) == moves + (ended == "invalid")  # one call per move (+ the invalid one)
    assert endings.count("max_moves") == 6 and endings.count("invalid") == 6  # both ways a game ends
    # the rollouts of a group share their dice, so a deterministic model plays them identically
    for g in groups:
        assert len({s["reward"] for s in sessions if s["group_id"] == g}) == 1
    assert sum(len(s["calls"]) for s in sessions) == len(upstream.requests)
    assert all(r["max_tokens"] == 8 for r in upstream.requests)
    assert "group 1: mean reward" in capsys.readouterr().out


def test_the_agent_runs_as_a_script():
    out = subprocess.run(
        [sys.executable, "examples/game2048/agent.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0 and "--max-moves" in out.stdout and "--target-tile" in out.stdout
