"""The one interface every engine implements.

An engine turns a validated OpenAI chat request into an OpenAI response (or a
stream of chunks) plus the token record the trainer needs: prompt token ids and,
for every choice, the sampled completion ids and their logprobs. Engines that
cannot see tokens (`openai`) return `tokens=None`; the trainer re-renders those.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from gateway.errors import ConfigError, NotFound
from gateway.http.limits import check_room
from gateway.redact import redact


def check_base_url(flag: str, url: str) -> None:
    """A base URL flag (--upstream-url, --vllm-url) parsed at start as the HTTP clients will parse it:
    a port out of range or not a number, a broken IPv6 address or no host was the client's ValueError
    traceback. The message leaves the URL out: it may hold a password."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - read for its ValueError
    except ValueError as exc:
        raise ConfigError(f"{flag} is not a URL ({exc}): give a base URL such as http://HOST:PORT/v1") from None
    if not parts.hostname:
        raise ConfigError(f"{flag} names no host: give a base URL such as http://HOST:PORT/v1")


@dataclass
class ChoiceTokens:
    """What one choice sampled."""

    completion_ids: list[int]
    # Behaviour logprobs: log mu(token) of each sampled token under the distribution it was
    # actually drawn from (temperature, then penalties, then top-k, then top-p, renormalised).
    # None where the engine cannot know it (an upstream's sampling is not ours to see).
    logprobs: list[float] | None


@dataclass
class TokenRecord:
    """Token-level record of one call, index-aligned with the response's choices."""

    prompt_ids: list[int] | None
    choices: list[ChoiceTokens] = field(default_factory=list)
    sampling: dict | None = None
    """The sampling parameters in force for this call, every one explicit (no engine default
    left implicit): temperature, top_p, top_k, min_p, presence_penalty, frequency_penalty,
    repetition_penalty, seed, max_tokens. The trainer scores each sample at its temperature."""


@dataclass
class EngineRequest:
    """A chat request on its way to an engine."""

    body: dict  # the OpenAI request as JSON-able dict; `model` is what the engine should be asked for
    adapter: str | None  # loaded adapter name such as "agent@3"; None = the base model
    request_id: str
    # Work no client waits for (shadow samples, gateway/shadow/): the local engine runs it only
    # while no other request is in it and sets it aside when one arrives (it continues later
    # from its tokens so far); vLLM schedules it at a lower priority than live calls.
    background: bool = False
    # What the call is routed by where an engine has several replicas (gateway/engines/vllm/routing.py):
    # its session, whose prompt prefix the replica that answered it before has cached. None: any.
    session: str | None = None


@dataclass
class Completion:
    """A finished non-stream call."""

    response: dict  # the chat.completion object exactly as the client will see it
    tokens: TokenRecord | None


@dataclass
class StreamChunk:
    """One chat.completion.chunk to forward to the client."""

    data: dict
    raw: bytes | None = None  # the chunk already serialised, when the engine has it (relay without re-encoding)


@dataclass
class StreamEnd:
    """Last item of every stream: the token record (or None)."""

    tokens: TokenRecord | None


class Engine(ABC):
    """Produces chat completions; optionally serves LoRA adapters by name."""

    kind: str = "base"
    supports_adapters: bool = False
    # Whether `load_adapter_on_demand` may leave a step loaded in only part of the engine (some
    # replicas): such a step is loaded again with `load_adapter` before it serves as NAME.
    partial_loads: bool = False
    # Whether a stream honours vLLM's `stream_options.continuous_usage_stats` (usage in every
    # chunk, the prompt's tokens from the first): Anthropic's message_start reports them.
    continuous_usage: bool = False

    @property
    def context_length(self) -> int | None:
        """Tokens the model takes, prompt and completion together; None when unknown. The
        gateway refuses a request asking for more before it reaches the engine."""
        return None

    @property
    @abstractmethod
    def base_model_id(self) -> str:
        """The id under which the base model (no adapter) is served."""

    async def start(self) -> None:  # noqa: B027 (an optional hook: most engines have nothing to start)
        """Acquire resources (load weights, open pools, start a server)."""

    async def close(self) -> None:  # noqa: B027 (an optional hook, like start)
        """Release everything `start` acquired."""

    @abstractmethod
    async def complete(self, request: EngineRequest) -> Completion:
        """Answer a non-stream request. Raise `gateway.errors` types on failure."""

    @abstractmethod
    def stream(self, request: EngineRequest) -> AsyncIterator[StreamChunk | StreamEnd]:
        """Yield chunks as they are produced, then exactly one `StreamEnd`."""

    async def count_tokens(self, body: dict) -> int:
        """The prompt tokens a chat request renders to (the served model's chat template and
        tokenizer, tools included): Anthropic's `count_tokens`. Nothing is generated or recorded."""
        # A 404, as from a server without the route: clients that count (Claude Code) then estimate.
        raise NotFound(
            f"the {self.kind} engine cannot count tokens: it has no tokenizer of the model's (the local and "
            "vllm engines count; an upstream that speaks Anthropic's Messages counts by --upstream-protocol messages)",
            code="count_tokens_not_supported",
        )

    async def check_fits(self, body: dict) -> None:
        """Refuse (400 `context_length_exceeded`) a chat request whose prompt leaves no room in the
        context, before any engine work: a legacy completions prompt list checks every prompt
        before the first is answered. An engine that cannot count (no context known, no
        tokenizer) leaves it to `complete`; the local engine checks the completion asked for too."""
        context = self.context_length
        if not context:
            return
        try:
            tokens = await self.count_tokens(body)
        except NotFound:
            return
        check_room(tokens, None, "max_tokens", context)

    async def load_adapter(self, name: str, path: Path) -> None:
        raise NotImplementedError(f"the {self.kind} engine does not serve adapters")

    async def unload_adapter(self, name: str) -> None:
        raise NotImplementedError(f"the {self.kind} engine does not serve adapters")

    async def load_adapter_on_demand(self, name: str, path: Path) -> None:
        """A step asked for by name (`NAME@N`), not served as NAME: engine replicas load it only
        where a call for it goes; one engine loads it as any other."""
        await self.load_adapter(name, path)

    def health(self) -> str | None:
        """None while the engine can serve; otherwise why not (shown by `/healthz`)."""
        return None

    async def probe(self) -> None:
        """Look again while `health()` says the engine cannot serve (`/healthz` calls it, so that
        an engine that came back is seen without a call having to fail first). The vLLM and
        local engines watch themselves: nothing to do."""
        return None

    def replica_states(self, model: str, current: int | None) -> list[dict] | None:
        """Each replica's state, load and step (the newest step of `model` it holds, `current` where
        it has it), for /healthz, /metrics and the dashboard; None: the engine has no replicas."""
        return None

    async def list_models(self) -> list[str]:
        """Model ids this engine answers for besides rlproxy's own names."""
        return [self.base_model_id]


def logged_body(where: str, payload: bytes, secrets: list[str], limit: int = 300) -> str:
    """What the client is told of an upstream's body that is not the protocol's JSON: its size,
    and that the log has it. An error page can name the upstream's internals (hosts, paths,
    users), and the gateway never returns an upstream's raw body: its first `limit` characters
    go to the log alone, redacted."""
    text = payload.decode("utf-8", errors="replace").strip()
    excerpt = text if len(text) <= limit else text[:limit] + "..."
    logging.getLogger("rlproxy.engines").warning(
        "the upstream at %s answered a body that is not the protocol's JSON: %s", where, redact(excerpt, secrets)
    )
    return f"its {len(payload)}-byte body is in the gateway's log"
