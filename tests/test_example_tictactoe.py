"""The tic-tac-toe example (examples/tictactoe/): the agent end to end through a real gateway
(openai engine) in front of an upstream that always takes the lowest free square, so each
game follows from the opponent's dice alone."""

from __future__ import annotations

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from examples.tictactoe import agent
from tests.helpers import ThreadServer
from tests.helpers_upstream import openai_gateway


async def lowest_free_square(request: Request) -> JSONResponse:
    body = await request.json()
    board = body["messages"][-1]["content"].split()  # a free square shows its number
    move = next(cell for cell in board if cell.isdigit())
    return JSONResponse(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": move}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    )


def _games(http: httpx.Client, split: str) -> list[list[str]]:
    """Each recorded game of `split` as the boards X was shown, oldest group first."""
    listed = http.get("/v1/sessions", params={"limit": 100, "split": split}).json()["data"]
    sessions = [http.get(f"/v1/sessions/{s['id']}").json() for s in listed]
    assert all(s["split"] == split for s in sessions)
    games = []
    for session in sorted(sessions, key=lambda s: s["calls"][0]["created_at"]):
        last = session["calls"][-1]["request"]["messages"]
        games.append([m["content"] for m in last if m["role"] == "user"])
    return games


def test_val_games_are_not_the_train_games(tmp_path):
    """`--split val` scores games never trained on: the same --seed deals other dice than train."""
    upstream = Starlette(routes=[Route("/v1/chat/completions", lowest_free_square, methods=["POST"])])
    with ThreadServer(upstream) as up, openai_gateway(up.url + "/v1", tmp_path / "state") as (gw, _):
        common = ["--base-url", gw.url + "/v1", "--model", "lowest", "--groups", "4", "--rollouts", "1"]
        train = agent.main(common)
        val = agent.main([*common, "--split", "val"])
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            train_games, val_games = _games(http, "train"), _games(http, "val")
    assert [len(r) for r in train] == [len(r) for r in val] == [1, 1, 1, 1]
    assert len(train_games) == len(val_games) == 4
    assert not [game for game in val_games if game in train_games]  # no val game was a train game
