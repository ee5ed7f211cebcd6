"""Security review, as tests: the bearer key is compared in constant time and never stored,
logged, exported or echoed; ids and names from requests never become paths; listening beyond
loopback without a key is refused unless asked for on purpose; CORS is off unless asked for."""

from __future__ import annotations

import logging
import os
from urllib.parse import quote

import httpx
import pytest

from gateway.app import create_app
from gateway.errors import ConfigError, InvalidRequest
from gateway.export.model import parse_model_ref
from gateway.export.records import export_trajectories
from gateway.http import middleware
from gateway.settings import Settings
from gateway.store.sqlite import SQLiteStore
from tests.helpers import ThreadServer
from tests.helpers_upstream import openai_gateway, raw_store_bytes
from tests.helpers_vllm import attached_engine, fake_vllm_thread, vllm_settings

KEY = "sk-gateway-" + "5be1c0ffee-do-not-leak"
WRONG = "sk-wrong-" + "77aa-also-never-echoed"
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}


def test_bearer_key_is_compared_in_constant_time(upstream, tmp_path, monkeypatch):
    compared = []
    real = middleware.hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", spy)
    with openai_gateway(upstream.url, tmp_path, api_key=KEY) as (server, _):
        for path in ("/v1/chat/completions", "/v1/sessions/s1/reward"):
            reply = httpx.post(server.url + path, json=CHAT, headers={"Authorization": f"Bearer {WRONG}"})
            assert reply.status_code == 401
    # every candidate (the Authorization header, and x-api-key as Anthropic's clients send it)
    # goes through compare_digest against the key, never through ==
    assert compared and {b for _, b in compared} == {f"Bearer {KEY}".encode(), KEY.encode()}
    assert (f"Bearer {WRONG}".encode(), f"Bearer {KEY}".encode()) in compared


def test_head_needs_the_key_where_get_does(upstream, tmp_path):
    with openai_gateway(upstream.url, tmp_path, api_key=KEY) as (server, _):
        assert httpx.head(server.url + "/healthz").status_code == 200  # open, as for GET
        assert httpx.head(server.url + "/v1/models").status_code == 401
        assert httpx.head(server.url + "/v1/models", headers={"Authorization": f"Bearer {WRONG}"}).status_code == 401
        assert httpx.head(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_no_key_in_store_logs_exports_or_error_messages(upstream, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    state = tmp_path / "state"
    with openai_gateway(
        upstream.url, state, api_key=KEY, upstream_api_key="sk-upstream-" + "1d2e3f-secret", log_level="debug"
    ) as (server, services):
        good = {"Authorization": f"Bearer {KEY}", "X-Session-Id": "sec-1", "X-Group-Id": "sec-g"}
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=good).status_code == 200
        assert httpx.post(server.url + "/v1/sessions/sec-1/reward", json={"reward": 1}, headers=good).status_code == 200
        answers = [
            httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {WRONG}"}),
            httpx.post(
                server.url + "/v1/chat/completions", json={"model": "fake-model", "messages": "x"}, headers=good
            ),
            httpx.get(server.url + "/v1/sessions/nope", headers=good),
            httpx.get(server.url + "/metrics", headers=good),
            httpx.get(server.url + "/healthz"),
            httpx.get(server.url + "/openapi.json", headers=good),
        ]
        exported = tmp_path / "export.jsonl"
        export_trajectories(services.settings.db_path, str(exported))
    secrets = (KEY, WRONG, "sk-upstream-1d2e3f-secret")
    places = {
        "store": raw_store_bytes(state).decode("latin-1"),
        "logs": caplog.text + "\n".join(repr(r.args) for r in caplog.records),
        "export": exported.read_text(),
        "answers": "\n".join(a.text + repr(a.headers) for a in answers),
        "settings": repr(services.settings.public_dict()),
    }
    assert "sec-1" in places["export"]  # the export did write the session
    for where, text in places.items():
        for secret in secrets:
            assert secret not in text, f"a key is in the {where}"


@pytest.mark.parametrize(
    "name", ["../../etc/passwd", "agent@../../../tmp/x", "agent@1/../../x", "/etc/passwd", "agent@0001", "agent@-1"]
)
def test_model_names_from_requests_never_become_paths(tmp_path, name):
    with fake_vllm_thread() as (fake_server, fake):
        settings = vllm_settings(tmp_path, vllm_url=fake_server.url + "/v1")
        app = create_app(settings, engine=attached_engine(fake_server.url), store=SQLiteStore(settings.db_path))
        with ThreadServer(app) as server:
            reply = httpx.post(
                server.url + "/v1/chat/completions",
                timeout=30,
                json={"model": name, "messages": [{"role": "user", "content": "hi"}]},
            )
            assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
            # nothing loaded, nothing asked (the chats at start-up are the engine's logprobs-mode probe, on the base)
            assert not [e for e in fake.events if e["kind"] == "load"]
            assert all(e["model"] == settings.base_model for e in fake.events if e["kind"] == "chat")
    assert not (tmp_path / "tmp").exists() and not (tmp_path / "x").exists()


@pytest.mark.parametrize("session", ["../../x", "a/b", "..", ".hidden", "x" * 200, "a\\b"])
def test_session_and_group_ids_are_checked_before_use(upstream, tmp_path, session):
    with openai_gateway(upstream.url, tmp_path / "state") as (server, _):
        for headers in ({"X-Session-Id": session}, {"X-Group-Id": session}):
            reply = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=headers)
            assert reply.status_code == 400 and "not valid" in reply.json()["error"]["message"]
        reply = httpx.post(server.url + "/v1/sessions/" + quote(session, safe="") + "/reward", json={"reward": 1.0})
        assert reply.status_code in (400, 404)
    assert sorted(os.listdir(tmp_path)) == ["state"]


@pytest.mark.parametrize("where", ["metadata", "base url"])
def test_an_id_ending_in_a_line_break_is_refused(upstream, tmp_path, where):
    # `$` matches before a final "\n": ids are matched whole, so "nl-1\n" never reaches the
    # upstream, the store or the X-Session-Id header of the answer.
    with openai_gateway(upstream.url, tmp_path / "state") as (server, _):
        if where == "metadata":
            reply = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "metadata": {"session_id": "nl-1\n"}})
        else:
            reply = httpx.post(server.url + "/sessions/nl-1%0A/v1/chat/completions", json=CHAT)
        assert reply.status_code == 400 and "not valid" in reply.json()["error"]["message"]
        reward = httpx.post(server.url + "/v1/sessions/nl-1%0A/reward", json={"reward": 1.0})
        assert reward.status_code == 400 and "not valid" in reward.json()["error"]["message"]
        assert httpx.get(server.url + "/v1/sessions").json()["data"] == []


def test_a_model_name_ending_in_a_line_break_is_refused_by_export():
    for ref in ("tiny\n", "tiny\n@1"):
        with pytest.raises(InvalidRequest, match="is not a model name"):
            parse_model_ref(ref)
    with pytest.raises(InvalidRequest, match="must be a number"):  # `str.isdigit` takes it, `int` does not
        parse_model_ref("tiny@²")


def test_listening_beyond_loopback_without_a_key_is_refused_unless_said_on_purpose(caplog, tmp_path):
    # The Host check stops browsers, not a client that sends `Host: localhost`: beyond loopback
    # a keyless gateway serves anyone, so it starts only with --insecure-no-api-key, warned about.
    class Engine:  # never started: create_app only wires it
        kind, supports_adapters = "openai", False

    caplog.set_level(logging.WARNING, logger="rlproxy")
    outcomes = []
    for case, (host, key, on_purpose) in enumerate(
        (
            ("0.0.0.0", None, False),
            ("::", None, False),
            ("10.1.2.3", None, False),
            ("0.0.0.0", None, True),
            ("0.0.0.0", KEY, False),
            ("127.0.0.1", None, False),
            ("localhost", None, False),
            ("::1", None, False),
        )
    ):
        caplog.clear()
        settings = Settings(
            engine="openai", host=host, api_key=key, insecure_no_api_key=on_purpose, state_dir=tmp_path / str(case)
        )
        try:
            create_app(settings, engine=Engine(), store=SQLiteStore(memory=True))
        except ConfigError as refused:
            assert "--api-key" in str(refused) and "--insecure-no-api-key" in str(refused)
            outcomes.append("refused")
            continue
        warned = any("no API key" in r.getMessage() for r in caplog.records)
        outcomes.append("warned" if warned else "started")
    assert outcomes == ["refused", "refused", "refused", "warned", "started", "started", "started", "started"]
    assert sorted(os.listdir(tmp_path)) == ["3", "4", "5", "6", "7"]  # refused before the state dir is made


def test_an_empty_host_is_every_interface_and_needs_a_key_as_0_0_0_0_does(tmp_path):
    # `--host ''` (an empty RLPROXY_HOST= in a compose file) was taken for loopback, uvicorn's
    # reading of it; but the gateway binds its socket itself, and bind("") takes every interface:
    # it served anyone who could reach the port, with no key and no word.
    from gateway.http.listen import listen

    with listen("", 0) as sock:
        assert sock.getsockname()[0] == "0.0.0.0"

    class Engine:  # never started: create_app only wires it
        kind, supports_adapters = "openai", False

    with pytest.raises(ConfigError) as refused:
        create_app(
            Settings(engine="openai", host="", state_dir=tmp_path), engine=Engine(), store=SQLiteStore(memory=True)
        )
    assert "refusing to start: listening on every interface (--host empty) with no API key" in str(refused.value)


def test_serve_says_why_it_refuses_to_listen_beyond_loopback_without_a_key(tmp_path):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RLPROXY_API_KEY"}
    args = ["serve", "--host", "0.0.0.0", "--port", "0", "--state-dir", str(tmp_path), "--trainer", "off"]
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode != 0
    assert "refusing to start" in done.stderr and "--insecure-no-api-key" in done.stderr
    assert "Traceback" not in done.stderr


def test_cors_is_off_unless_asked_for(upstream, tmp_path):
    preflight = {
        "Origin": "http://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization",
    }
    with openai_gateway(upstream.url, tmp_path / "off") as (server, _):
        answer = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
        assert "access-control-allow-origin" not in answer.headers
        answer = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers={"Origin": "http://app.example"})
        # Not only unreadable: a page on another origin is refused before the call runs (issue 37).
        assert answer.status_code == 403 and "access-control-allow-origin" not in answer.headers

    with openai_gateway(
        upstream.url, tmp_path / "on", api_key=KEY, cors_origin=["http://app.example", "http://other.example"]
    ) as (server, _):
        for path in ("/v1/chat/completions", "/v1/sessions/s/reward"):
            answer = httpx.options(server.url + path, headers=preflight)
            assert answer.status_code == 200  # a preflight carries no key, and needs none
            assert answer.headers["access-control-allow-origin"] == "http://app.example"
        answer = httpx.post(
            server.url + "/v1/chat/completions",
            json=CHAT,
            headers={"Origin": "http://app.example", "Authorization": f"Bearer {KEY}"},
        )
        assert answer.status_code == 200
        assert answer.headers["access-control-allow-origin"] == "http://app.example"
        assert "x-session-id" in answer.headers["access-control-expose-headers"].lower()
        denied = httpx.options(
            server.url + "/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"}
        )
        assert denied.headers.get("access-control-allow-origin") != "http://evil.example"
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 401  # still needs the key


def test_no_key_in_traces(monkeypatch, upstream, tmp_path):
    from tests.test_tracing import _env, _Receiver

    received = _Receiver()
    with ThreadServer(received.app) as receiver_server:
        _env(monkeypatch, receiver_server.url)
        with openai_gateway(upstream.url, tmp_path, api_key=KEY) as (server, services):
            assert services.tracer is not None
            good = {"Authorization": f"Bearer {KEY}", "X-Session-Id": "trace-sec"}
            assert httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=good).status_code == 200
            assert (
                httpx.post(server.url + "/v1/sessions/trace-sec/reward", json={"reward": 0.5}, headers=good).status_code
                == 200
            )
            received.wait_for(lambda: received.generations("trace-sec") and received.scores)
    sent = repr(received.spans) + repr(received.scores) + repr(received.paths)
    assert "trace-sec" in sent and KEY not in sent
    assert not any(KEY in auth for auth in received.auth)
