"""Gateway behaviour over HTTP, through the `openai` engine so no model is needed.

The official `openai` client (sync and async) for chat; httpx for rlproxy's own routes.
"""

from __future__ import annotations

import logging

import httpx
import openai
import pytest
from prometheus_client import generate_latest

from tests.helpers_upstream import openai_gateway, raw_store_bytes

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "look a word up",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
]


@pytest.fixture(scope="module")
def gateway(upstream, tmp_path_factory):
    with openai_gateway(upstream.url, tmp_path_factory.mktemp("state")) as (server, services):
        yield server, services


@pytest.fixture
def base_url(gateway) -> str:
    return gateway[0].url


@pytest.fixture
def store(gateway):
    return gateway[1].store


@pytest.fixture
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=30) as session:
        yield session


def _chat(client, text: str, **kwargs):
    return client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": text}], **kwargs)


# ---------------------------------------------------------------- chat completions


def test_sync_client_plain_and_stream(client, store):
    answer = _chat(client, "plain call", extra_headers={"X-Session-Id": "sync-1"})
    assert answer.choices[0].message.content == "plain call"
    assert answer.model == "fake-model"
    text = "".join(
        c.choices[0].delta.content or ""
        for c in _chat(client, "streamed call", stream=True, extra_headers={"X-Session-Id": "sync-1"})
        if c.choices
    )
    assert text == "streamed call"
    calls = store.session_calls("sync-1")
    assert [c["stream"] for c in calls] == [False, True]
    assert [c["response"]["choices"][0]["message"]["content"] for c in calls] == ["plain call", "streamed call"]


async def test_async_client_plain_and_stream(base_url, store):
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    answer = await client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "async plain"}],
        extra_headers={"X-Session-Id": "async-1"},
    )
    assert answer.choices[0].message.content == "async plain"
    stream = await client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "async streamed"}],
        stream=True,
        extra_headers={"X-Session-Id": "async-1"},
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "async streamed"
    await client.close()
    assert len(store.session_calls("async-1")) == 2


def test_n_choices_plain_and_stream(client, store):
    answer = _chat(client, "many", n=3, extra_headers={"X-Session-Id": "n-3"})
    assert [c.message.content for c in answer.choices] == ["many (0)", "many (1)", "many (2)"]
    texts: dict[int, str] = {}
    for chunk in _chat(client, "many", n=3, stream=True, extra_headers={"X-Session-Id": "n-3"}):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert texts == {0: "many (0)", 1: "many (1)", 2: "many (2)"}
    recorded = [[ch["message"]["content"] for ch in c["response"]["choices"]] for c in store.session_calls("n-3")]
    assert recorded == [["many (0)", "many (1)", "many (2)"]] * 2


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_tools_and_tool_messages_pass_through_and_are_recorded(client, upstream, store, stream):
    session = f"tools-{stream}"
    messages = [
        {"role": "user", "content": "what is x?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "x is 1"},
        {"role": "user", "content": "call it again [[tool_call]]"},
    ]
    before = len(upstream.chat_requests())
    result = client.chat.completions.create(
        model="fake-model",
        messages=messages,
        tools=TOOLS,
        tool_choice="auto",
        stream=stream,
        extra_headers={"X-Session-Id": session},
    )
    if stream:
        calls: dict[int, dict] = {}
        for chunk in result:
            for choice in chunk.choices:
                for delta in choice.delta.tool_calls or []:
                    call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                    call["id"] = delta.id or call["id"]
                    call["name"] += (delta.function.name or "") if delta.function else ""
                    call["arguments"] += (delta.function.arguments or "") if delta.function else ""
        assert calls == {0: {"id": "call_0", "name": "lookup", "arguments": '{"x": 1}'}}
    else:
        (tool_call,) = result.choices[0].message.tool_calls
        assert (tool_call.id, tool_call.function.name, tool_call.function.arguments) == ("call_0", "lookup", '{"x": 1}')
        assert result.choices[0].finish_reason == "tool_calls"
    (sent,) = upstream.chat_requests()[before:]
    assert sent.body["messages"] == messages and sent.body["tools"] == TOOLS and sent.body["tool_choice"] == "auto"
    (call,) = store.session_calls(session)
    assert call["request"]["messages"] == messages and call["request"]["tools"] == TOOLS
    recorded = call["response"]["choices"][0]
    assert recorded["message"]["tool_calls"][0]["function"] == {"name": "lookup", "arguments": '{"x": 1}'}
    assert recorded["finish_reason"] == "tool_calls"


def test_a_client_that_leaves_a_non_stream_call_is_recorded_as_499(base_url, store):
    """Its answer never reached anyone: recorded as 499, so it is never trained (issue 13)."""
    import time

    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            base_url + "/v1/chat/completions",
            timeout=0.5,
            headers={"X-Session-Id": "left-waiting"},
            json={"model": "fake-model", "messages": [{"role": "user", "content": "slow [[delay=3]]"}]},
        )
    deadline = time.monotonic() + 30
    while not store.session_calls("left-waiting") and time.monotonic() < deadline:
        time.sleep(0.05)
    (call,) = store.session_calls("left-waiting")
    assert call["status"] == "error" and call["http_status"] == 499 and "disconnected" in call["error"]
    # and the gateway goes on answering
    ok = httpx.post(
        base_url + "/v1/chat/completions",
        timeout=30,
        headers={"X-Session-Id": "after"},
        json={"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]},
    )
    assert ok.status_code == 200


def test_a_client_that_leaves_at_once_is_recorded_as_499_too(base_url, store):
    """Request sent, socket closed at once, before the upstream answers: cancelled and
    recorded as 499, not answered (and recorded 200) when the upstream's 3 s are up."""
    import json
    import socket
    import time
    from urllib.parse import urlsplit

    url = urlsplit(base_url)
    body = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": "slow [[delay=3]]"}]}).encode()
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"X-Session-Id: left-at-once\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
    left = time.monotonic()
    while not store.session_calls("left-at-once") and time.monotonic() < left + 30:
        time.sleep(0.01)
    (call,) = store.session_calls("left-at-once")
    assert call["http_status"] == 499 and "disconnected" in call["error"]  # not a 200 once the 3 s were up


def test_a_client_that_leaves_mid_stream_is_recorded_as_such(base_url, upstream, store):
    """The gateway notices the disconnect, stops relaying and records what was sent (499)."""
    import time

    with httpx.Client(base_url=base_url, timeout=30) as http:
        with http.stream(
            "POST",
            "/v1/chat/completions",
            headers={"X-Session-Id": "left-early"},
            json={
                "model": "fake-model",
                "stream": True,
                "messages": [{"role": "user", "content": "wait for me [[hold]]"}],
            },
        ) as reply:
            first = next(reply.iter_lines())
            assert first.startswith("data: ") and '"role":"assistant"' in first
        # leaving the block closed the connection while the upstream holds the rest
    deadline = time.monotonic() + 30
    while not store.session_calls("left-early") and time.monotonic() < deadline:
        time.sleep(0.05)
    upstream.release()
    (call,) = store.session_calls("left-early")
    assert call["status"] == "error" and call["http_status"] == 499
    assert "disconnected" in call["error"]
    assert call["response"]["choices"][0]["message"]["role"] == "assistant"


# ---------------------------------------------------------------- identity headers and metadata


def test_headers_name_session_group_and_split(client, store):
    raw = client.chat.completions.with_raw_response.create(
        model="fake-model",
        messages=[{"role": "user", "content": "hi"}],
        extra_headers={"X-Session-Id": "hdr-sess", "X-Group-Id": "hdr-group", "X-Split": "val"},
    )
    assert raw.headers["x-session-id"] == "hdr-sess"
    (call,) = store.session_calls("hdr-sess")
    assert (call["group_id"], call["split"]) == ("hdr-group", "val")
    group = store.get_group("hdr-group")
    assert [s["id"] for s in group["sessions"]] == ["hdr-sess"] and group["split"] == "val"


def test_body_metadata_names_session_and_is_removed_before_the_upstream(client, upstream, store):
    before = len(upstream.chat_requests())
    raw = client.chat.completions.with_raw_response.create(
        model="fake-model",
        messages=[{"role": "user", "content": "hi"}],
        metadata={"session_id": "meta-sess", "group_id": "meta-group", "split": "val"},
    )
    assert raw.headers["x-session-id"] == "meta-sess"
    (sent,) = upstream.chat_requests()[before:]
    assert "metadata" not in sent.body
    (call,) = store.session_calls("meta-sess")
    assert (call["group_id"], call["split"]) == ("meta-group", "val")
    assert call["request"]["metadata"]["session_id"] == "meta-sess"  # the record keeps what the client sent


def test_headers_win_over_metadata(client, store):
    client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "hi"}],
        metadata={"session_id": "loser"},
        extra_headers={"X-Session-Id": "winner"},
    )
    assert len(store.session_calls("winner")) == 1 and store.session_calls("loser") == []


def test_missing_session_is_minted_and_returned(client, store):
    raw = client.chat.completions.with_raw_response.create(
        model="fake-model", messages=[{"role": "user", "content": "who am i"}]
    )
    session_id = raw.headers["x-session-id"]
    assert session_id.startswith("sess_")
    assert raw.headers["x-request-id"]
    (call,) = store.session_calls(session_id)
    assert call["id"] == raw.headers["x-request-id"]
    raw = client.chat.completions.with_raw_response.create(
        model="fake-model", messages=[{"role": "user", "content": "streamed"}], stream=True
    )
    assert raw.headers["x-session-id"].startswith("sess_") and raw.headers["x-session-id"] != session_id
    assert raw.headers["x-request-id"]
    list(raw.parse())


def test_client_request_id_is_recorded_and_a_reused_one_loses_no_call(client, store):
    for _ in range(2):  # a retry that sends the same id again
        raw = client.chat.completions.with_raw_response.create(
            model="fake-model",
            messages=[{"role": "user", "content": "traced"}],
            extra_headers={"X-Request-Id": "my-trace-123", "X-Session-Id": "traced"},
        )
        assert raw.headers["x-request-id"] != "my-trace-123"  # ours: the call row's key
    calls = store.session_calls("traced")
    assert [c["client_request_id"] for c in calls] == ["my-trace-123", "my-trace-123"]
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize(
    ("headers", "says"),
    [
        ({"X-Split": "test"}, "split 'test' is not valid"),
        ({"X-Session-Id": "has spaces"}, "session_id 'has spaces' is not valid"),
        ({"X-Group-Id": "x" * 200}, "group_id"),
    ],
)
def test_bad_identity_is_a_400(client, headers, says):
    with pytest.raises(openai.BadRequestError, match=says):
        _chat(client, "hi", extra_headers=headers)


@pytest.mark.parametrize(
    ("metadata", "says"),
    [
        ({"split": 5}, "split '5' is not valid"),
        ({"split": True}, "split 'True' is not valid"),
        ("a string", "metadata: Input should be a valid dictionary"),
        ([{"session_id": "s"}], "metadata: Input should be a valid dictionary"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_metadata_of_the_wrong_shape_is_a_400_not_a_500(http, path, metadata, says):
    body = {"model": "fake-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    reply = http.post(path, json={**body, "metadata": metadata})
    assert reply.status_code == 400, reply.text
    assert says in reply.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/completions"])
def test_a_body_that_is_not_json_says_so_on_every_protocol(http, path):
    # FastAPI's own parse answered "9: JSON decode error" on the other protocols' routes.
    reply = http.post(path, content=b'{"model": "fake-model", ', headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "the request body is not valid JSON" in reply.text, reply.text


# ---------------------------------------------------------------- rewards, sessions, groups


@pytest.mark.parametrize("stream", [False, True])
def test_a_split_that_contradicts_the_session_or_group_is_a_409(client, store, stream):
    # A val rollout inside a train group would be trained on: refused before it is generated.
    _chat(
        client, "train rollout", extra_headers={"X-Session-Id": f"split-a-{stream}", "X-Group-Id": f"split-g-{stream}"}
    )
    for headers, says in (
        (
            {"X-Session-Id": f"split-b-{stream}", "X-Group-Id": f"split-g-{stream}", "X-Split": "val"},
            f"group 'split-g-{stream}' holds 'train' sessions",
        ),
        # a session is one rollout: it is a train session (the store's words), it holds none
        ({"X-Session-Id": f"split-a-{stream}", "X-Split": "val"}, f"session 'split-a-{stream}' is a 'train' session"),
    ):
        with pytest.raises(openai.ConflictError) as info:
            _chat(client, "val rollout", stream=stream, extra_headers=headers)
        assert "X-Split 'val'" in info.value.message and "one split per" in info.value.message
        assert says in info.value.message
    assert [s["id"] for s in store.get_group(f"split-g-{stream}")["sessions"]] == [f"split-a-{stream}"]


def test_a_call_from_another_replica_with_a_contradicting_split_is_refused_by_the_store(store):
    # The store checks again in the transaction (another replica's calls never went through
    # this process's check).

    from gateway.errors import Conflict
    from tests.helpers import call_row

    store.record_call_sync(call_row("replica-a-1", "replica-a", "replica-g", "train"))
    with pytest.raises(Conflict, match="one split per group"):
        store.record_call_sync(call_row("replica-b-1", "replica-b", "replica-g", "val"))


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_naming_another_group_than_its_sessions_is_a_409(client, store, stream):
    # The session kept its first group while the call row named the second (and a late-call
    # check read the second's state): one rollout is in one group, as it is in one split.
    _chat(client, "first", extra_headers={"X-Session-Id": f"moves-{stream}", "X-Group-Id": f"stays-{stream}"})
    with pytest.raises(openai.ConflictError) as info:
        _chat(client, "second", stream=stream, extra_headers={"X-Session-Id": f"moves-{stream}", "X-Group-Id": "other"})
    assert f"is in group 'stays-{stream}'" in info.value.message and "one group per session" in info.value.message
    assert [c["group_id"] for c in store.session_calls(f"moves-{stream}")] == [f"stays-{stream}"]


def test_session_view_shows_sampling_beside_behaviour_logprobs(client, http):
    _chat(client, "sampled", temperature=0.7, top_p=0.9, extra_headers={"X-Session-Id": "sampling-view"})
    (call,) = http.get("/v1/sessions/sampling-view").json()["calls"]
    # An upstream's behaviour policy is not ours to see: no behaviour logprobs, and only the
    # parameters the request set (None: the upstream's own default, unknown).
    assert call["behaviour_logprobs"] is None
    assert call["sampling"]["temperature"] == 0.7 and call["sampling"]["top_p"] == 0.9
    assert call["sampling"]["presence_penalty"] is None


def test_a_greedy_call_shows_why_it_is_not_trained(client, http):
    # an upstream call at 1e-6 is greedy (below 1e-5, as vLLM decides it): never trained
    _chat(client, "argmax", temperature=1e-6, extra_headers={"X-Session-Id": "greedy-view"})
    _chat(client, "sampled", temperature=0.7, extra_headers={"X-Session-Id": "greedy-view"})
    greedy, sampled = http.get("/v1/sessions/greedy-view/tokens").json()["calls"]
    assert greedy["trained"] is False and greedy["untrained_reason"].startswith("greedy")
    assert sampled["untrained_reason"] is None


def test_reward_and_session_roundtrip(client, http):
    _chat(client, "solve it", extra_headers={"X-Session-Id": "rewarded"})
    reply = http.post("/v1/sessions/rewarded/reward", json={"reward": 0.75, "metrics": {"steps": 3}})
    assert reply.status_code == 200, reply.text
    assert reply.json()["reward"] == 0.75
    session = http.get("/v1/sessions/rewarded").json()
    assert session["reward"] == 0.75 and session["metrics"] == {"steps": 3.0}
    assert [c["response"]["choices"][0]["message"]["content"] for c in session["calls"]] == ["solve it"]


def test_a_reward_that_cannot_train_in_its_group_says_why(client, http):
    # The answer's `trainable` comes with the `reason` when it is false, grouped or not: a val
    # rollout and a discarded one in a harness group are stored (200) and never trained.
    _chat(client, "val try", extra_headers={"X-Session-Id": "why-val", "X-Group-Id": "why-g-val", "X-Split": "val"})
    _chat(client, "train try", extra_headers={"X-Session-Id": "why-gone", "X-Group-Id": "why-g"})
    assert http.post("/v1/sessions/why-gone/discard", json={"reason": "tool crashed"}).status_code == 200
    for session, says in (("why-val", "split 'val'"), ("why-gone", "discarded")):
        answer = http.post(f"/v1/sessions/{session}/reward", json={"reward": 1.0}).json()
        assert answer["trainable"] is False and says in answer.get("reason", ""), answer
    _chat(client, "kept", extra_headers={"X-Session-Id": "why-kept", "X-Group-Id": "why-g"})
    answer = http.post("/v1/sessions/why-kept/reward", json={"reward": 1.0}).json()
    assert answer["trainable"] is True and answer["group_id"] == "why-g" and "reason" not in answer


def _late_calls(http) -> float:
    line = next(x for x in http.get("/metrics").text.splitlines() if x.startswith("rlproxy_untrainable_calls_total"))
    return float(line.split()[-1])


def test_rewards_are_taken_while_the_group_is_open_and_refused_once_a_step_claims_it(client, http, store):
    for session in ("frozen-a", "frozen-b"):
        _chat(client, "task", extra_headers={"X-Session-Id": session, "X-Group-Id": "frozen"})
    assert http.post("/v1/sessions/frozen-a/reward", json={"reward": 1.0}).status_code == 200
    assert http.post("/v1/sessions/frozen-a/reward", json={"reward": 0.5}).status_code == 200  # open: may change
    http.post("/v1/groups/frozen/close", json={})
    assert http.post("/v1/sessions/frozen-b/reward", json={"reward": 0.0}).status_code == 200
    assert store.claim_for_step(["frozen"], 7) == ["frozen"]  # what the trainer does first in a step
    refused = http.post("/v1/sessions/frozen-a/reward", json={"reward": 1.0})
    assert refused.status_code == 409, refused.text
    assert "being trained (step 7)" in refused.json()["error"]["message"]
    assert http.get("/v1/sessions/frozen-a").json()["reward"] == 0.5  # unchanged
    # a call to a claimed group's session is served and kept, never trained, and counted
    late_before = _late_calls(http)
    assert _chat(client, "one more", extra_headers={"X-Session-Id": "frozen-b"}).choices[0].message.content
    late = http.get("/v1/sessions/frozen-b").json()["calls"][-1]
    assert late["untrainable"].startswith("late: group 'frozen' was being trained (step 7)")
    assert _late_calls(http) == late_before + 1
    store.insert_step("frozen-model", 7, "/nowhere/0007", {}, ["frozen"])  # the step records it
    refused = http.post("/v1/sessions/frozen-b/reward", json={"reward": 1.0})
    assert refused.status_code == 409 and "already trained (step 7)" in refused.json()["error"]["message"]
    _chat(client, "and another", extra_headers={"X-Session-Id": "frozen-a"})
    tokens = http.get("/v1/sessions/frozen-a/tokens").json()["calls"]
    assert tokens[-1]["trained"] is False
    assert tokens[-1]["untrained_reason"].startswith("late: group 'frozen' was already trained (step 7)")
    assert _late_calls(http) == late_before + 2


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b'{"reward": NaN}', "finite"),
        (b'{"reward": Infinity}', "finite"),
        (b'{"reward": -Infinity}', "finite"),
        (b'{"reward": 1e999}', "finite"),
        (b'{"reward": "NaN"}', "valid number"),  # a string is not a number, whatever it reads
        (b'{"reward": "inf"}', "valid number"),
        (b'{"reward": "1.0"}', "valid number"),
        (b'{"reward": true}', "valid number"),
        (b'{"reward": "high"}', "valid number"),
        (b'{"reward": 1e200}', "beyond +-1e+06"),  # its group's variance would overflow in the trainer
        (b'{"reward": 1, "metrics": {"m": NaN}}', "finite"),
        (b'{"reward": 1, "metrics": {"m": "NaN"}}', "valid number"),  # a string, as the reward's
        (b'{"reward": 1, "metrics": {"m": "lots"}}', "valid number"),
        (b'{"reward": 1, "metrics": {"m": true}}', "valid number"),  # pydantic read true as 1.0
        (b"{}", "reward"),
    ],
)
def test_reward_must_be_a_finite_number(client, http, body, says):
    _chat(client, "x", extra_headers={"X-Session-Id": "finite-check"})
    reply = http.post("/v1/sessions/finite-check/reward", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and says in error["message"], error
    assert http.get("/v1/sessions/finite-check").json()["reward"] is None


def test_group_close_and_ready(client, http):
    for session in ("g1-a", "g1-b"):
        _chat(client, "task", extra_headers={"X-Session-Id": session, "X-Group-Id": "g1"})
    http.post("/v1/sessions/g1-a/reward", json={"reward": 1.0})
    group = http.get("/v1/groups/g1").json()
    assert group["n_sessions"] == 2 and not group["closed"] and not group["ready"]
    closed = http.post("/v1/groups/g1/close", json={})
    assert closed.status_code == 200 and closed.json()["closed"] and not closed.json()["ready"]
    http.post("/v1/sessions/g1-b/reward", json={"reward": 0.0})
    assert http.get("/v1/groups/g1").json()["ready"]


def test_group_ready_by_expected_sessions(client, http):
    _chat(client, "task", extra_headers={"X-Session-Id": "g2-a", "X-Group-Id": "g2"})
    reply = http.post("/v1/groups/g2/close", json={"expected_sessions": 2})
    assert reply.status_code == 200 and reply.json()["expected_sessions"] == 2 and not reply.json()["closed"]
    http.post("/v1/sessions/g2-a/reward", json={"reward": 1.0})
    assert not http.get("/v1/groups/g2").json()["ready"]  # one of two sessions so far
    _chat(client, "task", extra_headers={"X-Session-Id": "g2-b", "X-Group-Id": "g2"})
    http.post("/v1/sessions/g2-b/reward", json={"reward": 0.5})
    assert http.get("/v1/groups/g2").json()["ready"]
    bad = http.post("/v1/groups/g2/close", json={"expected_sessions": 0})
    assert bad.status_code == 400 and "expected_sessions" in bad.json()["error"]["message"]


def test_true_is_no_expected_sessions(client, http):
    """pydantic read `true` as 1: a group closed as complete with one session."""
    _chat(client, "task", extra_headers={"X-Session-Id": "g3-a", "X-Group-Id": "g3"})
    bad = http.post("/v1/groups/g3/close", json={"expected_sessions": True})
    assert bad.status_code == 400, bad.text
    message = bad.json()["error"]["message"]
    assert "expected_sessions" in message and "not true" in message, message
    assert http.get("/v1/groups/g3").json()["expected_sessions"] is None


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/sessions/nobody/reward", {"reward": 1.0}),
        ("GET", "/v1/sessions/nobody", None),
        ("POST", "/v1/groups/nogroup/close", {}),
        ("GET", "/v1/groups/nogroup", None),
    ],
)
def test_unknown_ids_are_404(http, method, path, body):
    reply = http.request(method, path, json=body)
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert error["type"] == "not_found_error" and "not found" in error["message"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/sessions/x/reward", "/v1/groups/x/close"])
def test_bad_json_is_a_400(http, path):
    reply = http.post(path, content=b"{not json", headers={"content-type": "application/json"})
    assert reply.status_code == 400
    assert "not valid JSON" in reply.json()["error"]["message"]


def test_invalid_chat_body_is_a_400_naming_the_field(http):
    reply = http.post("/v1/chat/completions", json={"model": "fake-model", "messages": []})
    assert reply.status_code == 400 and "messages" in reply.json()["error"]["message"]
    reply = http.post(
        "/v1/chat/completions", json={"model": "fake-model", "messages": [{"role": "tool", "content": "x"}]}
    )
    assert reply.status_code == 400 and "tool_call_id" in reply.json()["error"]["message"]


def test_wrong_route_and_method_are_openai_shaped(http):
    missing = http.get("/v1/nothing-here")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "no route GET /v1/nothing-here"
    wrong = http.get("/v1/chat/completions")
    assert wrong.status_code == 405
    assert wrong.json()["error"]["type"] == "invalid_request_error" and "GET" in wrong.json()["error"]["message"]


def test_head_answers_wherever_get_does_without_a_body(http):
    """`curl -I`, load balancers and uptime checks send HEAD: the GET route's status and headers."""
    for path in ("/healthz", "/v1/models", "/metrics", "/v1/sessions", "/openapi.json"):
        got, head = http.get(path), http.head(path)
        assert (head.status_code, head.content) == (got.status_code, b"") == (200, b"")
        assert head.headers["content-type"] == got.headers["content-type"] and head.headers["x-request-id"]
    assert http.head("/v1/nothing-here").status_code == 404
    assert http.head("/v1/chat/completions").status_code == 405  # POST only, as for GET
    assert http.get("/healthz").json()["status"]  # the connection the HEADs used still serves


def test_models_and_metrics(client, http):
    _chat(client, "count me")
    assert "fake-model" in [m.id for m in client.models.list().data]
    reply = http.get("/metrics")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    assert 'rlproxy_chat_requests_total{status="ok",stream="false"}' in reply.text
    assert "rlproxy_store_commits" in reply.text
    assert http.get("/healthz").json()["engine"] == "openai"


def test_metrics_count_with_counters_that_only_go_up(client, http):
    # Prometheus' conventions: a count of events is a counter, exposed as NAME_total.
    from prometheus_client.parser import text_string_to_metric_families

    def scrape() -> dict:
        text = http.get("/metrics").text
        return {family.name: family for family in text_string_to_metric_families(text)}

    before = scrape()
    _chat(client, "commit me")
    after = scrape()
    assert after["rlproxy_store_commits"].type == "counter"
    [sample] = [s for s in after["rlproxy_store_commits"].samples if s.name == "rlproxy_store_commits_total"]
    [earlier] = [s for s in before["rlproxy_store_commits"].samples if s.name == "rlproxy_store_commits_total"]
    assert sample.value > earlier.value


def test_call_latency_buckets_reach_the_upstream_timeout():
    # A call of minutes (long generations; --upstream-timeout is 600 s) lands in a bucket of its own.
    from gateway.metrics import Metrics

    metrics = Metrics()
    metrics.observe_call("ok", True, latency_ms=250_000.0)
    text = generate_latest(metrics.registry).decode()
    assert 'rlproxy_chat_latency_seconds_bucket{le="120.0"} 0.0' in text
    assert 'rlproxy_chat_latency_seconds_bucket{le="300.0"} 1.0' in text


# ---------------------------------------------------------------- auth


def test_api_key_guards_every_route_but_healthz_and_is_never_stored_or_logged(upstream, tmp_path, caplog):
    key = "sk-gateway-5e1c0f9b-secret"
    caplog.set_level(logging.DEBUG)
    with openai_gateway(upstream.url, tmp_path, api_key=key, log_level="debug") as (server, services):
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert http.get("/healthz").status_code == 200
            for method, path in [
                ("POST", "/v1/chat/completions"),
                ("GET", "/v1/models"),
                ("GET", "/metrics"),
                ("GET", "/v1/sessions/s"),
                ("POST", "/v1/sessions/s/reward"),
                ("GET", "/v1/groups/g"),
                ("POST", "/v1/groups/g/close"),
                ("GET", "/v1/training/steps"),
                ("GET", "/v1/no-such-route"),
            ]:
                missing = http.request(method, path)
                assert missing.status_code == 401, (method, path)
                assert missing.json()["error"]["type"] == "authentication_error"
                assert "missing API key" in missing.json()["error"]["message"]
                wrong = http.request(method, path, headers={"Authorization": "Bearer sk-not-it"})
                assert wrong.status_code == 401 and "invalid API key" in wrong.json()["error"]["message"]
                assert key not in missing.text + wrong.text
        good = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
        assert (
            good.chat.completions.create(
                model="fake-model",
                messages=[{"role": "user", "content": "authorised"}],
                extra_headers={"X-Session-Id": "authed"},
            )
            .choices[0]
            .message.content
            == "authorised"
        )
        list(
            good.chat.completions.create(
                model="fake-model",
                messages=[{"role": "user", "content": "again"}],
                stream=True,
                extra_headers={"X-Session-Id": "authed"},
            )
        )
        assert good.models.list().data
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-not-it", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "no"}])
        assert len(services.store.session_calls("authed")) == 2
    stored = raw_store_bytes(tmp_path)
    assert b"authorised" in stored and key.encode() not in stored
    logged = "\n".join(record.getMessage() + repr(record.args) for record in caplog.records)
    assert caplog.records  # the gateway did log (debug level), and none of it has the key
    assert key not in logged and key not in caplog.text
