"""Other users of the same machine (issue 37, item 8): they cannot read the recorded calls nor
reach the vLLM rlproxy starts, and a client cannot move its own calls ahead in vLLM's queue.

- the state dir is 0700 and the database files 0600, set when made and tightened at start where
  an older rlproxy left them looser (said once in the log);
- the managed vLLM listens on a Unix socket in that state dir, never on a port; asked for a port
  (`--vllm-port`), it gets a random key made at each start;
- an attached vLLM's key (`--vllm-api-key`) goes as a bearer on every request to it;
- a client's `priority` is dropped: only the gateway's background work (shadow samples) sets it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sqlite3
import stat
from pathlib import Path

import httpx
import openai
import psutil

from gateway.app import create_app
from gateway.colocate import wait_for_vllm
from gateway.engines.vllm.build import vllm_engine
from gateway.engines.vllm.server import vllm_address
from tests.fake_upstream import FakeUpstream
from tests.fake_vllm import FakeState, create_fake_vllm, require_key
from tests.helpers import ThreadServer, free_port, gateway_process
from tests.helpers_upstream import raw_store_bytes
from tests.helpers_vllm import (
    BASE,
    FAKE_LAUNCHER,
    fake_state,
    fake_vllm_on_path,
    fake_vllm_thread,
    make_adapter,
    vllm_settings,
    wait_until,
)

MESSAGES = [{"role": "user", "content": "say hello"}]
TIGHTENED = "made them private"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@contextlib.contextmanager
def umask(value: int):
    """The umask most machines run with (022: readable by all), whatever the test runner's."""
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


@contextlib.contextmanager
def serving(state: Path, upstream: FakeUpstream):
    """`rlproxy serve` on `state` in front of the fake upstream, once it has recorded a call."""
    args = ["--engine", "openai", "--upstream-url", upstream.url, "--state-dir", str(state)]
    with umask(0o022), gateway_process(args) as (proc, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        client.chat.completions.create(model="m", messages=MESSAGES, extra_headers={"X-Session-Id": "s1"})
        yield proc


def stopped(proc) -> str:
    """Stop the gateway; what it logged."""
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)
    return proc.stdout.read().decode(errors="replace")


def test_a_fresh_state_dir_is_this_users_alone(tmp_path):
    state = tmp_path / "fresh" / "state"
    with FakeUpstream() as upstream, serving(state, upstream) as gateway:
        files = sorted(state.glob("rlproxy.db*"))  # SQLite's -wal and -shm exist while it runs
        assert [f.name for f in files] == ["rlproxy.db", "rlproxy.db-shm", "rlproxy.db-wal"]
        assert {f.name: mode(f) for f in files} == {f.name: 0o600 for f in files}
        assert mode(state) == 0o700
        assert TIGHTENED not in stopped(gateway)  # nothing was loose: nothing to say


def test_an_older_looser_state_dir_is_tightened_at_start_and_said_once(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    with contextlib.closing(sqlite3.connect(state / "rlproxy.db")) as db:  # as an older rlproxy left it
        db.execute("CREATE TABLE old (x)")
    state.chmod(0o755)
    (state / "rlproxy.db").chmod(0o644)
    with FakeUpstream() as upstream, serving(state, upstream) as gateway:
        assert mode(state) == 0o700
        assert {f.name: mode(f) for f in state.glob("rlproxy.db*")} == {
            name: 0o600 for name in ("rlproxy.db", "rlproxy.db-shm", "rlproxy.db-wal")
        }
        (line,) = [line for line in stopped(gateway).splitlines() if TIGHTENED in line]
    assert f"{state} 755 -> 700" in line and f"{state / 'rlproxy.db'} 644 -> 600" in line


def test_the_managed_vllm_listens_on_a_socket_in_the_state_dir_and_on_no_port(tmp_path):
    state = tmp_path / "state"
    args = ["--engine", "vllm", "--base-model", BASE, "--gpu-mode", "dedicated", "--trainer", "off"]
    env = {"PATH": fake_vllm_on_path(tmp_path / "bin")}  # `vllm` is the stand-in
    with umask(0o022), gateway_process([*args, "--state-dir", str(state)], env=env) as (proc, url):
        socket = state / "vllm.sock"
        assert stat.S_ISSOCK(socket.stat().st_mode) and mode(state) == 0o700
        argv = fake_state(f"unix:{socket}")["argv"]
        assert argv[argv.index("--uds") + 1] == str(socket) and "--port" not in argv
        (vllm,) = [p for p in psutil.Process(proc.pid).children(recursive=True) if "fake_vllm" in " ".join(p.cmdline())]
        assert [c for c in vllm.net_connections("inet") if c.status == psutil.CONN_LISTEN] == []
        # the gateway reaches it there
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        answer = client.chat.completions.create(model="agent", messages=MESSAGES, max_tokens=2)
        assert answer.choices[0].message.content.startswith(f"[{BASE}]")
    assert not socket.exists()  # gone with the gateway


async def test_a_state_dir_too_deep_for_a_socket_path_links_to_a_private_directory_of_its_own(tmp_path):
    settings = vllm_settings(tmp_path / ("d" * 60) / ("e" * 60))
    engine = vllm_engine(settings, launcher=FAKE_LAUNCHER, startup_timeout=60)
    await engine.start()
    try:
        link = settings.state_dir / "vllm.sock"
        socket = Path(os.readlink(link))
        assert stat.S_ISSOCK(socket.stat().st_mode) and len(os.fsencode(socket)) <= 100
        assert mode(socket.parent) == 0o700 and mode(settings.state_dir) == 0o700
        # a colocated trainer waits for vLLM there, through the link
        assert await asyncio.to_thread(wait_for_vllm, vllm_address(settings), timeout=10, interval=0.05)
    finally:
        await engine.close()
    assert not link.exists() and not socket.parent.exists()


async def test_a_managed_vllm_asked_for_a_port_needs_the_key_made_at_its_start(tmp_path):
    settings = vllm_settings(tmp_path, vllm_port=free_port())
    engine = vllm_engine(settings, launcher=FAKE_LAUNCHER, startup_timeout=60)
    await engine.start()
    try:
        adapter = make_adapter(tmp_path / "adapters", "agent@1")
        body = {"lora_name": "agent@1", "lora_path": str(adapter)}
        unkeyed = await httpx.AsyncClient().post(engine.url + "/v1/load_lora_adapter", json=body)
        assert unkeyed.status_code == 401
        await engine.load_adapter("agent@1", adapter)  # rlproxy sends the key
        assert "agent@1" in fake_state(engine.url)["loaded"]
        assert not [a for a in engine.process.command if "key" in a.lower()]  # argv shows in `ps`
    finally:
        await engine.close()


def test_an_attached_vllm_with_a_key_gets_it_on_every_request_and_it_is_never_logged(tmp_path, caplog):
    key = "vllm-key-" + os.urandom(8).hex()
    fake = FakeState(base_model=BASE, logprobs_mode="processed_logprobs", generation_config="vllm")
    caplog.set_level(logging.DEBUG)
    guarded, answered = require_key(create_fake_vllm(fake), key), []

    async def noting(scope, receive, send):
        async def send_noted(message):
            if message["type"] == "http.response.start":
                answered.append((scope["path"], message["status"]))
            await send(message)

        await guarded(scope, receive, send_noted)

    with ThreadServer(noting) as vllm:
        settings = vllm_settings(tmp_path, vllm_url=vllm.url + "/v1", vllm_api_key=key)
        with ThreadServer(create_app(settings)) as gateway:
            client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
            answer = client.chat.completions.create(model="agent", messages=MESSAGES, max_tokens=2)
            assert answer.choices[0].message.content.startswith(f"[{BASE}]")
    # the start-up probes (the models it serves, its logprobs mode) and the call: all with the key
    assert {"/v1/models", "/v1/chat/completions"} <= {path for path, _ in answered}
    assert [status for _, status in answered if status == 401] == []
    assert key not in caplog.text and key not in str(settings.public_dict())


def test_an_attached_vllms_error_text_never_carries_a_key(tmp_path, caplog):
    """A proxy in front of vLLM that quotes the Authorization it got: the key is redacted before
    the client's error, the call row and the log see it, streamed or not."""
    key = "vllm-key-" + os.urandom(8).hex()
    caplog.set_level(logging.DEBUG)
    with fake_vllm_thread(logprobs_mode="processed_logprobs") as (vllm, fake):
        guarded = ThreadServer(require_key(create_fake_vllm(fake), key))
        with guarded, ThreadServer(create_app(vllm_settings(tmp_path, vllm_url=guarded.url, vllm_api_key=key))) as gw:
            fake.echo_auth_in_errors = True
            body = {"model": "agent", "messages": MESSAGES, "max_tokens": 2}
            whole = httpx.post(gw.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "echoed"})
            streamed = httpx.post(gw.url + "/v1/chat/completions", json={**body, "stream": True})
    # vLLM's 400 is the client's (the request's fault), with its text, the key taken out
    assert whole.status_code == 400 and "refused the request with Bearer ***" in whole.text, whole.text
    assert streamed.status_code == 400 and "Bearer ***" in streamed.text, streamed.text
    for where, text in {
        "answers": whole.text + streamed.text,
        "store": raw_store_bytes(tmp_path / "state").decode("latin-1"),
        "log": caplog.text,
    }.items():
        assert key not in text, f"the vLLM key is in the {where}"


def vllm_chats(fake: FakeState) -> list[dict]:
    return [event for event in fake.events if event["kind"] == "chat"]


def test_a_clients_priority_is_dropped_and_only_shadow_samples_set_one(tmp_path):
    with fake_vllm_thread(logprobs_mode="processed_logprobs") as (vllm, fake):
        settings = vllm_settings(tmp_path, vllm_url=vllm.url, shadow_samples=2, shadow_judge_model="self")
        with ThreadServer(create_app(settings)) as gateway:
            probes = len(vllm_chats(fake))  # the gateway's own, at start
            client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
            client.chat.completions.create(
                model="agent",
                messages=MESSAGES,
                max_tokens=2,
                extra_body={"priority": -1000},  # would go ahead of every other client's call
                extra_headers={"X-Session-Id": "jumper"},
            )
            wait_until(lambda: len(vllm_chats(fake)) > probes + 1, what="the shadow samples")
    live, shadow = vllm_chats(fake)[probes : probes + 2]
    assert live["priority"] is None  # vLLM's default (0): first come, first served among clients
    assert shadow["priority"] == 10  # the gateway's background work goes behind live calls
