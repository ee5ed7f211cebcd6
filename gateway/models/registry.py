"""Which directory a `--base-model` loads from: a built-in model's (made on first use in the
model cache: the tiny ones under the state dir, `smollm2` in the user's cache), any other Hugging
Face id or path unchanged."""

from __future__ import annotations

from pathlib import Path

from gateway.errors import ConfigError
from gateway.models.cache import model_cache_dir, user_cache_dir
from gateway.settings import SMOLLM2_MODEL_ID, TINY_INSTRUCT_MODEL_ID, TINY_MODEL_ID


def resolve_base_model(base_model: str, state_dir: Path) -> str:
    """What to pass to `from_pretrained`: a built-in model's directory (built on first use)
    for `TINY_MODEL_ID`, `TINY_INSTRUCT_MODEL_ID` and `SMOLLM2_MODEL_ID`, any other model id
    or path unchanged."""
    if base_model in (TINY_MODEL_ID, TINY_INSTRUCT_MODEL_ID):
        from gateway.models.tiny import ensure_tiny_model

        return str(ensure_tiny_model(model_cache_dir(state_dir), instruct=base_model == TINY_INSTRUCT_MODEL_ID))
    if base_model == SMOLLM2_MODEL_ID:
        from gateway.models.smollm2 import ensure_smollm2

        return str(ensure_smollm2(user_cache_dir()))
    if _names_a_path(base_model) and not Path(base_model).expanduser().is_dir():
        raise ConfigError(
            f"--base-model '{base_model}' is not a directory: give a model directory (config.json and the "
            "weights, as from_pretrained reads them), a Hugging Face id (org/name), or a built-in model"
        )
    return str(Path(base_model).expanduser()) if base_model.startswith("~") else base_model


def _names_a_path(base_model: str) -> bool:
    """A path, not a Hugging Face id (`org/name`: one slash, no leading dot, slash or tilde)."""
    return base_model.startswith(("/", ".", "~")) or base_model.count("/") > 1
