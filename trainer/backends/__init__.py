"""Training backends, imported only when chosen (`unsloth` needs a GPU and its own stack).

`get_backend(name)` returns the backend class; see `trainer.backends.base.TrainingBackend`
for what one implements.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from gateway.errors import ConfigError

if TYPE_CHECKING:
    from trainer.backends.base import TrainingBackend

# name -> "module:Class"; the module is imported by get_backend, never at import time.
BACKENDS: dict[str, str] = {
    "peft": "trainer.backends.peft:PeftBackend",
    "unsloth": "trainer.backends.unsloth:UnslothBackend",
}


def get_backend(name: str) -> type[TrainingBackend]:
    """The backend class registered as `name`."""
    try:
        target = BACKENDS[name]
    except KeyError:
        raise ConfigError(f"unknown training backend '{name}'; choose one of {', '.join(BACKENDS)}") from None
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if exc.name == module_name:  # the backend module itself is not written/installed
            raise ConfigError(f"training backend '{name}' is not available ({exc})") from exc
        raise ConfigError(
            f"training backend '{name}' needs a package that is not installed: {exc.name} "
            f"(install rlproxy's extras, e.g. pip install 'rlproxy[train]' or 'rlproxy[gpu]')"
        ) from exc
    return getattr(module, class_name)
