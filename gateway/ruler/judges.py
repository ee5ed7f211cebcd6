"""How the gateway reaches a judge: litellm (any provider id, or any OpenAI-compatible URL)
or its own engine (`self`). A judge is a function from (messages, response_format) to
the answer's text; RULER (`gateway.ruler.scoring`) builds the messages and checks the answer.

A request only picks among the judges the operator named (`judge_for`): a model string
reaches wherever litellm routes it (`ollama/...` a local port, `openai/...` with
OPENAI_API_KEY), and a base URL is a place the gateway POSTs to, so both must be on
`--judge-model` / `--judge-api-base` (or be the shadow judge's, or `self`).

Judge keys come from the environment (litellm reads OPENAI_API_KEY, ANTHROPIC_API_KEY,
...; RLPROXY_JUDGE_API_KEY goes to a configured base URL only) and are never stored,
logged or echoed. A failed judge call answers a short reason; what the judge replied goes
to the log only, scrubbed of keys: a judge's reply is not for the client to read.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.errors import InvalidRequest, RLProxyError, UpstreamError
from gateway.redact import redact as redact_secrets
from gateway.tasks import within

SELF_JUDGE = "self"  # judge_model that means: the model this gateway serves
JUDGE_TIMEOUT = 600.0  # seconds for one judge call; reasoning judges think long

JudgeCall = Callable[[list[dict], dict], Awaitable[str | None]]  # (messages, response_format) -> content


class JudgeError(UpstreamError):
    """The judge could not be reached, failed, or answered wrongly twice."""

    error_type = "judge_error"


log = logging.getLogger("rlproxy.ruler")

_SECRET_NAME = re.compile(r"(KEY|SECRET|TOKEN|PASSWORD)", re.IGNORECASE)


def redact(text: str) -> str:
    """Remove any secret from the environment that an error message might quote."""
    for name, value in os.environ.items():
        if len(value) >= 8 and _SECRET_NAME.search(name) and value in text:
            text = text.replace(value, "***")
    return text


def _failed(judge_model: str, exc: BaseException, key: str | None = None) -> JudgeError:
    """The short error a client and the group see; the judge's whole reply goes to the log."""
    text = redact(redact_secrets(str(exc), [key or ""]))
    log.warning("RULER: the judge '%s' failed: %s: %s", judge_model, type(exc).__name__, text[:4000])
    if isinstance(exc, RLProxyError) and not isinstance(exc, UpstreamError):
        return JudgeError(f"the judge '{judge_model}' failed: {text[:500]}")  # our own words, e.g. too long
    refused = _connection_error(exc)
    if refused is not None:
        return JudgeError(
            f"the judge '{judge_model}' failed (could not connect to it: {type(refused).__name__}); "
            "the error is in the gateway's log"
        )
    status = getattr(exc, "status_code", None)
    what = type(exc).__name__ + (f", HTTP {status}" if isinstance(status, int) else "")
    return JudgeError(f"the judge '{judge_model}' failed ({what}); its reply is in the gateway's log")


def _connection_error(exc: BaseException) -> BaseException | None:
    """The refused or failed connection under `exc`, if no judge answered at all: litellm reports
    one as an InternalServerError with status_code 500, which would read as the judge's reply."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if type(cause).__name__ == "APITimeoutError":  # it connected and then said nothing in time
            return None
        if isinstance(cause, ConnectionError) or type(cause).__name__ in ("APIConnectionError", "ConnectError"):
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


_litellm_module: Any = None


async def _litellm() -> Any:
    """Import litellm once, off the event loop (it takes seconds), without its network fetch."""
    global _litellm_module
    if _litellm_module is None:
        # The model cost map is otherwise downloaded at import; the gateway does not phone out.
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        import importlib

        module = await asyncio.to_thread(importlib.import_module, "litellm")
        module.suppress_debug_info = True
        _litellm_module = module
    return _litellm_module


def litellm_judge(
    model: str, api_base: str | None = None, timeout: float | None = None, api_key: str | None = None
) -> JudgeCall:
    """A judge reached through litellm: a provider id (`openai/o3`, `anthropic/...`) with its key
    from the environment, or any OpenAI-compatible server at `api_base` with `api_key`.
    `timeout` (JUDGE_TIMEOUT by default) bounds the whole call, retries included."""

    async def call(messages: list[dict], response_format: dict) -> str | None:
        limit = timeout or JUDGE_TIMEOUT
        litellm = await _litellm()
        kwargs: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "response_format": response_format,
            "timeout": limit,
            "caching": False,
            "drop_params": True,
        }
        if api_base:
            kwargs["api_base"] = api_base
            if model.split("/", 1)[0] not in litellm.provider_list:
                kwargs["custom_llm_provider"] = "openai"  # `my-model` at an OpenAI-compatible URL
            # Never the provider keys in the environment: only the key meant for such a judge
            # (the caller's to choose). A local judge often wants none, but the OpenAI client
            # insists on one.
            kwargs["api_key"] = api_key or "EMPTY"
        try:
            # litellm's timeout bounds each read of the answer, not the call: a judge that sends
            # a byte now and then (a stalled proxy, an endless body) would keep the group
            # "running" and its shadow slot taken for ever. The deadline is the whole call's.
            response = await within(litellm.acompletion(**kwargs), limit)
        except TimeoutError:
            log.warning("RULER: the judge '%s' did not answer within %.0f s", model, limit)
            raise JudgeError(f"the judge '{model}' did not answer within {limit:.0f} s") from None
        except Exception as exc:  # litellm raises its own zoo; the caller wants one kind
            raise _failed(model, exc, api_key) from None
        if not response.choices:
            return None
        return response.choices[0].message.content

    return call


def engine_judge(services: Any, timeout: float | None = None) -> JudgeCall:
    """The gateway's own served model as judge; its calls are not recorded (no training on them)."""
    from gateway.engines.base import EngineRequest

    async def call(messages: list[dict], response_format: dict) -> str | None:
        limit = timeout or JUDGE_TIMEOUT
        registry, engine, gate = services.registry, services.engine, services.gate
        name = services.settings.model_name if engine.supports_adapters else engine.base_model_id
        try:
            completion, called_off = None, False
            while completion is None:  # called off for a colocated trainer's step: asked again after it
                async with gate.passage(), registry.use(name) as target:
                    body = {
                        "model": target.model,
                        "messages": messages,
                        "response_format": response_format,
                        "max_tokens": services.settings.default_max_tokens * 4,
                    }
                    request = EngineRequest(body=body, adapter=target.adapter, request_id="ruler_" + uuid.uuid4().hex)
                    # Asked again, it is not called off again: the next step's handover waits for it as
                    # for a live call. Back-to-back steps (ready groups waiting) take the GPU again within
                    # a second of giving it back, and a judge that thinks longer was never answered.
                    answer = engine.complete(request)
                    completion = await (within(answer, limit) if called_off else _unless_closing(gate, answer, limit))
                if completion is None:
                    called_off = True
                    log.info(
                        "RULER: the judge '%s' was called off: the trainer takes the GPU; asked again after", SELF_JUDGE
                    )
        except TimeoutError:
            raise JudgeError(f"the judge '{SELF_JUDGE}' did not answer within {limit:.0f} s") from None
        except Exception as exc:
            raise _failed(SELF_JUDGE, exc) from None
        choices = completion.response.get("choices") or []
        return (choices[0].get("message") or {}).get("content") if choices else None

    return call


async def _unless_closing(gate: Any, call: Awaitable[Any], limit: float) -> Any:
    """`call`'s completion, or None once the gate starts closing first (asyncio.TimeoutError after
    `limit`). The handover to a colocated trainer waits for every call inside the gate, and a
    judge may think for `limit` (600 s): a judgement is not a client's call and can be asked
    again, so it leaves at once, as a shadow sampling does (cancelled: vLLM drops the request); the
    first time only (`engine_judge`)."""
    task = asyncio.ensure_future(call)
    closing = asyncio.ensure_future(gate.closing())
    try:
        done, _ = await asyncio.wait({task, closing}, timeout=limit, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # out of the engine before the gate counts it out
        if not done:
            raise TimeoutError
        return None
    finally:
        task.cancel()  # cancelled ourselves (shutdown): the engine call goes too
        closing.cancel()


def _bare(url: str) -> str:
    return url.rstrip("/")


def _refused(what: str, value: str, flag: str) -> InvalidRequest:
    shown = value if len(value) <= 200 else value[:200] + "..."
    return InvalidRequest(
        f"{what} '{shown}' is not a judge this gateway may call: the operator allows it by starting the "
        f"gateway with {flag} {shown} (repeatable, exact match)",
        param=what,
        code="judge_not_allowed",
    )


def judge_for(services: Any, judge_model: str, judge_api_base: str | None) -> JudgeCall:
    """The judge a RULER request names, if the operator allowed it (`InvalidRequest` if not).

    Exact matches only: a prefix rule would let `BASE/../internal` or `BASE?` through. A request
    without `judge_api_base` goes where litellm routes the model id (its provider's URL and
    key); the gateway never fills in a configured base, so a request means the same whatever
    else is configured."""
    settings = services.settings
    if judge_model == SELF_JUDGE:
        if judge_api_base:
            raise InvalidRequest("judge_api_base cannot be used with judge_model 'self'", param="judge_api_base")
        return engine_judge(services)
    if judge_api_base is not None and not judge_api_base.startswith(("http://", "https://")):
        raise InvalidRequest(
            f"judge_api_base must start with http:// or https://, got '{judge_api_base[:200]}'", param="judge_api_base"
        )
    if judge_model not in {*settings.judge_model, settings.shadow_judge_model}:
        raise _refused("judge_model", judge_model, "--judge-model")
    if judge_api_base is None:
        return litellm_judge(judge_model)
    bases = {_bare(base) for base in [*settings.judge_api_base, settings.shadow_judge_api_base] if base}
    if _bare(judge_api_base) not in bases:
        raise _refused("judge_api_base", judge_api_base, "--judge-api-base")
    return litellm_judge(judge_model, judge_api_base, api_key=os.environ.get("RLPROXY_JUDGE_API_KEY"))
