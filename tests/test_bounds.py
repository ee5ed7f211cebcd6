"""Every input is bounded: a legacy completions prompt list (prompts x `n` within `--max-n`, and
no more engine calls once its client left), a reward's metrics (how many, how long a name), a
RULER rubric, and a list cursor that is not one the gateway returned (400, never a 500)."""

from __future__ import annotations

import base64
import time

import httpx
import pytest

from gateway.protocols.chat import MAX_METRIC_NAME_CHARS, MAX_METRICS, MAX_RUBRIC_CHARS
from tests.helpers_upstream import openai_gateway, send_and_leave


@pytest.fixture(scope="module")
def gateway(upstream, tmp_path_factory):
    with openai_gateway(upstream.url, tmp_path_factory.mktemp("bounds")) as (server, services):
        yield httpx.Client(base_url=server.url, timeout=30), services.store


def _chat(http: httpx.Client, session: str, group: str | None = None) -> None:
    headers = {"X-Session-Id": session, **({"X-Group-Id": group} if group else {})}
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}
    assert http.post("/v1/chat/completions", json=body, headers=headers).status_code == 200


def _reached(upstream, marker: str) -> int:
    """How many engine calls carrying `marker` reached the upstream."""
    return sum(marker in str(r.body) for r in upstream.chat_requests())


# ---------------------------------------------------------------- legacy completions


def test_a_prompt_list_over_max_n_choices_is_refused_before_any_engine_call(gateway, upstream):
    """`--max-n` is 128: 129 prompts, or 3 prompts of 50 choices, are refused; 2 of 64 are answered."""
    http, store = gateway
    for prompts, n in [(129, 1), (3, 50)]:
        marker = f"list-{prompts}x{n}"
        reply = http.post(
            "/v1/completions",
            json={"model": "fake-model", "prompt": [f"{marker} p"] * prompts, "n": n, "max_tokens": 4},
            headers={"X-Session-Id": marker},
        )
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["code"] == "too_many_prompts" and error["param"] == "prompt"
        assert f"{prompts * n} choices" in error["message"] and "limit of 128" in error["message"]
        assert "--max-n" in error["message"]
        assert store.session_calls(marker) == []
        assert _reached(upstream, marker) == 0
    reply = http.post(
        "/v1/completions",
        json={"model": "fake-model", "prompt": ["within a", "within b"], "n": 64, "max_tokens": 4},
        headers={"X-Session-Id": "within"},
    )
    assert reply.status_code == 200
    assert len(reply.json()["choices"]) == 128
    assert len(store.session_calls("within")) == 2


def test_a_client_that_leaves_a_prompt_list_stops_its_engine_calls(upstream, tmp_path):
    """Each prompt takes the upstream 0.3 s and the client leaves at once. Uvicorn's shutdown waits
    for the request to finish, so once the gateway is gone every engine call it made has reached
    the upstream: the first, cancelled as its client left, and no other (before: all eight)."""
    marker = "left-mid-list"
    body = {"model": "fake-model", "prompt": [f"{marker} {i} [[delay=0.3]]" for i in range(8)], "max_tokens": 4}
    with openai_gateway(upstream.url, tmp_path) as (server, _):
        send_and_leave(server.url, "/v1/completions", marker, body)
        deadline = time.monotonic() + 30
        while _reached(upstream, marker) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # until the first prompt is with the engine
    assert _reached(upstream, marker) == 1


# ---------------------------------------------------------------- reward metrics


def test_a_reward_with_more_metrics_than_the_limit_is_refused_and_nothing_stored(gateway):
    http, _ = gateway
    _chat(http, "many-metrics")
    metrics = {f"m{i}": 1.0 for i in range(MAX_METRICS + 1)}
    reply = http.post("/v1/sessions/many-metrics/reward", json={"reward": 1.0, "metrics": metrics})
    assert reply.status_code == 400
    assert f"{MAX_METRICS + 1} metrics, over the limit of {MAX_METRICS}" in reply.json()["error"]["message"]
    session = http.get("/v1/sessions/many-metrics").json()
    assert session["reward"] is None and session["metrics"] == {}


def test_a_metric_name_over_the_limit_is_refused(gateway):
    http, _ = gateway
    _chat(http, "long-name")
    name = "x" * (MAX_METRIC_NAME_CHARS + 1)
    reply = http.post("/v1/sessions/long-name/reward", json={"reward": 1.0, "metrics": {name: 1.0}})
    assert reply.status_code == 400
    message = reply.json()["error"]["message"]
    assert f"{MAX_METRIC_NAME_CHARS + 1} characters, over the limit of {MAX_METRIC_NAME_CHARS}" in message
    assert name not in message
    assert http.get("/v1/sessions/long-name").json()["reward"] is None


def test_metrics_merged_across_rewards_stay_within_the_limit(gateway):
    """Rewards merge their metrics by name into the session's, so sixty-four at a time cannot add up."""
    http, _ = gateway
    _chat(http, "merged")
    full = {"m" * (MAX_METRIC_NAME_CHARS - 3) + f"{i:03}": float(i) for i in range(MAX_METRICS)}
    assert http.post("/v1/sessions/merged/reward", json={"reward": 0.5, "metrics": full}).status_code == 200
    again = http.post("/v1/sessions/merged/reward", json={"reward": 0.75, "metrics": {"one more": 1.0}})
    assert again.status_code == 400
    assert f"{MAX_METRICS + 1} metrics" in again.json()["error"]["message"]
    session = http.get("/v1/sessions/merged").json()
    assert session["reward"] == 0.5 and session["metrics"] == full
    updated = {name: 2.0 for name in list(full)[:3]}  # the names already sent take new values
    assert http.post("/v1/sessions/merged/reward", json={"reward": 1.0, "metrics": updated}).status_code == 200


# ---------------------------------------------------------------- RULER rubric


def test_a_rubric_over_the_limit_is_refused(gateway):
    http, _ = gateway
    _chat(http, "ruled-a", group="ruled")
    reply = http.post(
        "/v1/groups/ruled/ruler", json={"judge_model": "self", "rubric": "be strict. " * (MAX_RUBRIC_CHARS // 10)}
    )
    assert reply.status_code == 400
    message = reply.json()["error"]["message"]
    assert "rubric" in message and str(MAX_RUBRIC_CHARS) in message
    assert http.get("/v1/groups/ruled").json()["ruler_status"] is None


# ---------------------------------------------------------------- list cursors


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode()


BAD_CURSORS = [
    _b64(b"[" * 30000),  # nested past the recursion limit
    _b64(b"[1" + b"0" * 400 + b', "s"]'),  # a time past any float
    _b64(b'[1e999, "s"]'),  # infinite
    _b64(b'{"created_at": 1, "id": "s"}'),  # the wrong shape
    _b64(b'[1, ["s"]]'),
    _b64(b"\xff\xfe"),  # not UTF-8
    "!!! not base64",
]


@pytest.mark.parametrize("path", ["/v1/sessions", "/v1/groups"])
def test_a_cursor_that_does_not_decode_is_a_400(gateway, path):
    http, _ = gateway
    _chat(http, "paged-1", group="paged-a")
    _chat(http, "paged-2", group="paged-b")
    for cursor in BAD_CURSORS:
        reply = http.get(path, params={"cursor": cursor})
        assert reply.status_code == 400, cursor[:40]
        assert reply.json()["error"]["param"] == "cursor"
        assert "next_cursor" in reply.json()["error"]["message"]
    first = http.get(path, params={"limit": 1}).json()
    assert first["has_more"]
    assert http.get(path, params={"limit": 1, "cursor": first["next_cursor"]}).status_code == 200
