"""rlproxy's client for agents: sessions, groups, rewards and RULER over HTTP (needs httpx only).

from sdk import RLProxy

proxy = RLProxy("http://localhost:8000/v1")
with proxy.group() as group:
    session = group.session()
    client = session.openai_client()          # OpenAI client whose calls belong to the session
    ...                                       # run the agent with `client`
    session.reward(1.0)
"""

from sdk.client import AsyncRLProxy, RLProxy
from sdk.errors import (
    APIConnectionError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RequestTooLargeError,
    RLProxyAPIError,
    RLProxySDKError,
    RolloutsFailed,
    ServerError,
    UnprocessableEntityError,
)
from sdk.group import AsyncGroup, Group, RunResult
from sdk.session import AsyncSession, Session
from sdk.types import Score

__all__ = [
    "RLProxy",
    "AsyncRLProxy",
    "Session",
    "AsyncSession",
    "Group",
    "AsyncGroup",
    "RunResult",
    "Score",
    "RLProxySDKError",
    "RLProxyAPIError",
    "APIConnectionError",
    "APITimeoutError",
    "BadRequestError",
    "AuthenticationError",
    "PermissionDeniedError",
    "NotFoundError",
    "ConflictError",
    "RequestTooLargeError",
    "UnprocessableEntityError",
    "RateLimitError",
    "ServerError",
    "RolloutsFailed",
]
