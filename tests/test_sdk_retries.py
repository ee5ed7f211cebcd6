"""The SDK's errors and retries: every error the gateway answers becomes its typed error, and a
request the gateway did not take is sent again where a second copy changes nothing, after the
wait the gateway asked for, within a bound. Waits are recorded, never slept."""

from __future__ import annotations

import asyncio
import calendar
from collections.abc import Callable

import httpx
import pytest

from sdk import (
    APIConnectionError,
    APITimeoutError,
    AsyncRLProxy,
    BadRequestError,
    ConflictError,
    RateLimitError,
    RequestTooLargeError,
    RLProxy,
    ServerError,
)
from sdk.errors import retry_after_seconds

BASE = "http://gateway.example/v1"
UNAVAILABLE = {"error": {"message": "the store is read-only", "type": "store_unavailable", "code": "store_read_only"}}
RECORDED = {"session_id": "sess-1", "reward": 1.0, "metrics": {}}


class Script:
    """A mock gateway answering each request with the next of `answers` (a response, or an
    exception raised as httpx would), counting what it was sent."""

    def __init__(self, *answers: httpx.Response | Exception):
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def _blocking(script: Script, **options) -> tuple[RLProxy, list[float]]:
    proxy = RLProxy(BASE, http_client=httpx.Client(transport=httpx.MockTransport(script)), **options)
    waits: list[float] = []
    proxy._sleep = waits.append
    return proxy, waits


def _both(script_for: Callable[[], Script], call: str, *args, **options) -> list[tuple[object, Script, list[float]]]:
    """`call(*args)` on a blocking and on an asyncio client, each before its own `script_for()`:
    (what it returned or raised, the script, the waits), the two clients' outcomes."""
    outcomes = []
    script = script_for()
    proxy, waits = _blocking(script, **options)
    with proxy:
        try:
            outcomes.append((getattr(proxy, call)(*args), script, waits))
        except Exception as error:
            outcomes.append((error, script, waits))

    async def asynchronously() -> None:
        script = script_for()
        waits: list[float] = []

        async def record(seconds: float) -> None:
            waits.append(seconds)

        http = httpx.AsyncClient(transport=httpx.MockTransport(script))
        async with AsyncRLProxy(BASE, http_client=http, **options) as client:
            client._sleep = record
            try:
                outcomes.append((await getattr(client, call)(*args), script, waits))
            except Exception as error:
                outcomes.append((error, script, waits))
        await http.aclose()

    asyncio.run(asynchronously())
    return outcomes


def test_retry_after_is_read_as_seconds_or_an_http_date():
    now = calendar.timegm((2015, 10, 21, 7, 27, 30))
    assert retry_after_seconds("120", now) == 120.0
    assert retry_after_seconds(" 0 ", now) == 0.0
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT", now) == 30.0
    assert retry_after_seconds("Wed, 21 Oct 2015 07:00:00 GMT", now) == 0.0  # already past
    for nonsense in (None, "", "soon", "-5", "1.5e3", "Wed, 21 Oct 2015"):
        assert retry_after_seconds(nonsense, now) is None, nonsense


def test_a_reward_the_store_did_not_take_is_sent_again_after_the_wait_the_gateway_asked_for():
    def script() -> Script:
        return Script(
            httpx.Response(503, json=UNAVAILABLE, headers={"Retry-After": "2"}), httpx.Response(200, json=RECORDED)
        )

    for answer, sent, waits in _both(script, "reward", "sess-1", 1.0):
        assert answer == RECORDED
        assert [r.url.path for r in sent.requests] == ["/v1/sessions/sess-1/reward"] * 2
        assert sent.requests[0].content == sent.requests[1].content
        assert waits == [2.0]


def test_without_retry_after_the_waits_double_and_the_last_error_is_raised():
    def script() -> Script:
        slow_down = {"error": {"message": "slow down", "type": "rate_limit"}}
        return Script(*[httpx.Response(429, json=slow_down) for _ in "abc"])

    for error, sent, waits in _both(script, "get_group", "grp-1"):
        assert isinstance(error, RateLimitError) and error.status_code == 429 and error.message == "slow down"
        assert len(sent.requests) == 3 and waits == [0.25, 0.5]


def test_a_retry_after_beyond_the_bound_is_raised_at_once_saying_how_long():
    def script() -> Script:
        return Script(httpx.Response(503, json=UNAVAILABLE, headers={"Retry-After": "600"}))

    for error, sent, waits in _both(script, "discard", "sess-1"):
        assert isinstance(error, ServerError) and error.retry_after == 600.0 and error.code == "store_read_only"
        assert len(sent.requests) == 1 and waits == []


def test_a_judgement_is_never_sent_twice():
    def script() -> Script:
        return Script(httpx.Response(503, json=UNAVAILABLE, headers={"Retry-After": "0"}))

    for error, sent, _ in _both(script, "ruler", "grp-1", "openai/judge"):
        assert isinstance(error, ServerError) and len(sent.requests) == 1


def test_errors_of_the_request_itself_are_not_sent_again():
    for status, kind in ((400, BadRequestError), (409, ConflictError), (413, RequestTooLargeError), (500, ServerError)):

        def script(status: int = status) -> Script:
            return Script(httpx.Response(status, json={"error": {"message": f"said {status}", "type": "x"}}))

        for error, sent, _ in _both(script, "close_group", "grp-1"):
            assert type(error) is kind and error.message == f"said {status}" and len(sent.requests) == 1


def test_a_gateway_that_refuses_connections_is_tried_again_then_named_with_the_tries():
    def script() -> Script:
        return Script(*[httpx.ConnectError("[Errno 111] Connection refused") for _ in "abc"])

    for error, sent, waits in _both(script, "reward", "sess-1", 0.5):
        assert type(error) is APIConnectionError and len(sent.requests) == 3 and waits == [0.25, 0.5]
        assert str(error).startswith(
            f"could not reach the gateway at {BASE} (POST /sessions/sess-1/reward, 3 tries): [Errno 111]"
        )


def test_a_timeout_is_not_sent_again():
    def script() -> Script:
        return Script(httpx.ReadTimeout("timed out"))

    for error, sent, waits in _both(script, "reward", "sess-1", 0.5):
        assert isinstance(error, APITimeoutError) and isinstance(error, APIConnectionError)
        assert len(sent.requests) == 1 and waits == []


def test_max_retries_zero_sends_once_and_a_negative_one_is_refused():
    def script() -> Script:
        return Script(httpx.Response(503, json=UNAVAILABLE))

    for error, sent, _ in _both(script, "get_session", "sess-1", max_retries=0):
        assert isinstance(error, ServerError) and len(sent.requests) == 1
    with pytest.raises(ValueError, match="max_retries"):
        RLProxy(BASE, max_retries=-1)


@pytest.mark.parametrize(
    "body",
    [
        {"type": "error", "error": {"type": "rate_limit_error", "message": "the gateway's words"}},  # Anthropic's
        {"error": "the gateway's words"},  # a proxy in front of it
        {"detail": "the gateway's words"},  # FastAPI's default
    ],
)
def test_error_bodies_not_in_openai_shape_keep_their_message(body):
    proxy, _ = _blocking(Script(httpx.Response(409, json=body)))
    with proxy, pytest.raises(ConflictError) as info:
        proxy.get_group("grp-1")
    assert info.value.message == "the gateway's words"


def test_a_request_that_waited_for_a_pooled_connection_in_vain_says_it_was_not_sent():
    # It read "no answer within 60 s; the request may still have taken effect" of a request never sent.
    def script() -> Script:
        return Script(httpx.PoolTimeout("pool"))

    for error, sent, waits in _both(script, "reward", "sess-1", 0.5):
        assert type(error) is APIConnectionError and "so it was not sent" in str(error)
        assert "may still have taken effect" not in str(error) and len(sent.requests) == 1 and waits == []
