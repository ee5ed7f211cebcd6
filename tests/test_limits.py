"""Limits: a body over --max-body-mb gets 413 before it is read (Content-Length) or as soon
as a chunked body passes it; too many messages, too large an `n`, or more completion tokens
than the engine's context get a 400 that names the limit. The gateway keeps serving."""

from __future__ import annotations

import socket

import httpx
import pytest

from gateway.store.sqlite import SQLiteStore
from tests.helpers import ThreadServer
from tests.helpers_upstream import openai_gateway
from tests.helpers_vllm import attached_engine, fake_vllm_thread, vllm_settings

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def gateway(upstream, tmp_path_factory):
    state = tmp_path_factory.mktemp("limits")
    with openai_gateway(upstream.url, state, max_body_mb=1, max_messages=3, max_n=2) as (server, services):
        yield server


def _raw_request(url: str, head: str, parts) -> tuple[int, bytes]:
    """Send `head` then the byte strings of `parts` (until the server stops reading); return
    (status, body of the answer)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode())
        try:
            for part in parts:
                sock.sendall(part)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the gateway answered and closed without reading the rest: what we want
        answer = b""
        try:
            while chunk := sock.recv(65536):  # the answer says `connection: close`
                answer += chunk
        except ConnectionResetError:
            pass
    head, _, body = answer.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        size, _, rest = body.partition(b"\r\n")
        body = rest[: int(size, 16)]
    return int(head.split(b" ", 2)[1]), body


BODY_ROUTES = ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/completions", "/v1/sessions/s1/reward"]


def _too_large(path: str, body: bytes) -> str:
    """The 413's message, after checking it is in the route's protocol's error shape."""
    answer = httpx.Response(413, content=body).json()
    if path == "/v1/messages":  # Anthropic's shape
        assert answer["type"] == "error" and answer["error"]["type"] == "request_too_large", answer
    else:
        assert answer["error"]["code"] == "request_too_large", answer
    return answer["error"]["message"]


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_content_length_over_the_limit_is_refused_before_reading(gateway, path):
    size = 60 * 1024 * 1024
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    )
    # Only 1 KB of the announced 60 MB is ever sent: an answer proves nothing waited for the rest.
    status, body = _raw_request(gateway.url, head, [b"{" + b" " * 1023])
    assert status == 413
    message = _too_large(path, body)
    assert "60.0 MB" in message and "1 MB (--max-body-mb)" in message


@pytest.mark.parametrize("path", BODY_ROUTES)
def test_chunked_body_is_refused_once_it_passes_the_limit(gateway, path):
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b" " * (256 * 1024)
    parts = [b"%x\r\n" % len(chunk) + chunk + b"\r\n" for _ in range(12)] + [b"0\r\n\r\n"]  # 3 MB
    status, body = _raw_request(gateway.url, head, parts)
    assert status == 413
    assert "--max-body-mb" in _too_large(path, body)


def test_body_under_the_limit_still_works(gateway):
    text = "x" * (900 * 1024)
    reply = httpx.post(
        gateway.url + "/v1/chat/completions",
        timeout=30,
        json={"model": "fake-model", "messages": [{"role": "user", "content": text}]},
    )
    assert reply.status_code == 200, reply.text


def test_too_many_messages_names_the_limit(gateway):
    body = {**CHAT, "messages": [{"role": "user", "content": str(i)} for i in range(4)]}
    reply = httpx.post(gateway.url + "/v1/chat/completions", json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "messages" and "4 messages" in error["message"]
    assert "limit of 3 (--max-messages)" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_n_over_the_limit_names_the_limit(gateway, stream):
    reply = httpx.post(gateway.url + "/v1/chat/completions", json={**CHAT, "n": 3, "stream": stream})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "n" and "limit of 2" in error["message"] and "--max-n" in error["message"]


def test_max_tokens_over_the_engines_context(tmp_path):
    with fake_vllm_thread(max_model_len=512) as (fake_server, fake):
        settings = vllm_settings(tmp_path, vllm_url=fake_server.url + "/v1")
        from gateway.app import create_app

        app = create_app(settings, engine=attached_engine(fake_server.url), store=SQLiteStore(settings.db_path))
        with ThreadServer(app) as server:
            chats_at_start = len([e for e in fake.events if e["kind"] == "chat"])  # the logprobs-mode probe
            for field in ("max_tokens", "max_completion_tokens"):
                reply = httpx.post(
                    server.url + "/v1/chat/completions",
                    timeout=30,
                    json={"model": "agent", "messages": [{"role": "user", "content": "hi"}], field: 600},
                )
                assert reply.status_code == 400, reply.text
                error = reply.json()["error"]
                assert error["param"] == field and error["code"] == "context_length_exceeded"
                assert "context is 512 tokens" in error["message"]
            ok = httpx.post(
                server.url + "/v1/chat/completions",
                timeout=30,
                json={"model": "agent", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
            )
            assert ok.status_code == 200, ok.text
            # the refused ones never reached vLLM
            assert len([e for e in fake.events if e["kind"] == "chat"]) == chats_at_start + 1
