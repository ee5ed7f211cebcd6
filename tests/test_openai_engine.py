"""The `openai` engine: pass-through, error mapping and what never leaves the gateway (keys)."""

from __future__ import annotations

import json
import queue
import threading

import httpx
import openai
import pytest

from gateway.engines.openai import OpenAIEngine
from gateway.errors import ConfigError
from gateway.settings import Settings
from tests.fake_upstream import FakeUpstream
from tests.helpers import free_port
from tests.helpers_upstream import openai_gateway, raw_store_bytes

UPSTREAM_KEY = "sk-upstream-0d4c2b7e-never-store-me"
CLIENT_KEY = "sk-client-7f1e9a30-never-forward-me"


@pytest.fixture(scope="module")
def upstream():
    with FakeUpstream(api_key=UPSTREAM_KEY) as server:
        yield server


@pytest.fixture(scope="module")
def gateway(upstream, tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("state")
    with openai_gateway(upstream.url, state_dir, upstream_api_key=UPSTREAM_KEY, upstream_timeout=1.0) as (
        server,
        services,
    ):
        yield server, services, state_dir


@pytest.fixture
def client(gateway):
    server, _, _ = gateway
    return openai.OpenAI(base_url=server.url + "/v1", api_key=CLIENT_KEY, max_retries=0)


def _calls(gateway, session_id: str) -> list[dict]:
    _, services, _ = gateway
    return services.store.session_calls(session_id)


def test_from_settings_needs_an_upstream_url(tmp_path):
    with pytest.raises(ConfigError, match="--upstream-url"):
        OpenAIEngine.from_settings(Settings(engine="openai", state_dir=tmp_path))


def test_body_passes_through_unchanged_and_the_answer_comes_back(client, upstream, gateway):
    before = len(upstream.chat_requests())
    response = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "pass me through"}],
        temperature=0.3,
        max_tokens=17,
        seed=5,
        stop=["\n\n"],
        metadata={"session_id": "passthrough-1", "group_id": "g-pass", "trace": "keep-me"},
        extra_body={"top_k": 7, "repetition_penalty": 1.1},
    )
    assert response.choices[0].message.content == "pass me through"
    assert response.id.startswith("chatcmpl-fake-")
    (sent,) = upstream.chat_requests()[before:]
    assert sent.body["messages"][1] == {"role": "user", "content": "pass me through"}
    assert sent.body["temperature"] == 0.3 and sent.body["max_tokens"] == 17 and sent.body["seed"] == 5
    assert sent.body["top_k"] == 7 and sent.body["repetition_penalty"] == 1.1  # unknown fields pass
    assert sent.body["stop"] == ["\n\n"]
    assert sent.body["metadata"] == {"trace": "keep-me"}  # rlproxy's own keys are gone, the rest stays
    (call,) = _calls(gateway, "passthrough-1")
    assert call["status"] == "ok" and call["engine"] == "openai" and call["group_id"] == "g-pass"
    assert call["response"]["id"] == response.id
    assert call["response"]["choices"][0]["message"]["content"] == "pass me through"
    assert call["prompt_ids"] is None and call["completion_ids"] is None  # an upstream gives no tokens


def test_stream_relays_every_chunk_in_order(client, gateway):
    text = "one two three four five six"
    stream = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": text}],
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Session-Id": "stream-order"},
    )
    pieces, usage = [], None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content)
    assert pieces == ["", "one ", "two ", "three ", "four ", "five ", "six", None]
    assert usage is not None and usage.completion_tokens == 6
    (call,) = _calls(gateway, "stream-order")
    assert call["stream"] and call["status"] == "ok"
    assert call["response"]["choices"][0]["message"]["content"] == text
    assert call["response"]["usage"]["completion_tokens"] == 6


def test_stream_chunks_reach_the_client_before_the_upstream_finishes(client, upstream):
    """With [[hold]] the upstream sends one chunk and waits: the client must already see it."""
    received: queue.Queue = queue.Queue()

    def consume() -> None:
        try:
            stream = client.chat.completions.create(
                model="fake-model",
                messages=[{"role": "user", "content": "held answer [[hold]]"}],
                stream=True,
            )
            for chunk in stream:
                received.put(chunk)
            received.put("end")
        except Exception as exc:  # surfaced by the main thread
            received.put(exc)

    thread = threading.Thread(target=consume)
    thread.start()
    try:
        first = received.get(timeout=60)  # arrives while the upstream is still holding the rest
        assert not isinstance(first, Exception), first
        assert first.choices[0].delta.role == "assistant"
        assert received.empty()
    finally:
        upstream.release()
        thread.join(timeout=60)
    rest = []
    while (item := received.get(timeout=10)) != "end":
        assert not isinstance(item, Exception), item
        rest.append(item)
    assert "".join(c.choices[0].delta.content or "" for c in rest).startswith("held answer")


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
@pytest.mark.parametrize(
    ("magic", "status", "error_type", "says"),
    [
        ("[[status=500]]", 502, "upstream_error", "answered 500"),
        ("[[status=503]]", 502, "upstream_error", "answered 503"),
        ("[[status=400]]", 400, "invalid_request_error", "scripted failure 400 from the fake upstream"),
        ("[[status=404]]", 404, "invalid_request_error", "scripted failure 404 from the fake upstream"),
        ("[[malformed]]", 502, "upstream_error", "not JSON"),
        ("[[delay=3]]", 504, "upstream_timeout", "did not answer within 1 s"),
    ],
)
def test_upstream_failures_map_to_openai_errors_and_are_recorded(
    client, gateway, magic, status, error_type, says, stream
):
    session = f"err-{magic.strip('[]').replace('=', '-')}-{stream}"
    with pytest.raises(openai.APIStatusError) as caught:
        result = client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": f"fail please {magic}"}],
            stream=stream,
            extra_headers={"X-Session-Id": session},
        )
        if stream:
            list(result)
    assert caught.value.status_code == status
    error = caught.value.body
    assert error["type"] == error_type, error
    assert says in error["message"]
    if status == 400:
        assert error["param"] == "messages" and error["code"] == "fake_400"  # the upstream's fields are kept
    (call,) = _calls(gateway, session)
    assert call["status"] == "error" and call["http_status"] == status
    assert says in call["error"]
    assert call["request"]["messages"][0]["content"].endswith(magic)


def test_mid_stream_failure_ends_the_stream_with_an_error_and_is_recorded(client, gateway):
    stream = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "break [[stream_error]]"}],
        stream=True,
        extra_headers={"X-Session-Id": "mid-stream"},
    )
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        list(stream)
    (call,) = _calls(gateway, "mid-stream")
    assert call["status"] == "error" and call["http_status"] == 502 and "mid-stream" in call["error"]


def test_truncated_stream_is_an_error(client, gateway):
    stream = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "cut [[truncate]]"}],
        stream=True,
        extra_headers={"X-Session-Id": "truncated"},
    )
    with pytest.raises(openai.APIError):
        list(stream)
    (call,) = _calls(gateway, "truncated")
    assert call["status"] == "error" and call["http_status"] == 502


def test_refused_connection_is_a_502_and_recorded(tmp_path):
    dead_url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    with openai_gateway(dead_url, tmp_path) as (server, services):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError) as caught:
                result = client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": "anyone?"}],
                    stream=stream,
                    extra_headers={"X-Session-Id": f"refused-{stream}"},
                )
                if stream:
                    list(result)
            assert caught.value.status_code == 502
            assert "cannot reach the upstream" in caught.value.body["message"]
            (call,) = services.store.session_calls(f"refused-{stream}")
            assert call["status"] == "error" and call["http_status"] == 502
        assert client.models.list().data == []  # an unreachable upstream lists nothing, without failing


def test_models_come_from_the_upstream(client):
    assert [m.id for m in client.models.list().data] == ["fake-model", "fake-model-large"]


def test_upstream_key_is_sent_and_client_key_is_neither_forwarded_nor_stored(client, upstream, gateway):
    client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "keys"}], extra_headers={"X-Session-Id": "keys"}
    )
    list(
        client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": "keys"}],
            stream=True,
            extra_headers={"X-Session-Id": "keys"},
        )
    )
    received = upstream.requests
    assert received and all(r.headers.get("authorization") == f"Bearer {UPSTREAM_KEY}" for r in received)
    for request in received:
        assert CLIENT_KEY not in repr(request.headers) and CLIENT_KEY not in repr(request.body)
        assert "x-session-id" not in request.headers  # client headers are not forwarded at all
    _, services, state_dir = gateway
    assert len(services.store.session_calls("keys")) == 2
    stored = raw_store_bytes(state_dir)
    assert b"keys" in stored  # the grep does see the recorded calls
    assert UPSTREAM_KEY.encode() not in stored
    assert CLIENT_KEY.encode() not in stored


def test_wrong_upstream_key_is_the_gateways_fault_not_the_clients(upstream, tmp_path):
    with openai_gateway(upstream.url, tmp_path, upstream_api_key="sk-wrong") as (server, _):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 502
    assert "--upstream-api-key" in caught.value.body["message"]
    assert "sk-wrong" not in caught.value.body["message"]


def test_healthz_says_when_the_upstream_is_unreachable_and_sees_it_come_back(tmp_path):
    import httpx

    port = free_port()
    upstream = FakeUpstream(port=port).__enter__()
    with openai_gateway(upstream.url, tmp_path / "state") as (server, _):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        assert httpx.get(server.url + "/healthz").json()["status"] == "ok"
        upstream.__exit__(None, None, None)  # the upstream goes away
        with pytest.raises(openai.APIStatusError) as failed:
            client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}])
        assert failed.value.status_code == 502
        health = httpx.get(server.url + "/healthz")
        assert health.status_code == 503 and "cannot reach the upstream" in health.json()["reason"]
        with FakeUpstream(port=port):  # back on its port: /healthz's own look sees it, no call needed
            health = httpx.get(server.url + "/healthz")
            assert health.status_code == 200 and health.json()["status"] == "ok"


def test_a_stream_chunk_longer_than_aiohttps_line_limit_is_relayed_and_recorded(client, gateway):
    # One event of 600 kB (an upstream that sends a whole answer, or a long tool call's
    # arguments, in one chunk): past the 512 KiB aiohttp's readline allows.
    word = "y" * 600_000
    stream = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": word}],
        stream=True,
        extra_headers={"X-Session-Id": "long-chunk"},
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == word
    (call,) = _calls(gateway, "long-chunk")
    assert call["status"] == "ok" and call["response"]["choices"][0]["message"]["content"] == word


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "status, error, answered", [(429, openai.RateLimitError, 429), (503, openai.InternalServerError, 502)]
)
def test_an_upstream_retry_after_comes_back_with_its_error(client, gateway, stream, status, error, answered):
    # OpenAI's SDKs wait for Retry-After before they retry: without it they retry a rate limit at
    # once, and an overloaded upstream (its 503, a 502 from the gateway) sooner than it asked.
    session = f"retry-after-{status}-{stream}"
    with pytest.raises(error) as caught:
        result = client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": f"not now [[status={status}]]"}],
            stream=stream,
            extra_headers={"X-Session-Id": session},
        )
        if stream:
            list(result)
    assert caught.value.status_code == answered
    assert caught.value.response.headers["Retry-After"] == "7"
    (call,) = _calls(gateway, session)
    assert call["status"] == "error" and call["http_status"] == answered


def test_a_stream_that_fails_midway_ends_at_its_error_event_without_done(gateway):
    # `[DONE]` says the answer is complete: after an upstream failure it is not.
    server, _, _ = gateway
    body = {"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": "x [[stream_error]]"}]}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "no-done"})
    events = [line.removeprefix("data: ") for line in reply.text.splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in events
    assert json.loads(events[-1])["error"]["type"] == "upstream_error"
    (call,) = _calls(gateway, "no-done")
    assert call["status"] == "error" and call["http_status"] == 502


def test_a_stream_chunk_of_the_wrong_shape_is_a_502_error_event_and_recorded(client, gateway):
    stream = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "odd [[bad_chunk]]"}],
        stream=True,
        extra_headers={"X-Session-Id": "bad-chunk"},
    )
    with pytest.raises(openai.APIError, match="not a chat.completion.chunk"):
        list(stream)
    (call,) = _calls(gateway, "bad-chunk")
    assert call["status"] == "error" and call["http_status"] == 502  # not 499: the client did not leave


def test_an_unexpected_error_midway_is_recorded_as_500_not_as_the_client_leaving(client, gateway, monkeypatch):
    _, services, _ = gateway
    relay = services.engine.stream

    async def breaks_after_one_chunk(request):
        async for item in relay(request):
            yield item
            raise RuntimeError("a bug")

    monkeypatch.setattr(services.engine, "stream", breaks_after_one_chunk)
    stream = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "hello there"}],
        stream=True,
        extra_headers={"X-Session-Id": "gateway-bug"},
    )
    with pytest.raises(openai.APIError, match="internal error"):
        list(stream)
    (call,) = _calls(gateway, "gateway-bug")
    assert call["status"] == "error" and call["http_status"] == 500


@pytest.mark.parametrize("stream", [False, True])
def test_a_keep_alive_connection_the_upstream_closed_is_not_the_next_calls_failure(tmp_path, stream):
    # The upstream closes each idle connection just as the next request comes on it (its
    # keep-alive timeout won the race): that request never reached it, so it is sent again.
    with (
        FakeUpstream(drop_reused=True) as upstream,
        openai_gateway(upstream.url, tmp_path) as (server, _),
    ):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=CLIENT_KEY, max_retries=0)
        for turn in range(3):
            reply = client.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": f"turn {turn}"}], stream=stream
            )
            chunks = list(reply) if stream else None
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) if stream else None
            assert (text if stream else reply.choices[0].message.content) == f"turn {turn}"


def test_a_streamed_reasoning_models_thinking_is_recorded_as_unstreamed(client, gateway):
    # vLLM's reasoning parsers stream the thinking in `reasoning_content` deltas; the
    # unstreamed message keeps it, and so must the streamed call's record.
    stream = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "answer [[reasoning]]"}],
        stream=True,
        extra_headers={"X-Session-Id": "thinking"},
    )
    list(stream)
    (call,) = _calls(gateway, "thinking")
    message = call["response"]["choices"][0]["message"]
    assert message["reasoning_content"] == "Let me think."
    assert message["content"] == "answer [[reasoning]]"
