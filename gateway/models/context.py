"""The context a model's config states: the positions it reads, prompt and completion together.

One reading for the local engine (which refuses a request past it) and the trainer (which
caps its rows at it), so what is served and what is trained end at the same position. It is
vLLM's reading of the same config (its derived `max_model_len`): `max_position_embeddings`,
times the RoPE scaling factor where the rotation is stretched to reach further (linear,
dynamic NTK, YaRN). Where the config is unclear the larger reading wins: a context read too
long trains a position or two the model was not configured for, one read too short would cut
samples the engine served whole.
"""

from __future__ import annotations

from typing import Any

UNSCALED = frozenset({None, "default", "llama3", "longrope", "su", "mrope"})
"""RoPE types whose `max_position_embeddings` is already the whole context: Llama 3's and
LongRoPE's configs state the extended length there, M-RoPE and the default do not stretch."""

SCALED_ALREADY = frozenset({"gemma3", "gemma3_text"})
"""Model types whose `max_position_embeddings` is the context after their (linear) scaling, as
vLLM reads them too: Gemma 3 states 131072 beside a factor of 8."""


def stated_context(config: Any) -> int | None:
    """The positions `config` (a transformers config) says the model reads; None where it does
    not say (no `max_position_embeddings`, or not a positive number)."""
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, bool) or not isinstance(positions, int) or positions <= 0:
        return None
    # transformers 5 calls it rope_parameters (per layer type on some models), 4 rope_scaling
    if getattr(config, "model_type", None) in SCALED_ALREADY:
        return positions
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return max([positions, *(scaled(positions, p) for p in rope_dicts(rope))])


def rope_dicts(rope: Any) -> list[dict]:
    """A config's RoPE parameters as a list of flat dicts: one, or one per layer type."""
    if not isinstance(rope, dict):
        return []
    if "rope_type" in rope or "type" in rope or "factor" in rope:
        return [rope]
    return [value for value in rope.values() if isinstance(value, dict)]


def scaled(positions: int, rope: dict) -> int:
    """The context one set of RoPE parameters reaches from `positions` (vLLM's rule)."""
    kind = rope.get("rope_type", rope.get("type"))
    factor = rope.get("factor")
    if kind in UNSCALED or isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 1:
        return positions
    if kind == "yarn":
        original = rope.get("original_max_position_embeddings")
        if isinstance(original, int) and not isinstance(original, bool) and original > 0:
            return int(original * factor)
    return int(positions * factor)
