"""What the engine asks a vLLM at start: the names it serves, its logprobs mode, its sleep endpoints.

An attached vLLM (`--vllm-url`) may call the base model by another name
(`--served-model-name`), and rlproxy cannot set its flags: it must run with
`--generation-config vllm --logprobs-mode processed_logprobs`. The same one-token chat at
temperature 1 and 1/2 tells: processed logprobs are of logits / T, so the gap between two top
tokens' logprobs doubles; raw ones (vLLM's default) do not change; rlproxy warns then.
"""

from __future__ import annotations

import logging
import math

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


PROBE_SHARPEN = 2.0  # the second call's temperature is 1 / this
PROBE_TOP_LOGPROBS = 5  # within vLLM's default --max-logprobs (20)
PROBE_MIN_GAP = 0.02  # a smaller gap between the top tokens at T = 1 is too close to measure


async def check_logprobs_mode(client: VLLMClient, vllm_base: str) -> bool | None:
    """Does the vLLM return processed logprobs? The same one-token chat at temperature 1 and at
    temperature 1/2, everything else off (top_k, top_p, min_p, penalties), with the top
    logprobs of the first position: it depends on the prompt alone, not on what was sampled.
    Processed logprobs are the log-softmax of logits / T, so the gap between two tokens'
    logprobs doubles at T = 1/2; raw ones (the model's log-softmax, vLLM's default) stay the same.
    Warns when they are raw; returns True/False, or None when the probe could not tell (no
    answer, or top tokens too close to measure a gap)."""
    at_1 = await _top_logprobs(client, vllm_base, 1.0)
    at_half = await _top_logprobs(client, vllm_base, 1 / PROBE_SHARPEN)
    verdict, detail = _judge(at_1, at_half)
    if verdict is None:
        log.info(
            "could not check the attached vLLM's --logprobs-mode (%s); it must be processed_logprobs",
            detail,
        )
    elif not verdict:
        log.warning(
            "the vLLM at %s returns %s: behaviour logprobs will be wrong and the "
            "trainer's importance weights with them. Restart it with "
            "--logprobs-mode processed_logprobs --generation-config vllm",
            client.url,
            detail,
        )
    return verdict


async def _top_logprobs(client: VLLMClient, vllm_base: str, temperature: float) -> dict[str, float] | None:
    """{token: logprob} of the first position's top tokens at `temperature`; None when vLLM did
    not answer with them. A token text that two token ids share is left out."""
    probe = {
        "model": vllm_base,
        "messages": [{"role": "user", "content": "Say OK."}],
        "max_tokens": 1,
        "temperature": temperature,
        "top_k": -1,
        "top_p": 1.0,
        "min_p": 0.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "logprobs": True,
        "top_logprobs": PROBE_TOP_LOGPROBS,
    }
    try:
        status, payload = await client.post("/v1/chat/completions", probe)
        if status != 200:
            return None
        content = (loads(payload, "a chat completion")["choices"][0].get("logprobs") or {}).get("content") or []
        entries = [(str(e["token"]), float(e["logprob"])) for e in content[0]["top_logprobs"]]
    except (RLProxyError, KeyError, IndexError, TypeError, ValueError):
        return None
    texts = [text for text, _ in entries]
    found = {text: value for text, value in entries if texts.count(text) == 1 and math.isfinite(value)}
    return found or None


def _judge(at_1: dict[str, float] | None, at_half: dict[str, float] | None) -> tuple[bool | None, str]:
    """(processed?, why) from the top logprobs at T = 1 (`at_1`) and at T = 1/2 (`at_half`)."""
    if at_1 is None or at_half is None:
        return None, "no top logprobs in its answer"
    if any(value > 1e-4 for value in (*at_1.values(), *at_half.values())):
        return False, "logits, not logprobs (--logprobs-mode raw_logits or processed_logits)"
    shared = [text for text in at_1 if text in at_half]
    if len(shared) < 2:
        return None, "the two calls' top tokens differ"
    best = max(shared, key=lambda text: at_1[text])
    other = min(shared, key=lambda text: at_1[text])
    gap_at_1, gap_at_half = at_1[best] - at_1[other], at_half[best] - at_half[other]
    if gap_at_1 < PROBE_MIN_GAP:
        return None, f"its top tokens are within {gap_at_1:.4f} of each other"
    ratio = gap_at_half / gap_at_1
    detail = f"the gap between two top tokens' logprobs went from {gap_at_1:.4f} at T=1 to {gap_at_half:.4f} at T=0.5"
    if abs(ratio - PROBE_SHARPEN) <= 0.25:
        return True, detail
    if abs(ratio - 1.0) <= 0.25:
        return False, f"raw logprobs ({detail}, where processed ones double)"
    return None, detail + ": neither the same (raw) nor doubled (processed)"


async def has_sleep_endpoints(client: VLLMClient) -> bool:
    """Whether `/sleep` and `/wake_up` exist: whether `GET /is_sleeping` answers."""
    try:
        await client.get_json("/is_sleeping")
    except RLProxyError:
        return False
    return True
