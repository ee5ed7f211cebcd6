"""The clients: `RLProxy` (blocking) and `AsyncRLProxy` (asyncio), thin over the gateway's HTTP API.

Each rlproxy route is one method here; sessions and groups (`sdk.session`,
`sdk.group`) are small objects that remember their ids and call back into these. The clients
make them, so this module imports `sdk.session` and `sdk.group` and never the other way round
(they name the clients in annotations only); what all three share is in `sdk.types`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any

import httpx

from sdk.errors import RLProxySDKError, connection_error, json_body, shown_url
from sdk.group import AsyncGroup, Group, _GroupBase
from sdk.inputs import api_base, json_number, sendable_key
from sdk.retry import DEFAULT_MAX_RETRIES, may_send_again, retry_delay
from sdk.session import AsyncSession, Session
from sdk.types import Score, new_id, path_id

DEFAULT_URL = "http://localhost:8000/v1"
DEFAULT_TIMEOUT = 60.0
# A judge reads a whole group and may think for minutes (o3 and friends): the gateway gives each
# judge call 600 s (gateway/ruler/judges.py) and a bad answer one retry, so up to 1200 s, and the
# SDK waits a little longer than that rather than give up on a judgement that still lands.
RULER_TIMEOUT = 1260.0

log = logging.getLogger("rlproxy.sdk")


def _import_openai() -> Any:
    try:
        import openai
    except ImportError:  # the SDK itself needs httpx only
        raise RLProxySDKError(
            "session.openai_client() needs the openai package (pip install openai); "
            "or pass session.headers() to the client you use"
        ) from None
    return openai


def scores_from(body: dict) -> list[Score]:
    return [Score(item["session_id"], float(item["score"]), item.get("explanation")) for item in body["scores"]]


class _ClientBase:
    """Where the gateway is and how to authenticate; shared by both clients."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
    ):
        if max_retries < 0:
            raise ValueError("max_retries must be 0 or more")
        self.max_retries = max_retries
        self.api_base = api_base(base_url or os.environ.get("RLPROXY_URL") or DEFAULT_URL)
        self._shown_base = shown_url(self.api_base)  # what messages say: no password of a basic-auth URL
        if api_key is not None:
            self.api_key = sendable_key(api_key, "api_key=")
        else:
            self.api_key = sendable_key(os.environ.get("RLPROXY_API_KEY"), "$RLPROXY_API_KEY")
        self.timeout = timeout

    def _openai_options(self) -> dict[str, Any]:
        # The OpenAI client insists on a key; a gateway without one ignores it.
        return {"base_url": self.api_base, "api_key": self.api_key or "rlproxy"}

    def _auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _retry_delay(self, error: RLProxySDKError, method: str, path: str, attempt: int) -> float | None:
        retries = self.max_retries if may_send_again(path) else 0
        delay = retry_delay(error, attempt, retries)
        if delay is not None:
            log.info("%s %s failed (%s); sending it again in %.2g s", method, path, error, delay)
        return delay

    def __repr__(self) -> str:  # never shows the key, nor a password in the URL
        return f"{type(self).__name__}({self._shown_base!r})"

    @staticmethod
    def _session_path(session_id: str, route: str = "") -> str:
        return f"/sessions/{path_id(session_id, 'session_id')}{route}"

    @staticmethod
    def _group_path(group_id: str, route: str = "") -> str:
        return f"/groups/{path_id(group_id, 'group_id')}{route}"

    @staticmethod
    def _reward_body(value: float, metrics: dict[str, float] | None) -> dict:
        as_sent = {name: json_number(v, f"metrics[{name!r}]") for name, v in (metrics or {}).items()}
        reward = float(value) if isinstance(value, bool) else json_number(value, "reward")  # True: 1.0, as ever
        return {"reward": reward, "metrics": as_sent}

    @staticmethod
    def _discard_body(reason: str | None) -> dict:
        return {} if reason is None else {"reason": str(reason)}

    @staticmethod
    def _ruler_body(judge_model: str, rubric: str | None, judge_api_base: str | None) -> dict:
        body: dict[str, Any] = {"judge_model": judge_model}
        if rubric is not None:
            body["rubric"] = rubric
        if judge_api_base is not None:
            body["judge_api_base"] = judge_api_base
        return body


class RLProxy(_ClientBase):
    """Blocking client. `RLProxy("http://localhost:8000/v1")`; use as a context manager or call `close()`.

    `base_url` defaults to `$RLPROXY_URL` (then http://localhost:8000/v1), `api_key` to
    `$RLPROXY_API_KEY`. Safe to share between threads (`group.run` does). A request the gateway
    did not take (503, 429, the connection refused or dropped) is sent again up to `max_retries`
    times, after its Retry-After (up to 30 s) or 0.25 s, 0.5 s, ...; RULER never (`sdk.retry`).
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        http_client: httpx.Client | None = None,
    ):
        super().__init__(base_url, api_key, timeout=timeout, max_retries=max_retries)
        self._sleep = time.sleep
        self._http = http_client or httpx.Client(timeout=timeout)
        self._owns_http = http_client is None
        self._openai: Any = None
        self._openai_lock = threading.Lock()

    def openai_base(self) -> Any:
        """The one `openai.OpenAI` whose pool every session's client shares (made on first use)."""
        with self._openai_lock:
            if self._openai is None:
                self._openai = _import_openai().OpenAI(**self._openai_options())
            return self._openai

    # -- sessions and groups

    def session(
        self,
        group: str | Any | None = None,
        split: str | None = None,
        session_id: str | None = None,
        *,
        task_id: str | None = None,
    ) -> Session:
        """A new session (one rollout); `group` is a group id or a `Group` (as `group.session()`:
        the group's split, and leaving its `with` block closes it); `split` defaults to "train".

        Live traffic has no group: give `task_id` instead (sent as `X-Task-Id`) and the
        gateway puts the session, once rewarded, into a group of the same task's sessions
        (`rlproxy serve --live-group-size K`)."""
        if isinstance(group, _GroupBase):
            return group._new_session(Session, session_id, split, task_id)
        return Session(self, session_id or new_id("sess"), group, split or "train", task_id)

    def group(self, id: str | None = None, split: str = "train") -> Group:
        """A group of sessions GRPO compares (the rollouts of one task)."""
        return Group(self, id or new_id("grp"), split)

    # -- the HTTP routes

    def _request(self, method: str, path: str, json: Any = None, timeout: float | None = None) -> dict:
        attempt = 0
        while True:
            try:
                return self._send(method, path, json, timeout or self.timeout, attempt + 1)
            except RLProxySDKError as error:
                delay = self._retry_delay(error, method, path, attempt)
                if delay is None:
                    raise
            self._sleep(delay)
            attempt += 1

    def _send(self, method: str, path: str, json: Any, timeout: float, tries: int) -> dict:
        try:
            response = self._http.request(
                method, self.api_base + path, json=json, headers=self._auth_headers(), timeout=timeout
            )
        except httpx.HTTPError as exc:
            raise connection_error(exc, self._shown_base, method, path, timeout, tries) from exc
        return json_body(response, self._shown_base, path)

    def reward(self, session_id: str, value: float, metrics: dict[str, float] | None = None) -> dict:
        return self._request("POST", self._session_path(session_id, "/reward"), self._reward_body(value, metrics))

    def get_session(self, session_id: str) -> dict:
        return self._request("GET", self._session_path(session_id))

    def discard(self, session_id: str, reason: str | None = None) -> dict:
        """Leave a session (a failed rollout) out of its group: no reward needed, never trained."""
        return self._request("POST", self._session_path(session_id, "/discard"), self._discard_body(reason))

    def close_group(self, group_id: str, expected_sessions: int | None = None) -> dict:
        return self._request("POST", self._group_path(group_id, "/close"), {"expected_sessions": expected_sessions})

    def get_group(self, group_id: str) -> dict:
        return self._request("GET", self._group_path(group_id))

    def ruler(
        self,
        group_id: str,
        judge_model: str,
        rubric: str | None = None,
        judge_api_base: str | None = None,
        *,
        timeout: float = RULER_TIMEOUT,
    ) -> list[Score]:
        body = self._request(
            "POST",
            self._group_path(group_id, "/ruler"),
            self._ruler_body(judge_model, rubric, judge_api_base),
            timeout=timeout,
        )
        return scores_from(body)

    # -- lifecycle

    def close(self) -> None:
        if self._openai is not None:
            self._openai.close()
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> RLProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRLProxy(_ClientBase):
    """asyncio client; same methods as `RLProxy`, awaited. Use with `async with` or `await close()`."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        http_client: httpx.AsyncClient | None = None,
    ):
        super().__init__(base_url, api_key, timeout=timeout, max_retries=max_retries)
        self._sleep = asyncio.sleep
        self._http = http_client or httpx.AsyncClient(timeout=timeout)
        self._owns_http = http_client is None
        self._openai: Any = None

    def openai_base(self) -> Any:
        """The one `openai.AsyncOpenAI` whose pool every session's client shares (made on first use)."""
        if self._openai is None:
            self._openai = _import_openai().AsyncOpenAI(**self._openai_options())
        return self._openai

    def session(
        self,
        group: str | Any | None = None,
        split: str | None = None,
        session_id: str | None = None,
        *,
        task_id: str | None = None,
    ) -> AsyncSession:
        if isinstance(group, _GroupBase):
            return group._new_session(AsyncSession, session_id, split, task_id)
        return AsyncSession(self, session_id or new_id("sess"), group, split or "train", task_id)

    def group(self, id: str | None = None, split: str = "train") -> AsyncGroup:
        return AsyncGroup(self, id or new_id("grp"), split)

    async def _request(self, method: str, path: str, json: Any = None, timeout: float | None = None) -> dict:
        attempt = 0
        while True:
            try:
                return await self._send(method, path, json, timeout or self.timeout, attempt + 1)
            except RLProxySDKError as error:
                delay = self._retry_delay(error, method, path, attempt)
                if delay is None:
                    raise
            await self._sleep(delay)
            attempt += 1

    async def _send(self, method: str, path: str, json: Any, timeout: float, tries: int) -> dict:
        try:
            response = await self._http.request(
                method, self.api_base + path, json=json, headers=self._auth_headers(), timeout=timeout
            )
        except httpx.HTTPError as exc:
            raise connection_error(exc, self._shown_base, method, path, timeout, tries) from exc
        return json_body(response, self._shown_base, path)

    async def reward(self, session_id: str, value: float, metrics: dict[str, float] | None = None) -> dict:
        return await self._request("POST", self._session_path(session_id, "/reward"), self._reward_body(value, metrics))

    async def get_session(self, session_id: str) -> dict:
        return await self._request("GET", self._session_path(session_id))

    async def discard(self, session_id: str, reason: str | None = None) -> dict:
        return await self._request("POST", self._session_path(session_id, "/discard"), self._discard_body(reason))

    async def close_group(self, group_id: str, expected_sessions: int | None = None) -> dict:
        return await self._request(
            "POST", self._group_path(group_id, "/close"), {"expected_sessions": expected_sessions}
        )

    async def get_group(self, group_id: str) -> dict:
        return await self._request("GET", self._group_path(group_id))

    async def ruler(
        self,
        group_id: str,
        judge_model: str,
        rubric: str | None = None,
        judge_api_base: str | None = None,
        *,
        timeout: float = RULER_TIMEOUT,
    ) -> list[Score]:
        body = await self._request(
            "POST",
            self._group_path(group_id, "/ruler"),
            self._ruler_body(judge_model, rubric, judge_api_base),
            timeout=timeout,
        )
        return scores_from(body)

    async def close(self) -> None:
        if self._openai is not None:
            await self._openai.close()
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncRLProxy:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
