"""A 400 names the field to fix as the client wrote it: `param` in OpenAI's shape
(`messages[0].content`), and, where a protocol's field was translated to chat's
(Responses' `max_output_tokens` is chat's `max_tokens`), the client's field, not chat's."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.models.tiny import TINY_MODEL_ID
from gateway.settings import Settings
from tests.helpers import ThreadServer

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    settings = Settings(state_dir=tmp_path_factory.mktemp("state"), engine="local", trainer="off", default_max_tokens=4)
    with ThreadServer(create_app(settings)) as server:
        yield server.url


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": HI, "n": 0}, "n"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": HI, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("/v1/chat/completions", {"messages": HI, "model": None}, "model"),
        ("/v1/responses", {"input": "hi", "temperature": 9}, "temperature"),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": 7}]}, "tools[0].name"),
        ("/v1/responses", {"input": [{"role": "user"}]}, "input[0].content"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"prompt": ["hi", "ho"], "stop": ["x"] * 65}, "stop"),  # a list's, as one prompt's
        ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),  # OpenAI's 4, as chat's
        # true is no count (pydantic read it as 1: one token answered)
        ("/v1/chat/completions", {"messages": HI, "max_tokens": True}, "max_tokens"),
        ("/v1/chat/completions", {"messages": HI, "n": True}, "n"),
        ("/v1/responses", {"input": "hi", "max_output_tokens": True}, "max_output_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ],
)
def test_a_validation_error_names_its_field_in_param(url, path, body, param):
    answer = httpx.post(f"{url}{path}", json={"model": TINY_MODEL_ID, **body})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == param


def test_a_boolean_is_no_count_in_anthropics_shape_either(url):
    answer = httpx.post(f"{url}/v1/messages", json={"model": TINY_MODEL_ID, "messages": HI, "max_tokens": True})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error == {"type": "invalid_request_error", "message": "max_tokens: expected a whole number, not true"}


def test_the_openai_client_reads_param(url):
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as choices:
        oai.chat.completions.create(model=TINY_MODEL_ID, messages=HI, n=0)
    assert choices.value.param == "n"


def test_responses_context_error_names_max_output_tokens(url):
    """The client sent `max_output_tokens`; an error about `max_tokens` names a field it never wrote."""
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as whole:
        oai.responses.create(model=TINY_MODEL_ID, input="hi", max_output_tokens=100000)
    assert whole.value.body["param"] == "max_output_tokens"
    assert whole.value.body["code"] == "context_length_exceeded"
    assert "'max_output_tokens' is 100000" in whole.value.body["message"]
    assert "max_tokens" not in whole.value.body["message"]
    with pytest.raises(openai.BadRequestError) as room:  # under the context alone, over it with the prompt
        oai.responses.create(model=TINY_MODEL_ID, input="hi " * 100, max_output_tokens=2040)
    assert room.value.body["param"] == "input"
    assert "lower 'max_output_tokens'" in room.value.body["message"]
    assert "Shorten 'input'" in room.value.body["message"]  # a Responses client sent no 'messages'
    assert "max_tokens" not in room.value.body["message"] and "messages" not in room.value.body["message"]


def test_completions_prompt_over_the_context_names_prompt(url):
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as room:
        oai.completions.create(model=TINY_MODEL_ID, prompt="hi " * 100, max_tokens=2040)
    assert room.value.body["param"] == "prompt" and room.value.body["code"] == "context_length_exceeded"
    assert "Shorten 'prompt'" in room.value.body["message"] and "messages" not in room.value.body["message"]


def test_a_prompt_list_with_one_prompt_past_the_context_answers_and_records_none(url):
    """Each prompt of a list is a call of its own: one past the context failed the request after
    those before it were answered and recorded, answers the client never got, trained with the
    session's reward. Every prompt is checked first now."""
    session = "list-past-the-context"
    answer = httpx.post(
        f"{url}/v1/completions",
        json={"model": TINY_MODEL_ID, "prompt": ["hi", "word " * 3000], "max_tokens": 2},
        headers={"X-Session-Id": session},
    )
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    assert error["message"].startswith("'prompt'[1]: this model's context is 2048 tokens")
    assert httpx.get(f"{url}/v1/sessions/{session}").status_code == 404  # no call of it recorded


def test_anthropic_errors_name_the_field_in_the_message(url):
    """Anthropic's error shape has no `param`: its message names the client's field."""
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as room:
        claude.messages.create(model=TINY_MODEL_ID, max_tokens=2040, messages=[{"role": "user", "content": "hi " * 99}])
    assert "Shorten 'messages' or lower 'max_tokens'" in room.value.body["error"]["message"]
    assert room.value.body["error"]["type"] == "invalid_request_error"
    assert "max_completion_tokens" not in room.value.body["error"]["message"]


def test_the_message_names_the_field_as_param_does(url):
    """Not pydantic's place (`messages.0.content.str`, a union member the client never wrote)."""
    answer = httpx.post(f"{url}/v1/chat/completions", json={"model": TINY_MODEL_ID, "messages": [{"role": "user"}]})
    assert answer.json()["error"]["message"].startswith("messages[0]: ")
    bad = httpx.post(
        f"{url}/v1/chat/completions", json={"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": 5}]}
    ).json()["error"]
    assert bad["message"].startswith("messages[0].content: Input should be")
    assert ".str" not in bad["message"] and "list[" not in bad["message"]
