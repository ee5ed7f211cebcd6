"""Many simultaneous streaming sessions: every one recorded, none mixed with another."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.fake_upstream import FakeUpstream
from tests.helpers_upstream import openai_gateway

SESSIONS = 50


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with FakeUpstream(record=False) as upstream:
        with openai_gateway(upstream.url, tmp_path_factory.mktemp("state")) as (server, services):
            yield server, services


async def _one_session(client: openai.AsyncOpenAI, index: int) -> tuple[str, str, str]:
    session_id = f"conc-{index:02d}"
    # Distinct words per session so any cross-talk between streams shows up in the text.
    content = " ".join(f"s{index}w{k}" for k in range(8 + index % 5))
    stream = await client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": content}],
        stream=True,
        extra_headers={"X-Session-Id": session_id, "X-Group-Id": f"conc-group-{index % 5}"},
    )
    received = []
    async for chunk in stream:
        assert chunk.model == "fake-model"
        for choice in chunk.choices:
            received.append(choice.delta.content or "")
    return session_id, content, "".join(received)


async def test_fifty_simultaneous_streams_are_recorded_apart(gateway):
    server, services = gateway
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        results = await asyncio.gather(*(_one_session(client, i) for i in range(SESSIONS)))
    finally:
        await client.close()
    assert len({session for session, _, _ in results}) == SESSIONS
    for session_id, sent, received in results:
        assert received == sent, session_id  # each client got its own echo, whole
        (call,) = services.store.session_calls(session_id)
        assert call["status"] == "ok" and call["stream"]
        assert call["request"]["messages"][0]["content"] == sent
        assert call["response"]["choices"][0]["message"]["content"] == received
        assert call["group_id"] == f"conc-group-{int(session_id[-2:]) % 5}"
    assert services.store.counts()["calls"] == SESSIONS
