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
    # The state dir only matters where RLPROXY_CACHE_DIR is unset (outside pytest's conftest).
    return Path(resolve_base_model(SMOLLM2_MODEL_ID, Path(tempfile.mkdtemp(prefix="rlproxy-smollm2-"))))
