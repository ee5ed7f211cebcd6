"""No web page can drive the gateway, with a key or without: a page on another origin, in a
real headless Chromium, posts `text/plain`, `no-cors` and bodiless requests to every writing
route and every base-URL prefix of a keyless gateway (the default) and changes nothing; a
name that is not loopback (DNS rebinding) is refused; writes must be JSON."""

from __future__ import annotations

import contextlib

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import HTMLResponse
from starlette.routing import Route

from gateway.app import create_app
from gateway.settings import Settings
from tests.browser import find_or_install_chromium
from tests.helpers import ThreadServer
from tests.helpers_judge import FakeJudge
from tests.helpers_upstream import openai_gateway

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "from the web page"}]}
KEY = "sk-browser-test-" + "0f3a9c2d7e61"


class Seen:
    """The gateway's app, wrapped to note every request that reached it and its status."""

    def __init__(self, app):
        self.app = app
        self.state = app.state
        self.requests: list[tuple[str, str, int]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def noting(message):
            if message["type"] == "http.response.start":
                self.requests.append((scope["method"], scope["path"], message["status"]))
            await send(message)

        await self.app(scope, receive, noting)


@contextlib.contextmanager
def victim(upstream_url: str, tmp_path, judge: FakeJudge, **settings):
    """A keyless gateway holding one group (`victim-g`: two sessions, no reward, open) and a
    RULER judge it is allowed to call."""
    app = Seen(
        create_app(
            Settings(
                engine="openai",
                upstream_url=upstream_url,
                state_dir=tmp_path / "state",
                trainer="off",
                judge_model=["judge"],
                judge_api_base=[judge.url],
                **settings,
            )
        )
    )
    with ThreadServer(app) as server:
        for session in ("victim-a", "victim-b"):
            headers = {"X-Session-Id": session, "X-Group-Id": "victim-g"}
            assert httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=headers).status_code == 200
        yield server, app


ATTACK = """async ({gateway, writes}) => {
  for (const [path, body] of writes) {
    // Each is a "simple" request: the browser sends it without asking the server first.
    for (const init of [
      {method: "POST", mode: "no-cors", headers: {"content-type": "text/plain"}, body},
      {method: "POST", mode: "no-cors"},
      {method: "POST", headers: {"content-type": "application/x-www-form-urlencoded"}, body: "a=1"},
    ]) {
      try { await fetch(gateway + path, init); } catch (e) { /* an unreadable answer throws; it was sent */ }
    }
  }
  return true;
}"""


def writes(judge_url: str) -> list[tuple[str, str]]:
    import json

    chat = json.dumps(CHAT)
    return [
        ("/v1/chat/completions", chat),
        ("/sessions/web-s1/v1/chat/completions", chat),
        ("/sessions/web-s2/chat/completions", chat),
        ("/groups/web-g/sessions/web-s3/v1/chat/completions", chat),
        ("/tasks/web-t/sessions/web-s4/v1/chat/completions", chat),
        ("/sessions/web-s5/v1/responses", json.dumps({"model": "fake-model", "input": "hi"})),
        ("/sessions/web-s6/v1/messages", json.dumps({"model": "fake-model", "max_tokens": 8, **CHAT})),
        ("/sessions/web-s7/v1/completions", json.dumps({"model": "fake-model", "prompt": "hi"})),
        ("/v1/sessions/victim-a/reward", json.dumps({"reward": 1.0})),
        ("/v1/sessions/victim-b/discard", "{}"),
        ("/v1/groups/victim-g/close", "{}"),
        ("/v1/training/trigger", "{}"),
        ("/v1/groups/victim-g/ruler", json.dumps({"judge_model": "judge", "judge_api_base": judge_url})),
    ]


@pytest.fixture(scope="module")
def browser():
    path, why = find_or_install_chromium()
    if path is None:
        pytest.skip(why)
    from playwright import sync_api

    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=path, args=["--no-sandbox", "--disable-gpu"])
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def attacker_site():
    """A page on another loopback origin (localhost, another port) than the gateway's (127.0.0.1)."""
    page = Starlette(routes=[Route("/", lambda request: HTMLResponse("<!doctype html><title>elsewhere</title>"))])
    with ThreadServer(page) as server:
        yield server.url.replace("127.0.0.1", "localhost") + "/"


def test_a_page_on_another_origin_changes_nothing(upstream, tmp_path, browser, attacker_site):
    with FakeJudge() as judge, victim(upstream.url, tmp_path, judge) as (server, app):
        store = app.state.services.store
        before = len(app.requests)
        page = browser.new_page()
        page.goto(attacker_site)
        assert page.evaluate(ATTACK, {"gateway": server.url, "writes": writes(judge.url)})
        page.close()

        reached = app.requests[before:]
        # Every request was sent and reached the gateway, so the checks below can fail.
        assert len(reached) == 3 * len(writes(judge.url)), reached
        listed = httpx.get(server.url + "/v1/sessions").json()["data"]
        assert sorted(s["id"] for s in listed) == ["victim-a", "victim-b"]
        assert all(s["reward"] is None for s in listed)
        group = httpx.get(server.url + "/v1/groups/victim-g").json()
        assert not group["closed"] and group["n_sessions"] == 2
        assert not httpx.get(server.url + "/v1/sessions/victim-b").json().get("discarded")
        assert store.consume_triggers(app.state.services.settings.model_name) is False
        assert judge.requests == []
        # Each was refused at the edge: a foreign Origin is a 403, whatever the route.
        assert {status for _, _, status in reached} == {403}, reached


def test_the_same_writes_with_json_and_no_origin_still_work(upstream, tmp_path):
    """The control: a program (no Origin) sending JSON does what the page could not."""
    with FakeJudge() as judge, victim(upstream.url, tmp_path, judge) as (server, app):
        assert httpx.post(server.url + "/v1/groups/victim-g/close", json={}).json()["closed"]
        assert httpx.post(server.url + "/v1/sessions/victim-a/reward", json={"reward": 1.0}).status_code == 200
        assert httpx.post(server.url + "/v1/training/trigger", json={}).status_code == 202
        assert app.state.services.store.consume_triggers(app.state.services.settings.model_name) is True


@pytest.mark.parametrize(
    "path",
    ["/v1/groups/g/close", "/v1/training/trigger", "/sessions/s/v1/chat/completions", "/v1/sessions/s/discard"],
)
def test_a_write_that_is_not_json_is_a_415(upstream, tmp_path, path):
    with openai_gateway(upstream.url, tmp_path / "state") as (server, _):
        bodiless = httpx.post(server.url + path)
        plain = httpx.post(server.url + path, content=b"{}", headers={"content-type": "text/plain"})
    for reply in (bodiless, plain):
        assert reply.status_code == 415, reply.text
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and "application/json" in error["message"]


def test_anthropic_routes_refuse_in_anthropics_shape(upstream, tmp_path):
    with openai_gateway(upstream.url, tmp_path / "state") as (server, _):
        reply = httpx.post(server.url + "/v1/messages", content=b"{}", headers={"content-type": "text/plain"})
        foreign = httpx.post(server.url + "/v1/messages", json={}, headers={"origin": "http://evil.example"})
    assert reply.status_code == 415 and reply.json()["type"] == "error", reply.text
    assert foreign.status_code == 403 and "evil.example" in foreign.json()["error"]["message"], foreign.text


def test_origins_the_gateway_allows(upstream, tmp_path):
    with openai_gateway(upstream.url, tmp_path / "state", cors_origin=["http://app.example:3000"]) as (server, _):
        own = server.url  # the dashboard's own pages post as the gateway's origin
        for origin, status in ((own, 200), ("http://app.example:3000", 200), ("http://other.example", 403)):
            reply = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers={"origin": origin})
            assert reply.status_code == status, (origin, reply.text)
        null = httpx.post(server.url + "/v1/groups/g/close", json={}, headers={"origin": "null"})
        assert null.status_code == 403  # a sandboxed frame or a file:// page


@pytest.mark.parametrize(
    "flag, value, says",
    [
        # Copied from the address bar: no page's Origin ends with '/', so every call of the page the
        # operator listed was a 403 saying it was not "listed with --cors-origin".
        ("--cors-origin", "https://app.example/", "a browser sends its origin as https://app.example (lowercase"),
        ("--cors-origin", "HTTPS://App.Example:443", "a browser sends its origin as https://app.example (lowercase"),
        ("--cors-origin", "app.example", "is not an origin: give it as a browser sends it, scheme://host[:port]"),
        ("--allowed-host", "https://rlproxy.example", "is not a host name: give the name clients reach the gateway by"),
    ],
)
def test_an_origin_or_host_no_request_could_match_is_refused_at_start(flag, value, says, tmp_path):
    # Read as `rlproxy serve` reads them (it prints the reason and exits 2).
    from gateway.cli import build_parser, settings_from_args

    with pytest.raises(ValueError) as refused:
        settings_from_args(build_parser().parse_args(["serve", "--state-dir", str(tmp_path), flag, value]))
    assert f"{flag} {value!r}" in str(refused.value) and says in str(refused.value)


def test_a_rebound_name_is_refused_without_a_key(upstream, tmp_path):
    rebound = {"host": "rebind.attacker.example"}
    with openai_gateway(upstream.url, tmp_path / "a") as (server, _):
        httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers={"X-Session-Id": "private"})
        read = httpx.get(server.url + "/v1/sessions", headers=rebound)
        chat = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=rebound)
        for loopback in ("localhost", f"127.0.0.1:{server.port}", f"[::1]:{server.port}", "app.localhost"):
            assert httpx.get(server.url + "/v1/sessions", headers={"host": loopback}).status_code == 200, loopback
    for reply in (read, chat):
        assert reply.status_code == 400, reply.text
        assert "--allowed-host" in reply.json()["error"]["message"] and "private" not in reply.text

    with openai_gateway(upstream.url, tmp_path / "b", allowed_host=["*.attacker.example"]) as (server, _):
        assert httpx.get(server.url + "/v1/sessions", headers=rebound).status_code == 200
        assert httpx.get(server.url + "/v1/sessions", headers={"host": "evil.example"}).status_code == 400


def test_with_a_key_host_is_checked_only_when_allowed_hosts_are_given(upstream, tmp_path):
    auth = {"Authorization": f"Bearer {KEY}", "host": "gateway.internal:8000"}
    with openai_gateway(upstream.url, tmp_path / "a", api_key=KEY) as (server, _):
        assert httpx.get(server.url + "/v1/sessions", headers=auth).status_code == 200  # behind a balancer
    with openai_gateway(upstream.url, tmp_path / "b", api_key=KEY, allowed_host=["rlproxy.example"]) as (server, _):
        assert httpx.get(server.url + "/v1/sessions", headers=auth).status_code == 400
        listed = {**auth, "host": "rlproxy.example"}
        assert httpx.get(server.url + "/v1/sessions", headers=listed).status_code == 200
