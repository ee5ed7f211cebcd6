"""A client that leaves before its non-streamed answer is ready is recorded as 499 (never trained).

Two ways the gateway notices (gateway/routes/client_watch.py): a call still running after
`WATCH_AFTER_SECONDS` gets a watcher task that cancels it; a shorter one is checked once its
answer is ready, by a look at `receive` that never waits. Each is tested with the other out
of the way, over a real socket, then the look itself against stand-in `receive`s.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.routes import client_watch
from gateway.routes.client_watch import disconnected_now
from tests.helpers_upstream import first_call, openai_gateway, send_and_leave


@pytest.fixture(scope="module")
def gateway(upstream, tmp_path_factory):
    with openai_gateway(upstream.url, tmp_path_factory.mktemp("state")) as (server, services):
        yield server.url, services.store


def _chat_and_leave(base_url: str, session: str, text: str) -> None:
    send_and_leave(
        base_url,
        "/v1/chat/completions",
        session,
        {"model": "fake-model", "messages": [{"role": "user", "content": text}]},
    )


def test_a_short_call_whose_client_left_is_recorded_as_499_when_its_answer_is_ready(gateway, monkeypatch):
    """No watcher task (its delay pushed past the call): only the look at `receive` before the
    record can see that the client left during the upstream's 0.5 s."""
    base_url, store = gateway
    monkeypatch.setattr(client_watch, "WATCH_AFTER_SECONDS", 3600.0)
    _chat_and_leave(base_url, "short-left", "answer nobody reads [[delay=0.5]]")
    call = first_call(store, "short-left", 30)
    assert call is not None
    assert call["status"] == "error" and call["http_status"] == 499
    assert call["error"] == "the client disconnected before the answer was ready"
    assert call["response"] is None


def test_a_long_call_whose_client_left_is_cancelled_by_the_watcher(gateway, monkeypatch):
    """The upstream would answer after 60 s; the watcher (after 0.05 s here) cancels the call, so
    the 499 row is there long before that (without it, only at 60 s)."""
    base_url, store = gateway
    monkeypatch.setattr(client_watch, "WATCH_AFTER_SECONDS", 0.05)
    _chat_and_leave(base_url, "long-left", "a long generation [[delay=60]]")
    call = first_call(store, "long-left", 20)
    assert call is not None, "the call was not cancelled when its client left"
    assert call["http_status"] == 499 and "disconnected" in call["error"]


def test_a_client_that_stays_gets_its_answer_with_the_watcher_running(gateway, monkeypatch):
    """A watcher from the first moment, and a client that waits: answered and recorded as 200."""
    base_url, store = gateway
    monkeypatch.setattr(client_watch, "WATCH_AFTER_SECONDS", 0.0)
    reply = httpx.post(
        base_url + "/v1/chat/completions",
        timeout=30,
        headers={"X-Session-Id": "stayed"},
        json={"model": "fake-model", "messages": [{"role": "user", "content": "worth the wait [[delay=0.3]]"}]},
    )
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["message"]["content"] == "worth the wait [[delay=0.3]]"
    (call,) = store.session_calls("stayed")
    assert call["status"] == "ok" and call["http_status"] == 200


def test_the_responses_api_notices_a_short_call_left_too(gateway, monkeypatch):
    base_url, store = gateway
    monkeypatch.setattr(client_watch, "WATCH_AFTER_SECONDS", 3600.0)
    send_and_leave(
        base_url, "/v1/responses", "resp-left", {"model": "fake-model", "input": "[[delay=0.5]] nobody reads this"}
    )
    call = first_call(store, "resp-left", 30)
    assert call is not None and call["http_status"] == 499 and call["protocol"] == "responses"


# ---------------------------------------------------------------- the look at `receive`


class StandInReceive:
    """An ASGI `receive` shaped as servers write it: it waits on an event for the next message,
    and answers `http.disconnect` at once once the connection is gone."""

    def __init__(self, pending: list[dict] | None = None, gone: bool = False):
        self.pending = list(pending or [])
        self.gone = gone
        self.event = asyncio.Event()
        self.waits_left = 0  # waits begun and not ended: a look must leave none behind

    async def __call__(self) -> dict:
        if self.pending:
            return self.pending.pop(0)
        if not self.gone:
            self.waits_left += 1
            try:
                await self.event.wait()
            finally:
                self.waits_left -= 1
        return {"type": "http.disconnect"} if self.gone else {"type": "http.request", "body": b"", "more_body": False}


async def test_a_client_still_there_is_not_gone_and_nothing_is_left_waiting():
    receive = StandInReceive()
    assert disconnected_now(receive) is False
    assert receive.waits_left == 0
    # and the same receive still works for a real waiter afterwards
    receive.gone = True
    waiter = asyncio.ensure_future(receive())
    await asyncio.sleep(0)
    receive.event.set()
    assert (await waiter)["type"] == "http.disconnect"


async def test_a_client_gone_is_seen_at_once():
    assert disconnected_now(StandInReceive(gone=True)) is True


async def test_a_stray_empty_message_is_read_past():
    stray = {"type": "http.request", "body": b"", "more_body": False}
    assert disconnected_now(StandInReceive(pending=[stray], gone=True)) is True
    assert disconnected_now(StandInReceive(pending=[stray])) is False
