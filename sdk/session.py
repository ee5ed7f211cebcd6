"""A session is one rollout: the calls an agent makes on one task, and the reward it earned.

The ids are minted here, before the first call, so every call the agent makes
carries them as headers and the reward can be posted at the end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sdk.errors import RLProxySDKError

if TYPE_CHECKING:
    from sdk.client import AsyncRLProxy, RLProxy


class _SessionBase:
    def __init__(self, proxy: Any, id: str, group_id: str | None, split: str):
        if split not in ("train", "val"):
            raise ValueError(f"split '{split}' is not valid: use 'train' or 'val'")
        self.proxy = proxy
        self.id = id
        self.group_id = group_id
        self.split = split
        self.index: int | None = None  # position in `group.run`, if it made this session
        self._clients: list[Any] = []

    def headers(self) -> dict[str, str]:
        """The headers that tie a call to this session; add them to any HTTP or LLM client."""
        headers = {"X-Session-Id": self.id, "X-Split": self.split}
        if self.group_id is not None:
            headers["X-Group-Id"] = self.group_id
        return headers

    def _openai_kwargs(self, kwargs: dict) -> dict:
        extra_headers = kwargs.pop("default_headers", None) or {}
        return {
            "base_url": self.proxy.api_base,
            # The OpenAI client insists on a key; a gateway without one ignores it.
            "api_key": self.proxy.api_key or "rlproxy",
            "default_headers": {**self.headers(), **extra_headers},
            **kwargs,
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, group_id={self.group_id!r}, split={self.split!r})"


def _import_openai():
    try:
        import openai
    except ImportError:  # the SDK itself needs httpx only
        raise RLProxySDKError(
            "session.openai_client() needs the openai package (pip install openai); "
            "or pass session.headers() to the client you use"
        ) from None
    return openai


class Session(_SessionBase):
    """Blocking session; made by `RLProxy.session()` or `Group.session()`."""

    proxy: "RLProxy"

    def openai_client(self, **kwargs: Any):
        """An `openai.OpenAI` pointed at the gateway whose calls belong to this session."""
        client = _import_openai().OpenAI(**self._openai_kwargs(kwargs))
        self._clients.append(client)
        return client

    def reward(self, value: float, metrics: dict[str, float] | None = None) -> dict:
        """Post this session's reward (after its first call); `metrics` are kept beside it."""
        return self.proxy.reward(self.id, value, metrics)

    def get(self) -> dict:
        """The recorded trajectory: calls, reward, metrics."""
        return self.proxy.get_session(self.id)

    def close(self) -> None:
        """Close the OpenAI clients this session made."""
        while self._clients:
            self._clients.pop().close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSession(_SessionBase):
    """asyncio session; made by `AsyncRLProxy.session()` or `AsyncGroup.session()`."""

    proxy: "AsyncRLProxy"

    def openai_client(self, **kwargs: Any):
        """An `openai.AsyncOpenAI` pointed at the gateway whose calls belong to this session."""
        client = _import_openai().AsyncOpenAI(**self._openai_kwargs(kwargs))
        self._clients.append(client)
        return client

    async def reward(self, value: float, metrics: dict[str, float] | None = None) -> dict:
        return await self.proxy.reward(self.id, value, metrics)

    async def get(self) -> dict:
        return await self.proxy.get_session(self.id)

    async def close(self) -> None:
        while self._clients:
            await self._clients.pop().close()

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
