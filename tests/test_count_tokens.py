"""`POST /v1/messages/count_tokens` (Anthropic's `client.messages.count_tokens`, which Claude Code
calls): the served model's chat template and tokenizer over the message, not a model call."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from transformers import AutoTokenizer

from gateway.app import create_app
from gateway.models.registry import resolve_base_model
from gateway.models.tiny import TINY_MODEL_ID
from gateway.settings import Settings
from tests.helpers import ThreadServer
from tests.helpers_upstream import openai_gateway

TOOL = {"name": "weather", "description": "the weather in a city", "input_schema": {"type": "object"}}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    settings = Settings(state_dir=tmp_path_factory.mktemp("state"), engine="local", trainer="off")
    app = create_app(settings)
    with ThreadServer(app) as server:
        yield server, app.state.services, settings


def rendered_length(settings: Settings, messages: list[dict], tools: list[dict] | None = None) -> int:
    """The count computed here: the model's own tokenizer over its chat template's text."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_base_model(TINY_MODEL_ID, settings.state_dir))
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_the_anthropic_client_counts_input_tokens(gateway):
    server, services, settings = gateway
    claude = anthropic.Anthropic(base_url=f"{server.url}/sessions/counted", api_key="x", max_retries=0)
    asked = {"model": TINY_MODEL_ID, "system": "be brief", "messages": [{"role": "user", "content": "hello there"}]}
    count = claude.messages.count_tokens(**asked).input_tokens
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    assert count == rendered_length(settings, chat)
    assert services.store.session_calls("counted") == []  # not a model call: nothing recorded
    answer = claude.messages.create(max_tokens=2, **asked)
    assert answer.usage.input_tokens == count  # what the call itself then reports


def test_tools_are_counted(gateway):
    server, _, settings = gateway
    claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "weather in Paris?"}]
    count = claude.messages.count_tokens(model=TINY_MODEL_ID, messages=messages, tools=[TOOL]).input_tokens
    function = {"type": "function", "function": {"name": "weather", "description": TOOL["description"]}}
    function["function"]["parameters"] = {"type": "object"}
    assert count == rendered_length(settings, messages, [function])
    assert count > claude.messages.count_tokens(model=TINY_MODEL_ID, messages=messages).input_tokens


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"model": TINY_MODEL_ID}, 400, "messages: Field required"),
        ({"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content: Input"),
        ({"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model 'nope' not found"),
    ],
)
def test_a_bad_count_request_is_refused_in_anthropics_shape(gateway, body, status, says):
    answer = httpx.post(f"{gateway[0].url}/v1/messages/count_tokens", json=body)
    assert answer.status_code == status
    assert answer.json()["type"] == "error" and says in answer.json()["error"]["message"]


def test_an_engine_without_a_tokenizer_says_so(tmp_path):
    """The openai engine relays chat to an upstream: it has no tokenizer of the model's to count with."""
    with openai_gateway("http://127.0.0.1:9/v1", tmp_path) as (server, _):
        claude = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.NotFoundError) as refused:  # as from a server without the route
            claude.messages.count_tokens(model="m", messages=[{"role": "user", "content": "x"}])
    assert "cannot count tokens" in refused.value.body["error"]["message"]
