"""The SDK against a real gateway on loopback (openai engine in front of the fake upstream)."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

import sdk
from sdk import (
    APIConnectionError,
    AsyncRLProxy,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    NotFoundError,
    RLProxy,
    RLProxyAPIError,
    RolloutsFailed,
    ServerError,
)
from sdk.client import api_base
from tests.helpers import free_port
from tests.helpers_judge import FakeJudge, judge_url
from tests.helpers_upstream import openai_gateway
from trainer.data import load_groups

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def judge_port() -> int:
    """Where the tests' FakeJudges listen: the gateway starts first and allows that judge."""
    return free_port()


@pytest.fixture(scope="module")
def gateway(upstream, tmp_path_factory, judge_port):
    judges = {"judge_model": ["openai/judge"], "judge_api_base": [judge_url(judge_port)]}
    with openai_gateway(upstream.url, tmp_path_factory.mktemp("sdk-state"), **judges) as (server, services):
        yield server, services


@pytest.fixture
def proxy(gateway):
    server, _ = gateway
    with RLProxy(server.url + "/v1") as client:
        yield client


def _ask(session, text: str) -> str:
    client = session.openai_client(max_retries=0)
    reply = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": text}])
    return reply.choices[0].message.content


# ---------------------------------------------------------------- the package


def test_importing_the_sdk_loads_nothing_heavy():
    code = (
        "import sys, sdk; heavy = ('torch', 'fastapi', 'transformers', 'gateway', 'pydantic_settings', "
        "'openai', 'litellm', 'starlette'); print([m for m in heavy if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("given", ["http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"])
def test_base_url_with_or_without_v1(given):
    assert api_base(given) == "http://h:8000/v1"
    assert api_base(given.replace("h:8000", "h:8000/rlproxy")) == "http://h:8000/rlproxy/v1"  # behind a path


@pytest.mark.parametrize("path", ["/sessions/s1/v1", "/groups/g1/sessions/s1/v1/", "/tasks/t1/sessions/s1"])
@pytest.mark.parametrize("client_class", [RLProxy, AsyncRLProxy])
def test_a_sessions_own_base_url_is_refused_naming_the_gateways(path, client_class):
    """The gateway puts every call through `/groups/g1/sessions/...` into group g1 unless the call
    names its own: each `proxy.session()` without a group silently joined it."""
    with pytest.raises(ValueError, match=r"is one session's URL .* give the gateway's own URL"):
        client_class("http://h:8000" + path)


def test_the_key_is_never_shown():
    client = RLProxy("http://h:1", api_key="sk-sdk-secret-key")
    assert "sk-sdk-secret-key" not in repr(client) and "sk-sdk-secret-key" not in repr(client.session())
    client.close()


@pytest.mark.parametrize("key", ["sk-sdk-secret-key\n", " sk-sdk-secret-key", "sk-sdk-secret-k\u00e9y"])
@pytest.mark.parametrize("client_class", [RLProxy, AsyncRLProxy])
def test_a_key_no_header_can_carry_is_refused_without_repeating_it(key, client_class, monkeypatch):
    """It was sent anyway: httpx refused it with `Illegal header value b'Bearer <the key>'`, the
    key in the APIConnectionError's text and its traceback (or a bare UnicodeEncodeError)."""
    with pytest.raises(ValueError, match=r"the API key \(api_key=\) is not one an HTTP header can carry") as info:
        client_class("http://h:1", api_key=key)
    assert "secret" not in str(info.value)
    monkeypatch.setenv("RLPROXY_API_KEY", key)
    with pytest.raises(ValueError, match=r"\(\$RLPROXY_API_KEY\)") as info:
        client_class("http://h:1")
    assert "secret" not in str(info.value)


@pytest.mark.parametrize("bad", ["caf\u00e9", "a\nb", " padded"])
@pytest.mark.parametrize("client_class", [RLProxy, AsyncRLProxy])
def test_an_id_no_header_can_carry_is_refused_when_its_session_or_group_is_made(bad, client_class):
    """It failed only at the agent's first call: a bare UnicodeEncodeError, or the OpenAI
    client's "Connection error." (retried first) for a newline."""
    client = client_class("http://h:1")
    expected = r"is not valid: use 1-128 letters, digits or \. _ : @ -"
    for what, make in (
        ("session_id", lambda: client.session(session_id=bad)),
        ("group_id", lambda: client.session(group=bad)),
        ("task_id", lambda: client.session(task_id=bad)),
        ("group_id", lambda: client.group(bad)),
        ("session_id", lambda: client.group().session(bad)),
    ):
        with pytest.raises(ValueError, match=f"^{what} .*{expected}"):
            make()
    assert client.session(group="ticket 12").group_id == "ticket 12"  # a header carries it: the gateway judges it


# ---------------------------------------------------------------- blocking flows


def test_a_group_of_parallel_sessions_with_rewards_then_closed(proxy, gateway):
    _, services = gateway
    running, most = [0], [0]
    lock = threading.Lock()

    def rollout(session):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            answer = _ask(session, f"task {session.index}")
        finally:
            with lock:
                running[0] -= 1
        return len(answer) / 10

    with proxy.group() as group:
        result = group.run(rollout, n=6, concurrency=3)
        assert result.n_failed == 0 and len(result.sessions) == 6
        assert [s.index for s in result.sessions] == list(range(6))
        assert result.rewards == [0.6] * 6
    assert group.closed
    assert 1 < most[0] <= 3  # in parallel, never more than `concurrency`

    state = proxy.get_group(group.id)
    assert state["closed"] and state["ready"] and state["n_sessions"] == 6
    assert {s["id"] for s in state["sessions"]} == {s.id for s in result.sessions}
    assert all(s["reward"] == 0.6 for s in state["sessions"])
    call = services.store.session_calls(result.sessions[0].id)[0]
    assert call["group_id"] == group.id and call["split"] == "train"


def test_a_failing_rollout_is_counted_skipped_and_discarded(proxy, gateway):
    _, services = gateway

    def rollout(session):
        if session.index == 1:
            raise RuntimeError("tool crashed")
        if session.index == 2:
            _ask(session, "half way")
            raise ValueError("lost the thread")
        _ask(session, "fine")
        return 1.0

    with proxy.group() as group:
        result = group.run(rollout, n=4, concurrency=2, max_exceptions=2)
        assert result.n_failed == 2
        assert [s.index for s in result.sessions] == [0, 3] and result.rewards == [1.0, 1.0]
        assert [type(e) for e in result.exceptions] == [RuntimeError, ValueError]
        assert [s.index for s in result.failed] == [1, 2]
        # The one that failed after a call is discarded; the one that failed before any call never existed.
        assert result.discarded == [result.failed[1]] and result.failed[1].discarded
    state = proxy.get_group(group.id)
    assert state["closed"] and state["ready"]  # on the two rewards alone
    assert (state["n_sessions"], state["n_rewarded"], state["n_discarded"]) == (2, 2, 1)
    assert [s["id"] for s in state["discarded_sessions"]] == [result.failed[1].id]

    recorded = result.failed[1].get()
    assert recorded["discarded"] is True and recorded["reward"] is None
    assert recorded["discard_reason"] == "rollout raised ValueError: lost the thread"
    assert [c["request"]["messages"][0]["content"] for c in recorded["calls"]] == ["half way"]  # kept
    groups, calls = load_groups(services.store, [group.id])  # what the trainer would read
    assert set(calls) == {s.id for s in result.sessions}


def test_too_many_failures_stop_the_run(proxy):
    started = []

    def rollout(session):
        started.append(session.index)
        raise RuntimeError(f"boom {session.index}")

    group = proxy.group()
    with pytest.raises(RolloutsFailed) as info:
        group.run(rollout, n=5, concurrency=1, max_exceptions=1)
    assert started == [0, 1]  # the rest never started
    assert info.value.result.n_failed == 2 and "boom 1" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_group_no_call_reached_closes_quietly(proxy):
    with proxy.group() as group:
        result = group.run(lambda session: 1 / 0, n=2, max_exceptions=2)
    assert result.n_failed == 2 and not group.closed
    with pytest.raises(NotFoundError):
        group.close()  # asked for explicitly, it still says the group does not exist


def test_a_rollout_must_return_a_number_or_none(proxy):
    def rollout(session):
        _ask(session, "x")
        return "great"

    result = proxy.group().run(rollout, n=1, max_exceptions=1)
    assert isinstance(result.exceptions[0], TypeError)


def test_an_async_rollout_given_to_a_blocking_group_says_to_use_the_async_client(proxy):
    """It ran nothing: each rollout "raised" TypeError "... not coroutine", and Python warned
    that the coroutine was never awaited."""

    async def rollout(session):
        return 1.0

    with pytest.raises(TypeError, match=r"coroutine function.*use AsyncRLProxy"):
        proxy.group().run(rollout, n=2)
    result = proxy.group().run(lambda session: rollout(session), n=1, max_exceptions=1)  # hidden in a lambda
    assert "use AsyncRLProxy" in str(result.exceptions[0])


def test_sessions_and_headers_for_any_client(proxy, gateway):
    server, services = gateway
    session = proxy.session(group="g-headers", split="val")
    assert session.headers() == {"X-Session-Id": session.id, "X-Group-Id": "g-headers", "X-Split": "val"}
    response = httpx.post(
        server.url + "/v1/chat/completions",
        headers=session.headers(),
        json={"model": "fake-model", "messages": [{"role": "user", "content": "raw"}]},
    )
    assert response.status_code == 200 and response.headers["X-Session-Id"] == session.id
    assert session.reward(0.5, metrics={"turns": 1})["metrics"] == {"turns": 1}
    recorded = session.get()
    assert recorded["split"] == "val" and recorded["group_id"] == "g-headers" and recorded["reward"] == 0.5


def test_a_sessions_base_url_ties_calls_of_a_client_without_headers_to_it(proxy, gateway):
    """For an agent that takes a base URL and a key but no headers (the README's URL form)."""
    openai = pytest.importorskip("openai")
    server, _ = gateway
    grouped, alone = proxy.session(group="g-url:1"), proxy.session()
    assert grouped.base_url() == f"{server.url}/groups/g-url%3A1/sessions/{grouped.id}/v1"
    assert alone.base_url(v1=False) == f"{server.url}/sessions/{alone.id}"
    for session in (grouped, alone):
        client = openai.OpenAI(base_url=session.base_url(), api_key="none", max_retries=0)
        reply = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "by URL"}])
        assert reply.choices[0].message.content == "by URL"
        client.close()
        recorded = session.get()
        assert recorded["group_id"] == session.group_id and len(recorded["calls"]) == 1
    live = proxy.session(task_id="billing")
    assert live.base_url() == f"{server.url}/tasks/billing/sessions/{live.id}/v1"
    with pytest.raises(ValueError, match="cannot carry the split"):
        proxy.session(split="val").base_url()


def test_a_session_made_by_the_proxy_for_a_group_object_is_one_of_the_group(proxy, gateway):
    """`proxy.session(group=group)` (docs/agents.md) as `group.session()`: the group's split (a
    train session in a val group was refused with 409 at its first call), and the group closes
    when its block ends (it stayed open, so it never trained)."""
    with proxy.group(split="val") as group:
        session = proxy.session(group=group)
        assert session.split == "val" and session.group_id == group.id
        assert _ask(session, "val attempt") == "val attempt"
        session.reward(1.0)
    recorded = proxy.get_group(group.id)
    assert recorded["split"] == "val" and recorded["closed"] is True and recorded["ready"] is True
    with pytest.raises(ValueError, match="split 'train' is not the split of group"):
        proxy.session(group=group, split="train")
    assert proxy.session(group="by-id").split == "train"  # a group id alone: the default split


def test_a_group_of_the_other_kind_of_client_is_refused(proxy):
    """A blocking session of an asyncio group was bound to the AsyncRLProxy: its reward()
    returned a coroutine nobody awaited, and the reward was never posted, without an error."""
    other = AsyncRLProxy(proxy.api_base)
    with pytest.raises(TypeError, match=r"group '.*' belongs to the AsyncRLProxy that made it: make its sessions"):
        proxy.session(group=other.group())
    with pytest.raises(TypeError, match=r"belongs to the RLProxy that made it"):
        other.session(group=proxy.group())
    asyncio.run(other.close())


def test_a_session_with_a_task_id_instead_of_a_group(upstream, tmp_path):
    """Live traffic: sessions opened with `task_id` carry X-Task-Id, are recorded under that task
    key, and once rewarded the gateway gathers them into a live group of that task."""
    with openai_gateway(upstream.url, tmp_path, live_group_size=2) as (server, _), RLProxy(server.url) as proxy:
        sessions = [proxy.session(task_id="billing") for _ in range(2)]
        assert sessions[0].headers() == {"X-Session-Id": sessions[0].id, "X-Split": "train", "X-Task-Id": "billing"}
        assert "task_id='billing'" in repr(sessions[0])
        answers = []
        for session in sessions:
            assert _ask(session, "refund my invoice") == "refund my invoice"
            recorded = session.get()
            assert recorded["task_key"] == "billing" and recorded["group_id"] is None
            answers.append(session.reward(1.0))
        assert all(a["trainable"] for a in answers) and answers[0]["group_id"] == answers[1]["group_id"]
        group = proxy.get_group(answers[0]["group_id"])
        assert group["origin"] == "live" and group["task_key"] == "billing" and group["closed"]
        assert sorted(s["id"] for s in group["sessions"]) == sorted(s.id for s in sessions)
        with pytest.raises(ValueError, match="task_id"):
            proxy.session(task_id="")

        async def asynchronously() -> dict:
            async with AsyncRLProxy(server.url) as client:
                session = client.session(task_id="support", split="val")
                assert session.headers()["X-Task-Id"] == "support"
                reply = await session.openai_client(max_retries=0).chat.completions.create(
                    model="fake-model", messages=[{"role": "user", "content": "where is my parcel"}]
                )
                assert reply.choices[0].message.content == "where is my parcel"
                return await session.get()

        recorded = asyncio.run(asynchronously())
        assert recorded["task_key"] == "support" and recorded["split"] == "val"


def test_discard_by_hand_and_its_errors(proxy, gateway):
    server, services = gateway
    with pytest.raises(NotFoundError) as info:
        proxy.session().discard("never called")
    assert info.value.status_code == 404 and "failed before its first call" in info.value.message

    with proxy.group() as group:
        result = group.run(lambda s: _ask(s, f"attempt {s.index}") and float(s.index), n=2)
    session = result.sessions[0]
    body = httpx.post(f"{server.url}/v1/sessions/{session.id}/discard", json={"reason": 3}).json()
    assert body["error"]["type"] == "invalid_request_error" and "reason" in body["error"]["message"]

    services.store.insert_step("sdk-discard", 1, "/ckpt/0001", {}, [group.id])  # as the trainer would
    with pytest.raises(ConflictError) as info:
        session.discard("too late")
    assert info.value.status_code == 409 and "already trained (step 1)" in info.value.message
    assert not session.discarded and session.get()["discarded"] is False

    other = proxy.session()
    _ask(other, "no group")
    assert other.discard()["discarded"] is True  # no body, no reason: fine too
    assert other.get()["discard_reason"] is None


# ---------------------------------------------------------------- typed errors


def test_gateway_errors_are_typed_and_carry_its_message(proxy, gateway):
    with pytest.raises(NotFoundError) as info:
        proxy.session().reward(1.0)
    error = info.value
    assert error.status_code == 404 and error.type == "not_found_error"
    assert "post a reward after the session's first chat completion" in error.message
    assert isinstance(error, RLProxyAPIError)

    with pytest.raises(NotFoundError):
        proxy.group("never-used").close()
    session = proxy.session()
    _ask(session, "so it exists")
    with pytest.raises(BadRequestError) as info:
        proxy.reward(session.id, 1.0, metrics={"turns": "many"})  # type: ignore[dict-item]
    assert info.value.status_code == 400 and "turns" in info.value.message


def test_a_reward_the_gateway_refused_while_its_store_was_read_only_lands_once_it_recovers(proxy, gateway):
    """The gateway answers 503 "not acknowledged" and recovers by itself: the SDK sends the reward
    again after a wait (tests/test_sdk_retries.py has the rules), rather than failing the rollout."""
    store = gateway[1].store
    session = proxy.session()
    _ask(session, "scored while the disk is read-only")

    def read_only(on: bool) -> None:  # as tests/test_store_failures.py makes a read-only store
        for conn in (store._conn, store._loop_conn):
            conn.execute(f"PRAGMA query_only = {'ON' if on else 'OFF'}")

    waits: list[float] = []

    def wait_while_the_operator_fixes_it(seconds: float) -> None:
        waits.append(seconds)
        read_only(False)

    proxy._sleep = wait_while_the_operator_fixes_it
    read_only(True)
    try:
        answer = session.reward(0.75)
    finally:
        read_only(False)
    assert answer["reward"] == 0.75 and len(waits) == 1
    assert session.get()["reward"] == 0.75


def test_a_reward_and_metrics_computed_with_numpy_are_posted(proxy):
    np = pytest.importorskip("numpy")
    session = proxy.session()
    _ask(session, "scored with numpy")
    answer = session.reward(np.float32(0.5), metrics={"steps": np.int64(3), "score": np.float32(0.25), "ok": 1})
    assert answer["reward"] == 0.5 and answer["metrics"] == {"steps": 3.0, "score": 0.25, "ok": 1.0}


def test_a_reward_json_cannot_carry_is_named_and_a_string_is_left_to_the_gateway(proxy):
    """NaN failed as httpx's "Out of range float values are not JSON compliant" (which value?),
    and "0.5" was float()ed into a reward the gateway refuses as a client's bug."""
    session = proxy.session()
    _ask(session, "scored badly")
    with pytest.raises(ValueError, match=r"^reward is nan: a reward and its metrics must be finite numbers"):
        session.reward(float("nan"))
    with pytest.raises(ValueError, match=r"^metrics\['loss'\] is -inf: "):
        session.reward(0.5, metrics={"steps": 3, "loss": float("-inf")})
    with pytest.raises(BadRequestError) as info:
        session.reward("0.5")  # type: ignore[arg-type]
    assert info.value.param == "reward"
    assert session.get()["reward"] is None  # none of them was recorded
    assert session.reward(True)["reward"] == 1.0  # a bool still counts as 0 or 1


def test_an_id_names_only_itself_never_another_session_or_route(proxy):
    """Ids come from the agent's world (a ticket number, a user's name): one holding `#`, `?`
    or `/` reaches the gateway whole, or is refused, and never reads or writes something else."""
    group = proxy.group()  # left open: the `..` id below must not close it
    session = group.run(lambda s: _ask(s, f"attempt {s.index}") and None, n=1).sessions[0]

    with pytest.raises(BadRequestError) as info:  # not session `session.id`'s trajectory
        proxy.get_session(f"{session.id}#2")
    assert info.value.param == "session_id" and f"'{session.id}#2' is not valid" in info.value.message
    with pytest.raises(BadRequestError):
        proxy.reward(f"{session.id}?page=2", 1.0)
    with pytest.raises(BadRequestError):
        proxy.get_group(f"{group.id} ")
    with pytest.raises(ValueError, match="session_id '../groups/"):  # would close the group
        proxy.discard(f"../groups/{group.id}/close?")
    with pytest.raises(ValueError, match="group_id 'a/b' is not valid"):
        proxy.close_group("a/b")

    assert proxy.get_group(group.id)["closed"] is False
    assert session.get()["discarded"] is False and session.get()["reward"] is None
    group.close()


def test_a_failed_judgement_is_a_server_error(proxy, judge_port):
    with proxy.group() as group:
        group.run(lambda s: _ask(s, f"attempt {s.index}") and None, n=2)
        with FakeJudge(answers=["nope", "still nope"], port=judge_port) as judge:
            with pytest.raises(ServerError) as info:
                group.ruler("openai/judge", judge_api_base=judge.url)
        assert info.value.status_code == 502 and info.value.type == "judge_error"
        assert "answered wrongly twice" in info.value.message
        assert group.get()["ruler_status"] == "failed"
        group.closed = True  # leave it open; nothing to close on exit


def test_wrong_key_and_no_gateway(upstream, tmp_path):
    with openai_gateway(upstream.url, tmp_path, api_key="sk-gateway-key-1234") as (server, _):
        with RLProxy(server.url, api_key="sk-wrong") as client:
            with pytest.raises(AuthenticationError) as info:
                client.get_group("anything")
            assert info.value.status_code == 401
        with RLProxy(server.url, api_key="sk-gateway-key-1234") as client:
            with pytest.raises(NotFoundError):
                client.get_group("anything")
            session = client.session()
            assert _ask(session, "with a key") == "with a key"
    with RLProxy(f"http://127.0.0.1:{free_port()}") as client:
        with pytest.raises(APIConnectionError):
            client.get_group("anything")


def test_a_gateway_too_slow_to_answer_is_not_one_that_could_not_be_reached():
    # It said "could not reach the gateway at ...: timed out", of a reward the gateway may have stored.
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    with RLProxy(
        "http://gateway.example", timeout=2.5, http_client=httpx.Client(transport=httpx.MockTransport(slow))
    ) as p:
        with pytest.raises(APIConnectionError) as info:
            p.reward("sess-1", 1.0)
    message = str(info.value)
    assert message.startswith("POST http://gateway.example/v1/sessions/sess-1/reward: no answer within 2.5 s")
    assert "may still have taken effect" in message and "could not reach" not in message

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    with RLProxy("http://gateway.example", http_client=httpx.Client(transport=httpx.MockTransport(refused))) as p:
        with pytest.raises(APIConnectionError, match=r"could not reach the gateway at http://gateway.example/v1 "):
            p.get_group("grp-1")


def test_a_server_that_is_not_the_gateway_is_named_in_the_error():
    # A login proxy's page, or another server at that URL: it was a bare JSONDecodeError.
    def login_page(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, html="<html><form>Sign in</form></html>")

    base = "http://gateway.example/v1"
    with RLProxy(base, http_client=httpx.Client(transport=httpx.MockTransport(login_page))) as client:
        with pytest.raises(RLProxyAPIError) as info:
            client.reward("sess-1", 1.0)
    message = str(info.value)
    assert "POST http://gateway.example/v1/sessions/sess-1/reward answered 200 with text/html" in message
    assert f"check that {base} (base_url, or $RLPROXY_URL) is the URL of an rlproxy gateway" in message
    assert info.value.type == "invalid_response" and "Sign in" in info.value.body

    async def asynchronously() -> None:
        http = httpx.AsyncClient(transport=httpx.MockTransport(login_page))
        async with AsyncRLProxy(base, http_client=http) as client:
            with pytest.raises(RLProxyAPIError, match="is the URL of an rlproxy gateway"):
                await client.get_group("grp-1")
        await http.aclose()

    asyncio.run(asynchronously())


def test_a_password_in_the_base_url_is_used_but_never_shown():
    """A reverse proxy's basic auth in the URL (`https://user:pass@host/v1`): repr and every
    error message (the retry log lines too) printed the password."""
    seen: list[str | None] = []

    def login_page(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, html="<html>Sign in</html>")

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    url = "http://bob:hunter2-pass@gateway.example/v1"
    texts = []
    for answer in (login_page, slow, refused):
        with RLProxy(url, max_retries=0, http_client=httpx.Client(transport=httpx.MockTransport(answer))) as p:
            texts.append(repr(p))
            with pytest.raises(sdk.RLProxySDKError) as info:
                p.get_group("grp-1")
            texts.append(str(info.value))
    assert seen == ["Basic " + base64.b64encode(b"bob:hunter2-pass").decode()]  # still sent
    assert all("hunter2" not in text and "bob" not in text for text in texts), texts
    assert "GET http://***@gateway.example/v1/groups/grp-1 answered 200" in texts[1]


# ---------------------------------------------------------------- asyncio flows


async def test_async_group_run_then_ruler(gateway, judge_port):
    server, _ = gateway

    async def rollout(session):
        client = session.openai_client(max_retries=0)
        reply = await client.chat.completions.create(
            model="fake-model",
            messages=[
                {"role": "user", "content": "same task"},
                {"role": "user", "content": f"attempt {session.index % 2}"},
            ],
        )
        assert reply.choices[0].message.content.startswith("attempt")
        return None  # RULER scores it

    with FakeJudge(port=judge_port) as judge:
        async with AsyncRLProxy(server.url) as client:
            async with client.group() as group:
                result = await group.run(rollout, n=4, concurrency=4)
                assert result.n_failed == 0
                scores = await group.ruler("openai/judge", judge_api_base=judge.url)
            assert group.closed
            assert sorted(s.session_id for s in scores) == sorted(s.id for s in result.sessions)
            assert {s.score for s in scores} == {1.0, 0.5}  # two distinct attempts, judged once each
            state = await client.get_group(group.id)
    assert len(judge.requests) == 1
    assert state["ready"] and state["ruler_status"] == "scored"


async def test_async_failures_and_typed_errors(gateway):
    server, _ = gateway
    async with AsyncRLProxy(server.url + "/v1/") as client:

        async def rollout(session):
            if session.index == 0:
                raise RuntimeError("flaky tool")
            async with session:
                reply = await session.openai_client(max_retries=0).chat.completions.create(
                    model="fake-model", messages=[{"role": "user", "content": "ok"}]
                )
            return 1.0 if reply.choices[0].message.content == "ok" else 0.0

        async with client.group() as group:
            result = await group.run(rollout, n=3, max_exceptions=1)
        assert result.n_failed == 1 and result.rewards == [1.0, 1.0]
        assert result.discarded == []  # it failed before its first call: nothing to discard
        assert (await client.get_group(group.id))["ready"]

        async def fails_after_a_call(session):
            await session.openai_client(max_retries=0).chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": f"try {session.index}"}]
            )
            if session.index == 1:
                raise RuntimeError("parser broke")
            return float(session.index)

        async with client.group() as group:
            result = await group.run(fails_after_a_call, n=3, max_exceptions=1)
        assert [s.index for s in result.discarded] == [1]
        state = await client.get_group(group.id)
        assert state["ready"] and state["n_sessions"] == 2 and state["n_discarded"] == 1
        assert (await result.discarded[0].get())["discard_reason"] == "rollout raised RuntimeError: parser broke"

        async def always_fails(session):
            await asyncio.sleep(0)
            raise RuntimeError("down")

        with pytest.raises(RolloutsFailed):
            await client.group().run(always_fails, n=3, max_exceptions=0)
        with pytest.raises(NotFoundError) as info:
            await client.session().reward(1.0)
        assert info.value.status_code == 404


def test_public_api_is_exported():
    for name in (
        "RLProxy",
        "AsyncRLProxy",
        "Session",
        "AsyncSession",
        "Group",
        "AsyncGroup",
        "RunResult",
        "RLProxyAPIError",
        "NotFoundError",
        "BadRequestError",
        "AuthenticationError",
        "ServerError",
        "RateLimitError",
        "RequestTooLargeError",
        "APITimeoutError",
    ):
        assert hasattr(sdk, name) and name in sdk.__all__, name
    assert json.dumps(sdk.__all__)


def test_the_sdk_waits_for_a_judgement_as_long_as_the_gateway_may_take():
    """A judge call may take JUDGE_TIMEOUT and a bad answer gets one retry: an SDK that gave up
    sooner would report a failure for a judgement that still lands (and a repeat gets a 409)."""
    from gateway.ruler.judges import JUDGE_TIMEOUT
    from sdk.client import RULER_TIMEOUT

    assert RULER_TIMEOUT > 2 * JUDGE_TIMEOUT
