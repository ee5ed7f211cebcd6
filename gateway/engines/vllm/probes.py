"""What the engine asks a vLLM at start: the names it serves, its logprobs mode, its sleep endpoints.

An attached vLLM (`--vllm-url`) may call the base model by another name
(`--served-model-name`), and rlproxy cannot set its flags: it must run with
`--generation-config vllm --logprobs-mode processed_logprobs`. A one-token probe with
top_k = 1 tells: processed logprobs give exactly 0 for it, raw ones do not; rlproxy warns then.
"""

from __future__ import annotations

import logging

from gateway.engines.vllm.client import VLLMClient
from gateway.engines.vllm.wire import loads
from gateway.errors import RLProxyError
from gateway.settings import TINY_MODEL_ID

log = logging.getLogger("rlproxy.engines.vllm")


async def detect_base_model(client: VLLMClient, base_model: str) -> tuple[str, str, int | None] | None:
    """vLLM's name for the base model, the name the gateway serves it under and the context
    length vLLM's model cards carry; None when `/v1/models` cannot be read.

    An attached server may use --served-model-name: its one root model is the base model then,
    and attached without --base-model (the tiny model's id), the gateway serves it under
    vLLM's name."""
    try:
        data = await client.get_json("/v1/models")
    except RLProxyError:
        return None
    cards = data.get("data") or []
    ids = [card.get("id") for card in cards]
    lengths = [card.get("max_model_len") for card in cards if isinstance(card.get("max_model_len"), int)]
    max_model_len = max(lengths) if lengths else None
    if base_model in ids:
        return base_model, base_model, max_model_len
    roots = [card.get("id") for card in cards if not card.get("parent")]
    if len(roots) != 1:
        return base_model, base_model, max_model_len
    log.info("vLLM serves the base model as '%s'", roots[0])
    return roots[0], (roots[0] if base_model == TINY_MODEL_ID else base_model), max_model_len


async def check_logprobs_mode(client: VLLMClient, vllm_base: str) -> bool | None:
    """Does the vLLM return processed logprobs? One token at top_k = 1: under
    processed_logprobs the only unmasked token has logprob exactly 0. Warns when it has not;
    returns True/False, or None when the probe could not tell."""
    probe = {
        "model": vllm_base,
        "messages": [{"role": "user", "content": "Say OK."}],
        "max_tokens": 1,
        "temperature": 1.0,
        "top_k": 1,
        "top_p": 1.0,
        "logprobs": True,
        "top_logprobs": 0,
    }
    try:
        status, payload = await client.post("/v1/chat/completions", probe)
        content = (loads(payload, "a chat completion")["choices"][0].get("logprobs") or {}).get("content")
        value = float(content[0]["logprob"]) if status == 200 and content else None
    except (RLProxyError, KeyError, IndexError, TypeError, ValueError):
        value = None
    if value is None:
        log.info("could not check the attached vLLM's --logprobs-mode; it must be processed_logprobs")
        return None
    if abs(value) > 1e-3:
        log.warning(
            "the vLLM at %s returns raw logprobs (a top_k=1 token got %.4f, not 0): behaviour logprobs "
            "will be wrong and the trainer's importance weights with them. Restart it with "
            "--logprobs-mode processed_logprobs --generation-config vllm",
            client.url,
            value,
        )
        return False
    return True


async def has_sleep_endpoints(client: VLLMClient) -> bool:
    """Whether `/sleep` and `/wake_up` exist: whether `GET /is_sleeping` answers."""
    try:
        await client.get_json("/is_sleeping")
    except RLProxyError:
        return False
    return True
