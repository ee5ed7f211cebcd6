"""Keys and secrets: a short or empty key is refused at start, the dashboard never takes its key
from a URL, an upstream's error text reaches nobody with a key in it, and the settings written
to the log, beside checkpoints and to trackers hold no password, key or token in any form."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import httpx
import pytest
from pydantic import ValidationError

from gateway.redact import redact
from gateway.settings import Settings
from gateway.ui.auth import cookie_name
from tests.fake_upstream import FakeUpstream
from tests.helpers_upstream import openai_gateway, raw_store_bytes

KEY = "sk-gateway-" + "2d9f41c7e8a3-secret"
UPSTREAM_KEY = "sk-upstream-" + "8e1b5a0c33-never-echoed"


def rlproxy(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


# ---------------------------------------------------------------- item 5: a key is long enough


@pytest.mark.parametrize(
    ("flags", "env"),
    [
        (["--api-key", "short-key-12"], {}),
        (["--api-key", ""], {}),
        ([], {"RLPROXY_API_KEY": ""}),  # a blank variable is not "no key"
    ],
    ids=["short", "empty", "blank-env"],
)
def test_a_short_or_empty_key_is_refused_at_start(flags, env):
    # --engine openai without --upstream-url: a gateway that got past its key stops at once too.
    done = rlproxy("serve", "--engine", "openai", *flags, env=env)
    assert done.returncode != 0
    assert "--api-key" in done.stderr and "at least 16 characters" in done.stderr
    assert "openssl rand -hex 24" in done.stderr  # how to make a good one
    assert "short-key-12" not in done.stderr


def test_settings_take_a_long_key_and_refuse_a_short_one_without_repeating_it():
    assert Settings(api_key=KEY).api_key.get_secret_value() == KEY
    with pytest.raises(ValidationError) as refused:
        Settings(api_key="0123456789abcde")  # 15 characters
    assert "at least 16 characters" in str(refused.value) and "0123456789abcde" not in str(refused.value)


@pytest.mark.parametrize("variable", ["RLPROXY_API_KEY", "RLPROXY_ADMIN_KEY", "RLPROXY_UPSTREAM_API_KEY"])
def test_a_key_no_header_can_carry_is_refused_at_start(variable, capsys, monkeypatch, tmp_path):
    # A key read whole from a file (a Kubernetes secret) keeps its newline: the gateway then answered every
    # call 401 "the key does not match" whatever the client sent, and an upstream key with one made every
    # call a 400 "malformed HTTP request", blamed on the client.
    from gateway.cli import main

    monkeypatch.setenv(variable, KEY + "\n")
    assert main(["serve", "--state-dir", str(tmp_path), "--engine", "openai"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"rlproxy serve: {variable} (environment variable): a key must be printable ASCII, with no "
    ), err
    assert "strip it" in err and KEY not in err


def test_an_admin_key_that_is_the_api_key_is_refused(capsys, monkeypatch, tmp_path):
    # Every agent holding the key was admin: it could promote, reject and resume, which the admin key keeps apart.
    from gateway.cli import main

    monkeypatch.setenv("RLPROXY_API_KEY", KEY)
    monkeypatch.setenv("RLPROXY_ADMIN_KEY", KEY)
    assert main(["serve", "--state-dir", str(tmp_path), "--engine", "openai"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rlproxy serve: --admin-key is the same as --api-key: every agent holding the key"), err
    assert KEY not in err


# ---------------------------------------------------------------- item 8: no key in a URL


def test_a_key_in_the_dashboard_url_signs_nobody_in(upstream, tmp_path):
    with openai_gateway(upstream.url, tmp_path, api_key=KEY) as (server, _):
        page = httpx.get(f"{server.url}/ui?key={KEY}")
        assert page.status_code == 401 and "set-cookie" not in page.headers
        assert KEY not in page.text  # the login form's next page drops it
        signed_in = httpx.post(f"{server.url}/ui/login", data={"key": KEY, "next": "/ui"})
        assert signed_in.status_code == 303 and cookie_name(KEY) in signed_in.cookies


# ---------------------------------------------------------------- item 6: upstream text redacted


def test_an_upstream_that_echoes_our_key_gets_it_nowhere(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}
    with FakeUpstream(api_key="the-upstream-wants-another-key", echo_key=True) as careless:
        with openai_gateway(careless.url, tmp_path, upstream_api_key=UPSTREAM_KEY, upstream_protocol=["responses"]) as (
            server,
            _,
        ):
            answers = [
                httpx.post(server.url + "/v1/chat/completions", json=chat, headers={"X-Session-Id": "plain"}),
                httpx.post(
                    server.url + "/v1/chat/completions", json={**chat, "stream": True}, headers={"X-Session-Id": "sse"}
                ),
                httpx.post(  # relayed as it is to an upstream that speaks Responses itself
                    server.url + "/v1/responses",
                    json={"model": "fake-model", "input": "hello"},
                    headers={"X-Session-Id": "relayed"},
                ),
            ]
    assert all(f"Bearer {UPSTREAM_KEY}" in r.headers.get("authorization", "") for r in careless.requests)
    for answer in answers:
        assert answer.status_code == 502
        assert "check --upstream-api-key" in answer.text and "Authorization: Bearer ***" in answer.text
        assert UPSTREAM_KEY not in answer.text
    stored = raw_store_bytes(tmp_path)
    assert b"check --upstream-api-key" in stored  # the calls were recorded, with their errors
    assert UPSTREAM_KEY.encode() not in stored
    assert UPSTREAM_KEY not in caplog.text


# ---------------------------------------------------------------- item 7: settings written down


def _cases() -> list:
    cases = [
        ({"api_key": KEY}, KEY, "api_key"),
        ({"upstream_api_key": UPSTREAM_KEY}, UPSTREAM_KEY, "upstream_api_key"),
        ({"store": "postgresql://rl:Pg-pw-1@db.example:5432/rl"}, "Pg-pw-1", "rl:***@db.example:5432/rl"),
        ({"store": "postgresql://rl:p@ss-Pw2@db.example/rl"}, "p@ss-Pw2", "rl:***@db.example/rl"),  # an @ in it
        ({"store": "postgresql://rl@db.example/rl?password=Qp-3&sslmode=require"}, "Qp-3", "sslmode=require"),
        ({"store": "postgresql://db.example/rl?sslpassword=Ssl-4"}, "Ssl-4", "db.example/rl"),
        ({"store": "host=db.example user=rl password=Kv-5 dbname=rl"}, "Kv-5", "host=db.example user=rl"),
        ({"store": "host=db.example password = 'Kv 6' dbname=rl"}, "Kv 6", "dbname=rl"),
        ({"upstream_url": "https://rl:Up-7@api.example/v1"}, "Up-7", "api.example/v1"),
        ({"upstream_url": "https://api.example/v1?api_key=Q-8"}, "Q-8", "api.example/v1"),
        ({"shadow_judge_api_base": "https://rl:Judge-9@judge.example/v1"}, "Judge-9", "judge.example/v1"),
        ({"vllm_url": "http://rl:Vllm-10@127.0.0.1:8001"}, "Vllm-10", "127.0.0.1:8001"),
        ({"vllm_arg": ["--hf-token=Hf-11", "--enforce-eager"]}, "Hf-11", "--enforce-eager"),
        ({"vllm_arg": ["--hf-token", "Hf-12", "--max-num-batched-tokens", "8192"]}, "Hf-12", "8192"),
        ({"vllm_arg": ["--api-key=Vk-13"]}, "Vk-13", "--api-key"),
        ({"vllm_arg": ["--api-key", "Vk-14"]}, "Vk-14", "--api-key"),
    ]
    if "vllm_api_key" in Settings.model_fields:
        cases.append(({"vllm_api_key": "Vllm-key-15"}, "Vllm-key-15", "vllm_api_key"))
    if "judge_api_base" in Settings.model_fields:
        cases.append(({"judge_api_base": ["https://rl:Jb-16@judge.example/v1"]}, "Jb-16", "judge.example/v1"))
    return cases


@pytest.mark.parametrize(
    ("given", "secret", "kept"), _cases(), ids=lambda v: str(v)[:48] if isinstance(v, dict) else None
)
def test_public_settings_mask_every_form_and_redact_knows_it(given, secret, kept):
    settings = Settings(**given)
    public = json.dumps(settings.public_dict())
    assert secret not in public and "***" in public
    assert kept in public  # what is not secret stays readable
    said = redact(f"the upstream said: {secret}!", settings.secrets())
    assert said == "the upstream said: ***!"


def test_the_judge_key_in_the_environment_is_redacted_too(monkeypatch):
    monkeypatch.setenv("RLPROXY_JUDGE_API_KEY", "sk-judge-" + "51f0c2-from-env")
    assert redact("echoed sk-judge-51f0c2-from-env", Settings().secrets()) == "echoed ***"


def test_the_log_and_settings_beside_a_checkpoint_hold_no_secret(tmp_path):
    secrets = ["Up-secret-7", "Q-secret-8", "Hf-secret-11", UPSTREAM_KEY]
    done = rlproxy(
        "train",
        "--max-steps",
        "0",  # step 0's checkpoint, with its settings.json, and nothing trained
        "--state-dir",
        str(tmp_path),
        "--lora-rank",
        "4",
        "--upstream-url",
        "https://rl:Up-secret-7@api.example/v1?token=Q-secret-8",
        "--vllm-arg=--hf-token",
        "--vllm-arg=Hf-secret-11",
        "--log-level",
        "info",
        env={"RLPROXY_UPSTREAM_API_KEY": UPSTREAM_KEY},
    )
    assert done.returncode == 0, done.stderr
    assert "train settings" in done.stderr and "api.example/v1" in done.stderr
    [saved] = tmp_path.glob("models/agent/checkpoints/*/settings.json")
    assert "api.example/v1" in saved.read_text()
    for secret in secrets:
        assert secret not in done.stderr and secret not in saved.read_text()


def test_a_password_in_a_vllm_url_is_shown_nowhere(tmp_path, caplog):
    # /healthz answers without a key: the replica table and the reason a replica is down name
    # each vLLM by its URL, and so do the log lines and the errors a call gets.
    from gateway.app import create_app
    from tests.helpers import ThreadServer
    from tests.helpers_vllm import fake_vllm_thread, vllm_settings, wait_until

    caplog.set_level(logging.INFO)
    with fake_vllm_thread() as (a, _), fake_vllm_thread() as (b, _):
        urls = [url.replace("http://", "http://rl:Vllm-pw-17@") for url in (a.url, b.url)]
        settings = vllm_settings(tmp_path, vllm_url=urls, api_key=KEY)
        with ThreadServer(create_app(settings)) as server:
            b.server.should_exit = True  # replica 1 goes away: its reason names it
            b.thread.join(timeout=60)
            health = wait_until(
                lambda: (
                    (h := httpx.get(server.url + "/healthz", timeout=10).json())["replicas"][1]["state"] == "down" and h
                ),
                what="replica 1 seen down",
            )
            dashboard = httpx.get(server.url + "/v1/dashboard", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    shown = json.dumps(health) + dashboard.text + caplog.text
    assert health["replicas"][0]["url"] == urls[0].replace("Vllm-pw-17", "***")
    assert "does not answer" in health["replicas"][1]["reason"]
    assert "Vllm-pw-17" not in shown


def test_an_upstream_error_page_reaches_the_log_only(tmp_path, caplog):
    # DESIGN.md: the gateway never returns an upstream's raw error body; a proxy's HTML page can
    # name hosts, paths and users. The client and the store get its size; the log, its text.
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    page = b"<html>Internal error at db-internal-7.corp:5432 user=svc_llm key=" + UPSTREAM_KEY.encode() + b"</html>"

    class ErrorPage(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(500)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass

    caplog.set_level(logging.WARNING)
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), ErrorPage)
    thread = threading.Thread(target=upstream.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{upstream.server_port}/v1"
        with openai_gateway(url, tmp_path / "state", upstream_api_key=UPSTREAM_KEY) as (server, _):
            chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}
            answers = [
                httpx.post(server.url + "/v1/chat/completions", json={**chat, "stream": stream}, timeout=30)
                for stream in (False, True)
            ]
            calls = httpx.get(server.url + "/v1/sessions", timeout=30).json()["data"]
    finally:
        upstream.shutdown()
        upstream.server_close()
        thread.join(timeout=30)
    for answer in answers:
        assert answer.status_code == 502
        assert f"answered 500: its {len(page)}-byte body is in the gateway's log" in answer.json()["error"]["message"]
    assert len(calls) == 2
    said = (
        "".join(answer.text for answer in answers)
        + json.dumps(calls)
        + raw_store_bytes(tmp_path / "state").decode(errors="replace")
    )
    assert "db-internal-7" not in said and "svc_llm" not in said
    assert "db-internal-7.corp:5432 user=svc_llm key=***" in caplog.text and UPSTREAM_KEY not in caplog.text


# ---------------------------------------------------------------- secrets on the command line


def test_a_secret_given_as_a_flag_is_warned_about_without_repeating_it(capsys, monkeypatch, tmp_path):
    # Every user of the machine reads a process's command line (`ps`): a key given as --api-key was
    # theirs, and only RLPROXY_STORE was said to keep a secret off it. Said once, at start; a
    # --port 99999 refused after it ends each run before anything starts.
    from gateway.cli import main

    given = ["--state-dir", str(tmp_path), "--port", "99999"]
    store = "postgresql://rlproxy:hunter2-secret@db.internal:5432/rlproxy"
    assert main(["serve", *given, "--api-key", KEY, "--store", store]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == (
        "rlproxy serve: warning: --api-key, --store on the command line: set RLPROXY_API_KEY, RLPROXY_STORE in "
        "the environment instead (every user of this machine can read a command line: ps, /proc/PID/cmdline)"
    )
    assert KEY not in err and "hunter2" not in err
    assert main(["serve", *given, "--vllm-arg=--hf-token=hf_" + "secret-token"]) == 2
    err = capsys.readouterr().err
    assert "warning: a secret in --vllm-arg: pass it to vLLM in its environment instead (HF_TOKEN" in err
    assert "secret-token" not in err
    # The same secrets from the environment, and a store URL without a password: nothing to say.
    monkeypatch.setenv("RLPROXY_API_KEY", KEY)
    monkeypatch.setenv("RLPROXY_STORE", store)
    assert main(["serve", *given]) == 2
    assert main(["train", *given, "--store", "postgresql://rlproxy@db.internal/rlproxy"]) == 2
    assert "warning" not in capsys.readouterr().err


def test_help_steers_every_secret_to_its_variable():
    from tests.test_cli import help_text

    text = " ".join(help_text("serve").split())
    for name in ("store", "api_key", "admin_key", "upstream_api_key", "vllm_api_key"):
        assert f"better as env RLPROXY_{name.upper()}: a flag shows in `ps` to every user of the machine" in text


def test_the_demo_hands_its_trainer_every_secret_unmasked_and_off_its_command_line(tmp_path, monkeypatch):
    # The demo wrote its trainer's flags from the masked settings: `--store=postgresql://rl:***@...` beat
    # the RLPROXY_STORE the trainer inherits (it logged in with the password ***), and `--admin-key=***`
    # from an RLPROXY_ADMIN_KEY in the user's shell was a key too short: the trainer refused to start.
    from gateway.cli import build_parser, settings_from_args
    from gateway.demo import processes
    from gateway.demo.options import demo_settings

    started = {}

    class NoProcess:
        def __init__(self, cmd, env, **kwargs):
            started.update(cmd=cmd, env=env)

    monkeypatch.setattr(processes.subprocess, "Popen", NoProcess)
    vllm_key = "vllm-secret-key-0123456789"
    monkeypatch.setenv("RLPROXY_ADMIN_KEY", KEY)
    monkeypatch.setenv("RLPROXY_VLLM_API_KEY", vllm_key)  # the demo refuses an RLPROXY_STORE of its own
    settings = demo_settings({"vllm_arg": ["--hf-token=hf_secret-token"]}, tmp_path)
    processes.Trainer(settings, tmp_path / "trainer.log", threads=1)._log.close()

    assert not [arg for arg in started["cmd"] if "secret" in arg or KEY in arg or "***" in arg], started["cmd"]
    for name in list(os.environ):  # the trainer's process: its own environment and command line
        if name.startswith("RLPROXY_"):
            monkeypatch.delenv(name)
    for name, value in started["env"].items():
        monkeypatch.setenv(name, value)
    trainer = settings_from_args(build_parser().parse_args(started["cmd"][3:]))
    assert trainer.admin_key.get_secret_value() == KEY
    assert trainer.vllm_api_key is not None and trainer.vllm_api_key.get_secret_value() == vllm_key
    assert trainer.vllm_arg == ["--hf-token=hf_secret-token"]
