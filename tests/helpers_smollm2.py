"""The built-in real model, `smollm2`, converted once per test session into the suite's model
cache (tests/conftest.py's RLPROXY_CACHE_DIR), for every test module that needs its files."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from gateway.models.registry import resolve_base_model
from gateway.settings import SMOLLM2_MODEL_ID


@functools.cache
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct's directory (the conversion runs on the first call)."""
    # smollm2 is converted into the model cache, not the state dir: the state dir is a throwaway
    # (one made with mkdtemp was left in /tmp by every run of the suite).
    with tempfile.TemporaryDirectory(prefix="rlproxy-smollm2-") as state_dir:
        return Path(resolve_base_model(SMOLLM2_MODEL_ID, Path(state_dir)))
