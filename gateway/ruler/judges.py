"""How the gateway reaches a judge: litellm (any provider id, or any OpenAI-compatible URL)
or its own engine (`self`). A judge is a function from (messages, response_format) to
the answer's text; RULER (`gateway.ruler.scoring`) builds the messages and checks the answer.

Judge keys come from the environment (litellm reads OPENAI_API_KEY, ANTHROPIC_API_KEY,
...) and are never stored, logged or echoed: error messages are scrubbed of them.
"""

from __future__ import annotations

import asyncio
import os
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.errors import UpstreamError

SELF_JUDGE = "self"  # judge_model that means: the model this gateway serves
JUDGE_TIMEOUT = 600.0  # seconds for one judge call; reasoning judges think long

JudgeCall = Callable[[list[dict], dict], Awaitable[str | None]]  # (messages, response_format) -> content


class JudgeError(UpstreamError):
    """The judge could not be reached, failed, or answered wrongly twice."""

    error_type = "judge_error"


_SECRET_NAME = re.compile(r"(KEY|SECRET|TOKEN|PASSWORD)", re.IGNORECASE)


def redact(text: str) -> str:
    """Remove any secret from the environment that an error message might quote."""
    for name, value in os.environ.items():
        if len(value) >= 8 and _SECRET_NAME.search(name) and value in text:
            text = text.replace(value, "***")
    return text


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


def litellm_judge(model: str, api_base: str | None = None, timeout: float = JUDGE_TIMEOUT) -> JudgeCall:
    """A judge reached through litellm: a provider id (`openai/o3`, `anthropic/...`) with its key
    from the environment, or any OpenAI-compatible server at `api_base`."""

    async def call(messages: list[dict], response_format: dict) -> str | None:
        litellm = await _litellm()
        kwargs: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "response_format": response_format,
            "timeout": timeout,
            "caching": False,
            "drop_params": True,
        }
        if api_base:
            kwargs["api_base"] = api_base
            if model.split("/", 1)[0] not in litellm.provider_list:
                kwargs["custom_llm_provider"] = "openai"  # `my-model` at an OpenAI-compatible URL
            # The URL comes with the request, so the provider keys in the environment must not
            # go there: only the key meant for such a judge. A local judge often wants none,
            # but the OpenAI client insists on one.
            kwargs["api_key"] = os.environ.get("RLPROXY_JUDGE_API_KEY") or "EMPTY"
        try:
            response = await litellm.acompletion(**kwargs)
        except Exception as exc:  # litellm raises its own zoo; the caller wants one kind
            raise JudgeError(f"the judge '{model}' failed: {redact(str(exc))[:1000]}") from None
        if not response.choices:
            return None
        return response.choices[0].message.content

    return call


def engine_judge(services: Any, timeout: float = JUDGE_TIMEOUT) -> JudgeCall:
    """The gateway's own served model as judge; its calls are not recorded (no training on them)."""
    from gateway.engines.base import EngineRequest

    async def call(messages: list[dict], response_format: dict) -> str | None:
        registry, engine = services.registry, services.engine
        name = services.settings.model_name if engine.supports_adapters else engine.base_model_id
        try:
            async with services.gate.passage(), registry.use(name) as target:
                body = {
                    "model": target.model,
                    "messages": messages,
                    "response_format": response_format,
                    "max_tokens": services.settings.default_max_tokens * 4,
                }
                request = EngineRequest(body=body, adapter=target.adapter, request_id="ruler_" + uuid.uuid4().hex)
                completion = await asyncio.wait_for(engine.complete(request), timeout)
        except asyncio.TimeoutError:
            raise JudgeError(f"the judge '{SELF_JUDGE}' did not answer within {timeout:.0f} s") from None
        except Exception as exc:
            raise JudgeError(f"the judge '{SELF_JUDGE}' failed: {redact(str(exc))[:1000]}") from None
        choices = completion.response.get("choices") or []
        return (choices[0].get("message") or {}).get("content") if choices else None

    return call
