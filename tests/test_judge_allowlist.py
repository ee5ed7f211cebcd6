"""RULER calls only the judges the operator named (issue 37, item 2): a request naming another
base URL or model is refused before anything is sent, the judge key goes to a configured base
only, and a judge's reply never comes back to the client or the dashboard."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from pydantic import ValidationError

from gateway.settings import Settings
from sdk import BadRequestError, RLProxy
from tests.helpers_upstream import openai_gateway

JUDGE_KEY = "sk-judge-" + "allowlist-9c41e2-never-echo"
PROVIDER_KEY = "sk-provider-" + "allowlist-5b07aa-stays-home"
MARKER = "INTERNAL-PAGE-" + "d41d8cd98f"  # what the stand-in's reply says: must never come back


class StandIn:
    """A loopback server that records every request it gets and answers each with a 500 that
    quotes a marker and the bearer it was sent (an internal page, or a judge that echoes)."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length") or 0))
                stand_in.requests.append({"path": self.path, "authorization": self.headers.get("authorization")})
                body = json.dumps({"error": {"message": f"{MARKER}: you sent {self.headers.get('authorization')}"}})
                self.send_response(500)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            do_GET = do_POST

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def stand_in() -> Iterator[StandIn]:
    with StandIn() as server:
        yield server


@pytest.fixture(scope="module")
def gateway(upstream, stand_in, tmp_path_factory):
    """Started with one judge allowed: `openai/judge` at the stand-in's /v1."""
    judges = {"judge_model": ["openai/judge"], "judge_api_base": [stand_in.url + "/v1"]}
    with openai_gateway(upstream.url, tmp_path_factory.mktemp("allowlist-state"), **judges) as (server, _):
        for index in range(2):
            headers = {"X-Session-Id": f"al-{index}", "X-Group-Id": "g-al"}
            body = {"model": "fake-model", "messages": [{"role": "user", "content": f"attempt {index}"}]}
            httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers).raise_for_status()
        yield server


@pytest.fixture
def keys(monkeypatch, stand_in):
    monkeypatch.setenv("RLPROXY_JUDGE_API_KEY", JUDGE_KEY)
    monkeypatch.setenv("OPENAI_API_KEY", PROVIDER_KEY)
    # Where litellm would send `ollama/...` and `openai/...` without a base: the stand-in, to see it.
    monkeypatch.setenv("OLLAMA_API_BASE", stand_in.url)
    monkeypatch.setenv("OPENAI_BASE_URL", stand_in.url + "/v1")
    stand_in.requests.clear()


def _ruler(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/groups/g-al/ruler", json=body, timeout=120)


@pytest.mark.parametrize("path", ["/internal?", "/v1?", "/v1/../internal", "/other/v1", ""])
def test_a_judge_api_base_the_operator_did_not_name_is_refused_and_nothing_is_sent(gateway, stand_in, keys, path):
    response = _ruler(gateway, judge_model="openai/judge", judge_api_base=stand_in.url + path)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "judge_api_base"
    assert "--judge-api-base" in error["message"]
    assert stand_in.requests == []
    assert httpx.get(f"{gateway.url}/v1/groups/g-al").json()["ruler_status"] != "failed"


@pytest.mark.parametrize(
    "body",
    [
        {"judge_model": "ollama/x"},  # litellm: a local Ollama (here: the stand-in)
        {"judge_model": "openai/x"},  # litellm: OpenAI with OPENAI_API_KEY (here: the stand-in)
        {"judge_model": "ollama/x", "judge_api_base": "http://127.0.0.1:1/v1"},
    ],
)
def test_a_judge_model_the_operator_did_not_name_is_refused_and_nothing_is_sent(gateway, stand_in, keys, body):
    response = _ruler(gateway, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "judge_model" and f"--judge-model {body['judge_model']}" in error["message"]
    assert stand_in.requests == []


def test_the_sdk_raises_bad_request_for_a_judge_the_operator_did_not_name(gateway, stand_in, keys):
    with RLProxy(gateway.url + "/v1") as proxy, pytest.raises(BadRequestError) as info:
        proxy.group("g-al").ruler("openai/x")
    assert info.value.status_code == 400 and "--judge-model openai/x" in info.value.message
    assert stand_in.requests == []


def test_a_failing_judge_answers_a_short_error_without_its_reply(gateway, stand_in, keys, caplog):
    response = _ruler(gateway, judge_model="openai/judge", judge_api_base=stand_in.url + "/v1")
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["type"] == "judge_error" and "the judge 'openai/judge' failed" in error["message"]
    assert MARKER not in response.text and JUDGE_KEY not in response.text
    # The configured base got the judge key, never the provider's.
    assert stand_in.requests and {r["authorization"] for r in stand_in.requests} == {f"Bearer {JUDGE_KEY}"}

    group = httpx.get(f"{gateway.url}/v1/groups/g-al").json()
    assert group["ruler_status"] == "failed"
    assert MARKER not in group["ruler_error"] and JUDGE_KEY not in group["ruler_error"]
    assert MARKER in caplog.text and JUDGE_KEY not in caplog.text  # the whole reply is logged, the key is not


def test_a_judge_api_base_that_is_not_a_url_is_refused_at_start():
    with pytest.raises(ValidationError, match="--judge-api-base must start with http:// or https://"):
        Settings(judge_api_base=["127.0.0.1:8001/v1"])
