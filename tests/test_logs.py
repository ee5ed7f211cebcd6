"""What the operator reads in the log: each call named by its session and request id (the
gateway's X-Request-Id and the client's own), and no key a client put in a URL's query string."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

import httpx
import pytest

from gateway.settings import Settings
from tests.helpers import gateway_process
from tests.helpers_upstream import openai_gateway

KEY = "sk-gateway-" + "0c4e7a19b2d6-in-a-url"


def test_each_call_is_logged_with_its_session_and_request_ids(upstream, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="rlproxy.chat")
    with openai_gateway(upstream.url, tmp_path) as (server, _):
        answers = [
            httpx.post(
                server.url + "/v1/chat/completions",
                json={"model": "fake-model", "messages": [{"role": "user", "content": text}]},
                headers={"X-Session-Id": "ticket-4711", "X-Request-Id": f"client-{n}"},
                timeout=30,
            )
            for n, text in enumerate(["hello", "[[status=503]]"])
        ]
    assert [answer.status_code for answer in answers] == [200, 502]
    lines = {record.getMessage(): record.levelname for record in caplog.records if record.name == "rlproxy.chat"}
    for n, answer in enumerate(answers):
        [line] = [line for line in lines if answer.headers["x-request-id"] in line]
        assert f"(client request id client-{n})" in line and "session ticket-4711" in line
        assert lines[line] == ("DEBUG" if answer.status_code == 200 else "WARNING")
    [failed] = [line for line, level in lines.items() if level == "WARNING"]
    assert "failed: 502" in failed and "answered 503" in failed  # the reason the client got


def test_a_key_in_a_query_string_stays_out_of_the_access_log(upstream, tmp_path):
    # --log-level debug turns uvicorn's access log on: its line holds the path with its query.
    args = ["--engine", "openai", "--upstream-url", upstream.url, "--state-dir", str(tmp_path)]
    with gateway_process([*args, "--trainer", "off", "--api-key", KEY, "--log-level", "debug"]) as (proc, url):
        refused = [
            httpx.get(url + "/ui?key=" + KEY, timeout=10),  # a dashboard link with the key in it
            httpx.get(url + "/v1/models?limit=5&api_key=" + KEY, timeout=10),
            httpx.get(url + "/v1/models?k=" + KEY, timeout=10),  # any name: the key itself is known
        ]
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log = proc.stdout.read().decode(errors="replace")
    assert [answer.status_code for answer in refused] == [401, 401, 401]
    assert '"GET /ui?key=*** HTTP/1.1" 401' in log
    assert '"GET /v1/models?limit=5&api_key=*** HTTP/1.1" 401' in log
    assert KEY not in log


@pytest.mark.parametrize("level", ["warn", "trace"])
def test_a_log_level_logging_does_not_know_is_refused_in_words(level, tmp_path):
    # `warn` (Python's) stopped uvicorn with a KeyError, `trace` (uvicorn's) logging with a ValueError.
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--state-dir", str(tmp_path), "--log-level", level],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"'{level}' is not a log level: use one of debug, info, warning, error" in done.stderr
    assert Settings(log_level="DEBUG").log_level == "debug"  # and --log-level DEBUG turns the access log on
