"""`rlproxy export --format openai` of sessions recorded through a running gateway (the built-in
tiny model, local engine): OpenAI trains every assistant message of a line unless it says
`"weight": 0`, so a line must mark the assistant messages the trainer never trained (history the
client wrote), and write a prefill and its continuation as the one message the model produced."""

from __future__ import annotations

import json

import httpx
import pyarrow.parquet as pq
import pytest

from gateway.app import create_app
from gateway.settings import Settings
from tests.helpers import ThreadServer
from tests.test_export_records import export, validate_fine_tuning_line


def session(session_id: str) -> dict:
    """Headers of a session that is a group of its own, so that `--group` exports it alone."""
    return {"X-Session-Id": session_id, "X-Group-Id": session_id}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A few-shot session (the client wrote an assistant turn) and two prefills, one per protocol."""
    settings = Settings(engine="local", state_dir=tmp_path_factory.mktemp("state"), default_max_tokens=3, trainer="off")
    replies = {}
    with ThreadServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        few_shot = [
            {"role": "user", "content": "1+1"},
            {"role": "assistant", "content": "2"},
            {"role": "user", "content": "2+2"},
        ]
        done = client.post(
            "/v1/chat/completions",
            headers=session("few-shot"),
            json={"model": "agent", "messages": few_shot},
        )
        assert done.status_code == 200, done.text
        replies["few-shot"] = done.json()["choices"][0]["message"]["content"]
        done = client.post(
            "/v1/chat/completions",
            headers=session("prefill"),
            json={
                "model": "agent",
                "messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Sure, here"}],
                "continue_final_message": True,
                "add_generation_prompt": False,
            },
        )
        assert done.status_code == 200, done.text
        replies["prefill"] = done.json()["choices"][0]["message"]["content"]
        done = client.post(
            "/v1/messages",
            headers=session("anthropic-prefill"),
            json={
                "model": "agent",
                "max_tokens": 3,
                "messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Sure"}],
            },
        )
        assert done.status_code == 200, done.text
        replies["anthropic-prefill"] = done.json()["content"][0]["text"]
    return settings, replies


def export_openai(settings, tmp_path, session_id: str) -> list[dict]:
    out = export(settings, tmp_path, "openai", "--group", session_id)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    for line in lines:
        validate_fine_tuning_line(line)
    return lines


def test_an_assistant_turn_the_client_wrote_is_not_trained(recorded, tmp_path):
    settings, replies = recorded
    (line,) = export_openai(settings, tmp_path, "few-shot")
    assert line["messages"] == [
        {"role": "user", "content": "1+1"},
        {"role": "assistant", "content": "2", "weight": 0},  # the client's example: context, as in the trainer
        {"role": "user", "content": "2+2"},
        {"role": "assistant", "content": replies["few-shot"]},
    ]


@pytest.mark.parametrize("session_id, prefill", [("prefill", "Sure, here"), ("anthropic-prefill", "Sure")])
def test_a_prefill_and_its_continuation_are_one_assistant_message(recorded, tmp_path, session_id, prefill):
    settings, replies = recorded
    (line,) = export_openai(settings, tmp_path, session_id)
    assert line["messages"] == [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": prefill + replies[session_id]},
    ]


def test_a_parquet_row_of_a_prefill_holds_the_message_the_model_produced(recorded, tmp_path):
    # Its token ids are the prompt up to the prefill's text and the continuation: one message.
    settings, replies = recorded
    out = export(settings, tmp_path, "parquet", "--group", "prefill")
    (row,) = pq.read_table(out).to_pylist()
    assert json.loads(row["messages"]) == [
        {"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": "Sure, here" + replies["prefill"]},
    ]
