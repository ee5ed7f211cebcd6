"""The other protocols on the local engine (built-in tiny model), with the official clients
over a real socket: recorded token ids decode to what each client got, and one session
that mixes protocols becomes training samples whose masks are checked by hand."""

from __future__ import annotations

import re

import anthropic
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from gateway.app import create_app
from gateway.models.registry import resolve_base_model
from gateway.models.tiny import TINY_MODEL_ID
from gateway.settings import Settings
from tests.helpers import ThreadServer
from trainer.data import trajectory_samples


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    settings = Settings(state_dir=state, engine="local", trainer="off", default_max_tokens=10)
    app = create_app(settings)
    with ThreadServer(app) as server:
        yield server, app.state.services, settings


@pytest.fixture(scope="module")
def tokenizer(gateway):
    return AutoTokenizer.from_pretrained(resolve_base_model(TINY_MODEL_ID, gateway[2].state_dir))


def decoded(tokenizer, row) -> str:
    return tokenizer.decode(row["completion_ids"][0], skip_special_tokens=True).strip()


def test_each_protocol_records_what_the_client_got(gateway, tokenizer):
    url = gateway[0].url
    store = gateway[1].store
    oai = openai.OpenAI(base_url=f"{url}/sessions/local-each/v1", api_key="x", max_retries=0)
    claude = anthropic.Anthropic(base_url=f"{url}/sessions/local-each", api_key="x", max_retries=0)
    got = []
    got.append(oai.responses.create(model=TINY_MODEL_ID, input="hello", max_output_tokens=8).output_text)
    events = list(oai.responses.create(model=TINY_MODEL_ID, input="again", stream=True, max_output_tokens=8))
    got.append("".join(e.delta for e in events if e.type == "response.output_text.delta"))
    got.append(
        "".join(
            b.text
            for b in claude.messages.create(
                model=TINY_MODEL_ID, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
            ).content
            if b.type == "text"
        )
    )
    with claude.messages.stream(model=TINY_MODEL_ID, max_tokens=8, messages=[{"role": "user", "content": "yo"}]) as s:
        got.append(s.get_final_text())
    got.append(oai.completions.create(model=TINY_MODEL_ID, prompt="once upon", max_tokens=8).choices[0].text)
    rows = store.session_calls("local-each")
    assert [r["protocol"] for r in rows] == ["responses", "responses", "messages", "messages", "completions"]
    for row, text in zip(rows, got, strict=False):
        assert row["status"] == "ok" and row["prompt_ids"]
        assert decoded(tokenizer, row) == text.strip()
        assert len(row["behaviour_logprobs"][0]) == len(row["completion_ids"][0])


def test_mixed_protocol_session_trains_with_hand_checked_masks(gateway, tokenizer):
    url = gateway[0].url
    store = gateway[1].store
    oai = openai.OpenAI(base_url=f"{url}/sessions/mixed/v1", api_key="x", max_retries=0)
    claude = anthropic.Anthropic(base_url=f"{url}/sessions/mixed", api_key="x", max_retries=0)
    first = oai.responses.create(
        model=TINY_MODEL_ID, instructions="be kind", input="tell me", max_output_tokens=6, temperature=0.7
    )  # sampled, not greedy: greedy calls are context only (never trained)
    second = claude.messages.create(
        model=TINY_MODEL_ID,
        system="be kind",
        max_tokens=6,
        extra_body={"temperature": 0.7},
        messages=[
            {"role": "user", "content": "tell me"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "more"},
        ],
    )
    oai.chat.completions.create(
        model=TINY_MODEL_ID,
        max_tokens=6,
        temperature=0.7,
        messages=[
            {"role": "system", "content": "be kind"},
            {"role": "user", "content": "tell me"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": second.content[0].text if second.content else ""},
            {"role": "user", "content": "last"},
        ],
    )
    rows = store.session_calls("mixed")
    assert [r["protocol"] for r in rows] == ["responses", "messages", "chat"]
    samples = trajectory_samples(rows, trajectory_id="mixed", group_id="g", advantage=1.0)
    # By hand: walk the calls, merging a call into the running sequence when its prompt
    # starts with everything so far; prompt tokens are masked out, sampled tokens trained.
    expected, ids, mask = [], [], []
    for row in rows:
        prompt, completion = row["prompt_ids"], row["completion_ids"][0]
        if ids and prompt[: len(ids)] == ids:
            new = prompt[len(ids) :]
        else:
            if ids:
                expected.append((ids, mask))
            ids, mask, new = [], [], prompt
        ids = ids + new + completion
        mask = mask + [False] * len(new) + [True] * len(completion)
    expected.append((ids, mask))
    assert [(list(s.token_ids), list(s.loss_mask)) for s in samples] == expected
    trained = [t for s in samples for t, m in zip(s.token_ids, s.loss_mask, strict=False) if m]
    assert trained == [t for r in rows for t in r["completion_ids"][0]]  # every sampled token, nothing else


def test_responses_continued_by_id_and_retrieved(gateway, tokenizer):
    url = gateway[0].url
    store = gateway[1].store
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    tool = {
        "type": "function",
        "name": "lookup",
        "description": "look a word up",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
    }
    first = oai.responses.create(
        model=TINY_MODEL_ID,
        input="define cat",
        tools=[tool],
        max_output_tokens=8,
        extra_headers={"X-Session-Id": "local-chain"},
    )
    second = oai.responses.create(
        model=TINY_MODEL_ID,
        previous_response_id=first.id,
        max_output_tokens=8,
        input=[
            {"type": "function_call", "call_id": "call_9", "name": "lookup", "arguments": '{"word": "cat"}'},
            {"type": "function_call_output", "call_id": "call_9", "output": "a small feline"},
        ],
        tools=[tool],
    )
    assert oai.responses.retrieve(second.id).output_text == second.output_text
    rows = store.session_calls("local-chain")  # continued by id: the same session without a header
    assert len(rows) == 2
    assert decoded(tokenizer, rows[1]) == second.output_text.strip()
    prompt = tokenizer.decode(rows[1]["prompt_ids"])
    # the second prompt holds the first turn, the tool's definition, the call and its result
    assert "define cat" in prompt and "lookup" in prompt and "a small feline" in prompt


def test_anthropic_tool_result_reaches_the_prompt(gateway, tokenizer):
    claude = anthropic.Anthropic(base_url=f"{gateway[0].url}/sessions/local-tool", api_key="x", max_retries=0)
    tool = {
        "name": "lookup",
        "description": "look a word up",
        "input_schema": {"type": "object", "properties": {"word": {"type": "string"}}},
    }
    reply = claude.messages.create(
        model=TINY_MODEL_ID,
        max_tokens=8,
        tools=[tool],
        messages=[
            {"role": "user", "content": "define dog"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"word": "dog"}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a loyal canine"}],
            },
        ],
    )
    [row] = gateway[1].store.session_calls("local-tool")
    prompt = tokenizer.decode(row["prompt_ids"])
    assert "a loyal canine" in prompt and '"word": "dog"' in prompt and "lookup" in prompt
    assert decoded(tokenizer, row) == "".join(b.text for b in reply.content if b.type == "text").strip()


def test_anthropic_prefill_is_continued_not_answered_anew(gateway, tokenizer):
    """A last assistant message is a prefill: Anthropic's answer continues its text (an agent
    starts a JSON answer with '{'), so the prompt ends inside that message, not in a new turn."""
    claude = anthropic.Anthropic(base_url=f"{gateway[0].url}/sessions/local-prefill", api_key="x", max_retries=0)
    reply = claude.messages.create(
        model=TINY_MODEL_ID,
        max_tokens=6,
        messages=[{"role": "user", "content": "answer in JSON"}, {"role": "assistant", "content": '{"answer":'}],
    )
    [row] = gateway[1].store.session_calls("local-prefill")
    prompt = tokenizer.decode(row["prompt_ids"])
    assert prompt.endswith('<|im_start|>user\nanswer in JSON<|im_end|>\n<|im_start|>assistant\n{"answer":')
    assert decoded(tokenizer, row) == "".join(b.text for b in reply.content if b.type == "text").strip()


def test_openai_agents_sdk_on_the_local_engine(gateway, tokenizer):
    agents = pytest.importorskip("agents")
    import asyncio

    client = openai.AsyncOpenAI(base_url=f"{gateway[0].url}/sessions/local-agent/v1", api_key="x", max_retries=0)
    agents.set_tracing_disabled(True)
    agent = agents.Agent(
        name="a",
        instructions="answer",
        model=agents.OpenAIResponsesModel(model=TINY_MODEL_ID, openai_client=client),
        model_settings=agents.ModelSettings(max_tokens=8),
    )
    result = asyncio.run(agents.Runner.run(agent, "hello"))
    [row] = gateway[1].store.session_calls("local-agent")
    assert row["protocol"] == "responses"
    assert decoded(tokenizer, row) == (result.final_output or "").strip()


def test_anthropic_stop_sequence_says_which_one_ended_the_message(gateway):
    claude = anthropic.Anthropic(base_url=gateway[0].url, api_key="x", max_retries=0)
    ask = dict(  # greedy, so the stop string picked from one answer ends the next one
        model=TINY_MODEL_ID,
        max_tokens=12,
        messages=[{"role": "user", "content": "hello there"}],
        extra_body={"temperature": 0},
    )
    free = "".join(b.text for b in claude.messages.create(**ask).content if b.type == "text")
    stop = re.search(r"[A-Za-z]{2}", free[1:]).group()
    before = free[: free.index(stop)]

    stopped = claude.messages.create(**ask, stop_sequences=["never in it", stop])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in stopped.content if b.type == "text") == before
    with claude.messages.stream(**ask, stop_sequences=["never in it", stop]) as events:
        streamed = events.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in streamed.content if b.type == "text") == before
    recorded = gateway[1].store.get_call("req_" + streamed.id.removeprefix("msg_"))["wire_response"]
    assert (recorded["stop_reason"], recorded["stop_sequence"]) == ("stop_sequence", stop)  # what the client got

    ended = claude.messages.create(**ask, stop_sequences=["never in it"])  # the token limit, not the stop
    assert (ended.stop_reason, ended.stop_sequence) == ("max_tokens", None)


def user(content):
    return [{"role": "user", "content": content}]


@pytest.mark.parametrize(
    "path, body, says",
    [
        ("/v1/chat/completions", {"messages": user([{"type": "text", "text": 5}])}, "part 0's 'text' must be a string"),
        ("/v1/messages", {"messages": user([{"type": "text", "text": 5}])}, "messages[0].content[0].text must be"),
        (
            "/v1/messages",
            {
                "messages": user(
                    [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": None}]}]
                )
            },
            "messages[0].content[0].content[0].text must be a string",
        ),
        ("/v1/messages", {"messages": user("hi"), "system": [{"type": "text", "text": 1}]}, "system[0].text must be"),
        ("/v1/responses", {"input": user([{"type": "input_text", "text": 5}])}, "input[0].content[0].text must be"),
        ("/v1/responses", {"input": user(7)}, "input[0].content must be a string or a list of content parts"),
        (
            "/v1/responses",
            {"input": [{"type": "function_call_output", "call_id": "c1", "output": {"temp": 20}}]},
            "input[0].output must be a string or a list of content parts, not dict",
        ),
        (
            "/v1/responses",
            {"input": "hi", "text": {"format": "json"}},
            "text.format: Input should be a valid dictionary",
        ),
        # a field of the client's own item named, not the chat field it becomes
        (
            "/v1/responses",
            {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": {"city": "Paris"}}]},
            "input[0].arguments must be a string, not dict (the arguments as JSON text",
        ),
        (
            "/v1/responses",
            {"input": [{"type": "function_call_output", "call_id": 7, "output": "20 C"}]},
            "input[0].call_id must be a string, not int",
        ),
        (
            "/v1/messages",
            {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]},
            "messages[0].content[0].id is missing",
        ),
        (
            "/v1/messages",
            {"messages": user([{"type": "tool_result", "tool_use_id": 7, "content": "20 C"}])},
            "messages[0].content[0].tool_use_id must be a string, not int",
        ),
    ],
)
def test_malformed_text_is_a_400_that_says_where(gateway, path, body, says):
    """Not a 500 from joining a number into the prompt: the client is told which value to fix."""
    answer = httpx.post(f"{gateway[0].url}{path}", json={"model": TINY_MODEL_ID, "max_tokens": 4, **body})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert says in error["message"]
    if path == "/v1/messages":
        assert answer.json()["type"] == "error" and error["type"] == "invalid_request_error"


def test_the_local_engine_refuses_what_it_would_answer_without(gateway):
    """An image it cannot see, or a logit_bias or vLLM sampling field it does not apply: answered
    anyway, the client would get an answer to another request and not know it."""
    oai = openai.OpenAI(base_url=f"{gateway[0].url}/v1", api_key="x", max_retries=0)
    question = {"type": "text", "text": "what is in the picture?"}
    picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(openai.BadRequestError) as image:
        oai.chat.completions.create(
            model=TINY_MODEL_ID, max_tokens=4, messages=[{"role": "user", "content": [question, picture]}]
        )
    assert image.value.body["param"] == "messages[0].content[1].type"
    assert "'image_url' is not supported by the local engine" in image.value.body["message"]
    with pytest.raises(openai.BadRequestError) as bias:
        oai.chat.completions.create(
            model=TINY_MODEL_ID, max_tokens=4, messages=[{"role": "user", "content": "hi"}], logit_bias={"42": -100}
        )
    assert bias.value.body["param"] == "logit_bias"
    for vllm_field in ({"stop_token_ids": [13]}, {"min_tokens": 3}, {"include_stop_str_in_output": True}):
        with pytest.raises(openai.BadRequestError) as unapplied:
            oai.chat.completions.create(
                model=TINY_MODEL_ID, max_tokens=4, messages=[{"role": "user", "content": "hi"}], extra_body=vllm_field
            )
        assert unapplied.value.body["param"] == next(iter(vllm_field))
        assert "is not supported by the local engine (the vllm engine takes it)" in unapplied.value.body["message"]
    answer = oai.chat.completions.create(  # text parts, and an empty logit_bias or neutral vLLM fields, are fine
        model=TINY_MODEL_ID,
        max_tokens=4,
        messages=[{"role": "user", "content": [question]}],
        logit_bias={},
        extra_body={"stop_token_ids": [], "ignore_eos": False, "min_tokens": 0},
    )
    assert answer.choices[0].message.content is not None


def test_responses_logprobs_when_included(gateway):
    """`include: ["message.output_text.logprobs"]` (and `top_logprobs`) gives each output token's
    logprob, the one the engine sampled it with, streamed or not."""
    oai = openai.OpenAI(base_url=f"{gateway[0].url}/sessions/local-logprobs/v1", api_key="x", max_retries=0)
    ask = dict(model=TINY_MODEL_ID, input="hello", max_output_tokens=5, include=["message.output_text.logprobs"])
    whole = oai.responses.create(**ask, top_logprobs=2).output[0].content[0]
    events = list(oai.responses.create(**ask, stream=True))
    deltas = [entry for e in events if e.type == "response.output_text.delta" for entry in e.logprobs]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    plain = oai.responses.create(model=TINY_MODEL_ID, input="hello", max_output_tokens=5).output[0].content[0]

    first, streamed, _ = gateway[1].store.session_calls("local-logprobs")
    assert [entry.logprob for entry in whole.logprobs] == first["behaviour_logprobs"][0]
    assert all(len(entry.top_logprobs) == 2 for entry in whole.logprobs)
    assert [entry.logprob for entry in done.logprobs] == streamed["behaviour_logprobs"][0]
    # each delta with its own tokens' (a last token without text, such as the end of turn, only in `done`)
    assert deltas and [entry.logprob for entry in deltas] == streamed["behaviour_logprobs"][0][: len(deltas)]
    assert plain.logprobs is None  # not asked, not sent


def test_anthropic_builtin_tools_are_refused_custom_ones_taken(gateway):
    """A server tool (web search) or a schema-less Anthropic tool type would reach the model as a
    function with no parameters: refused, naming the tool; a custom tool is what rlproxy serves."""
    claude = anthropic.Anthropic(base_url=gateway[0].url, api_key="x", max_retries=0)
    ask = dict(model=TINY_MODEL_ID, max_tokens=4, messages=[{"role": "user", "content": "what is new today?"}])
    lookup = {"name": "lookup", "description": "look a word up", "input_schema": {"type": "object"}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(**ask, tools=[lookup, {"type": "web_search_20250305", "name": "web_search"}])
    assert refused.value.body["type"] == "error"
    assert "tools[1]: tool type 'web_search_20250305' is not supported" in refused.value.body["error"]["message"]
    assert claude.messages.create(**ask, tools=[{**lookup, "type": "custom"}]).type == "message"


def test_anthropic_takes_more_stop_sequences_than_openai(gateway):
    """Anthropic's stop_sequences have no limit of 4 (OpenAI's `stop` has, and keeps it)."""
    claude = anthropic.Anthropic(base_url=gateway[0].url, api_key="x", max_retries=0)
    ask = dict(model=TINY_MODEL_ID, max_tokens=12, messages=[{"role": "user", "content": "hello there"}])
    greedy = {"temperature": 0}
    free = "".join(b.text for b in claude.messages.create(**ask, extra_body=greedy).content if b.type == "text")
    stop = re.search(r"[A-Za-z]{2}", free[1:]).group()
    stops = [f"never {i}" for i in range(7)] + [stop]
    stopped = claude.messages.create(**ask, extra_body=greedy, stop_sequences=stops)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    with pytest.raises(anthropic.BadRequestError, match="stop_sequences"):
        claude.messages.create(**ask, stop_sequences=[f"s{i}" for i in range(65)])
    oai = openai.OpenAI(base_url=f"{gateway[0].url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="at most 4"):
        oai.chat.completions.create(model=TINY_MODEL_ID, max_tokens=2, messages=ask["messages"], stop=stops[:5])


PNG = "iVBORw0KGgo="


@pytest.mark.parametrize(
    "path, body, says",
    [
        (
            "/v1/messages",
            {
                "messages": [
                    {"role": "user", "content": "take a screenshot"},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t1",
                                "content": [{"type": "image", "source": {"type": "base64", "data": PNG}}],
                            }
                        ],
                    },
                ]
            },
            "messages[2].content[0].content[0]: content part 'image' is not supported",
        ),
        (
            "/v1/responses",
            {
                "input": [
                    {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
                    {
                        "type": "function_call_output",
                        "call_id": "c1",
                        "output": [{"type": "input_image", "image_url": PNG}],
                    },
                ]
            },
            "input[1].output[0]: content part 'input_image' is not supported",
        ),
    ],
)
def test_an_image_in_a_tool_result_is_refused_not_dropped(gateway, path, body, says):
    """The model would answer about a tool result it never saw: a 400, as for an image in a user message."""
    answer = httpx.post(f"{gateway[0].url}{path}", json={"model": TINY_MODEL_ID, "max_tokens": 4, **body})
    assert answer.status_code == 400 and says in answer.json()["error"]["message"]


def test_a_model_is_retrieved_by_its_name(gateway):
    """OpenAI's `client.models.retrieve`: one entry of GET /v1/models, a name with '/' included."""
    oai = openai.OpenAI(base_url=f"{gateway[0].url}/v1", api_key="x", max_retries=0)
    listed = {model.id for model in oai.models.list()}
    assert {TINY_MODEL_ID, "agent"} <= listed
    for name in listed:
        assert oai.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError) as missing:
        oai.models.retrieve("no-such-model")
    assert missing.value.body["code"] == "model_not_found" and "agent" in missing.value.body["message"]


def test_deleting_a_response_says_why_it_is_kept(gateway):
    """OpenAI's client sends DELETE with no body: not a 415 asking for JSON. A response is a call of
    its session, kept as training data: the 405 says so and names the session to discard instead."""
    oai = openai.OpenAI(base_url=f"{gateway[0].url}/sessions/kept/v1", api_key="x", max_retries=0)
    response = oai.responses.create(model=TINY_MODEL_ID, input="hi", max_output_tokens=2)
    with pytest.raises(openai.APIStatusError) as refused:
        oai.responses.delete(response.id)
    assert refused.value.status_code == 405 and refused.value.body["code"] == "response_not_deletable"
    assert "POST /v1/sessions/kept/discard" in refused.value.body["message"]
    assert oai.responses.retrieve(response.id).id == response.id
    bare = httpx.delete(f"{gateway[0].url}/v1/responses/resp_unknown")  # no Content-Type at all
    assert bare.status_code == 404 and bare.json()["error"]["param"] == "response_id"


def test_anthropic_stream_reports_input_tokens_at_message_start(gateway):
    """As Anthropic's API does: message_start already holds the prompt's tokens, and message_delta's
    final usage still holds them with the output tokens."""
    claude = anthropic.Anthropic(base_url=gateway[0].url, api_key="x", max_retries=0)
    asked = {
        "model": TINY_MODEL_ID,
        "max_tokens": 4,
        "system": "be brief",
        "messages": [{"role": "user", "content": "hi"}],
    }
    whole = claude.messages.create(**asked)
    events = list(claude.messages.create(stream=True, **asked))
    assert events[0].type == "message_start"
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens > 0
    final = [event for event in events if event.type == "message_delta"][-1]
    assert final.usage.input_tokens == whole.usage.input_tokens and final.usage.output_tokens == 4
