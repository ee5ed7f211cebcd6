"""A session is one rollout: the calls an agent makes on one task, and the reward it earned.

The ids are minted before the first call, so every call the agent makes carries
them as headers and the reward can be posted at the end. A session of live traffic has no
group but a task key (`task_id`, sent as `X-Task-Id`): the gateway gathers rewarded sessions
of one task into groups itself (`rlproxy serve --live-group-size K`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from sdk.types import header_id

if TYPE_CHECKING:  # the client imports this module, to make sessions
    from sdk.client import AsyncRLProxy, RLProxy


class _SessionBase:
    def __init__(self, proxy: Any, id: str, group_id: str | None, split: str, task_id: str | None = None):
        if split not in ("train", "val"):
            raise ValueError(f"split '{split}' is not valid: use 'train' or 'val'")
        self.proxy = proxy
        self.id = header_id(id, "session_id")
        self.group_id = None if group_id is None else header_id(group_id, "group_id")
        self.split = split
        # the task key (X-Task-Id) live groups are formed by
        self.task_id = None if task_id is None else header_id(task_id, "task_id")
        self.index: int | None = None  # position in `group.run`, if it made this session
        self.discarded = False  # discarded on the gateway through this object

    def headers(self) -> dict[str, str]:
        """The headers that tie a call to this session; add them to any HTTP or LLM client."""
        headers = {"X-Session-Id": self.id, "X-Split": self.split}
        if self.group_id is not None:
            headers["X-Group-Id"] = self.group_id
        if self.task_id is not None:
            headers["X-Task-Id"] = self.task_id
        return headers

    def base_url(self, v1: bool = True) -> str:
        """This session's own base URL, `{gateway}/groups/{group}/sessions/{id}/v1` (or
        `/tasks/{task}/...`, or no group): for a client that takes a base URL and a key but no
        headers (a CLI agent's OPENAI_BASE_URL). `v1=False` leaves `/v1` off, for Anthropic's
        client, which adds it itself. The URL has no place for the split: a val session's
        calls need `headers()`."""
        if self.split != "train":
            raise ValueError(
                f"session {self.id!r} is a '{self.split}' session and a base URL cannot carry the split (calls "
                "through it count as 'train'): send headers() with its calls instead"
            )
        if self.group_id is not None and self.task_id is not None:
            raise ValueError(
                f"session {self.id!r} has a group and a task_id, and a base URL names one: send headers() instead"
            )
        prefix = ""
        if self.group_id is not None:
            prefix = f"/groups/{quote(self.group_id, safe='')}"
        elif self.task_id is not None:
            prefix = f"/tasks/{quote(self.task_id, safe='')}"
        root = self.proxy.api_base.removesuffix("/v1")
        return f"{root}{prefix}/sessions/{quote(self.id, safe='')}" + ("/v1" if v1 else "")

    def openai_client(self, **options: Any):
        """An OpenAI client (`OpenAI`, or `AsyncOpenAI` for an async session) pointed at the
        gateway, whose calls belong to this session. `options` as for `client.with_options`
        (`max_retries`, `timeout`, `default_headers`, ...).

        It shares one connection pool with every session of the same `RLProxy`, so making
        one per rollout costs nothing; the pool closes with the `RLProxy`.
        """
        headers = {**self.headers(), **(options.pop("default_headers", None) or {})}
        return self.proxy.openai_base().with_options(default_headers=headers, **options)

    def __repr__(self) -> str:
        task = f", task_id={self.task_id!r}" if self.task_id is not None else ""
        return f"{type(self).__name__}(id={self.id!r}, group_id={self.group_id!r}, split={self.split!r}{task})"


class Session(_SessionBase):
    """Blocking session; made by `RLProxy.session()` or `Group.session()`."""

    proxy: RLProxy

    def reward(self, value: float, metrics: dict[str, float] | None = None) -> dict:
        """Post this session's reward (after its first call); `metrics` are kept beside it."""
        return self.proxy.reward(self.id, value, metrics)

    def get(self) -> dict:
        """The recorded trajectory: calls, reward, metrics."""
        return self.proxy.get_session(self.id)

    def discard(self, reason: str | None = None) -> dict:
        """Leave this session out of its group (the rollout failed): the group no longer
        waits for its reward and the trainer never trains on it; its calls stay recorded.
        `NotFoundError` if it made no call yet (then there is nothing to discard)."""
        body = self.proxy.discard(self.id, reason)
        self.discarded = True
        return body

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        pass  # nothing to release: clients share the RLProxy's pool


class AsyncSession(_SessionBase):
    """asyncio session; made by `AsyncRLProxy.session()` or `AsyncGroup.session()`."""

    proxy: AsyncRLProxy

    async def reward(self, value: float, metrics: dict[str, float] | None = None) -> dict:
        return await self.proxy.reward(self.id, value, metrics)

    async def get(self) -> dict:
        return await self.proxy.get_session(self.id)

    async def discard(self, reason: str | None = None) -> dict:
        body = await self.proxy.discard(self.id, reason)
        self.discarded = True
        return body

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass
