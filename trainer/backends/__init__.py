"""Training backends, imported only when chosen (`unsloth` needs a GPU and its own stack).

`get_backend(name)` returns the backend class; see `trainer.backends.base.TrainingBackend`
for what one implements.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from typing import TYPE_CHECKING

from gateway.errors import ConfigError

if TYPE_CHECKING:
    from gateway.settings import Settings
    from trainer.backends.base import TrainingBackend
    from trainer.distributed.team import Team

log = logging.getLogger("rlproxy.trainer")

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


MAX_TORCH_THREADS = 4096


def torch_threads() -> int | None:
    """RLPROXY_TORCH_THREADS, the trainer's share of this machine's cores (set by `serve` and the demo, or
    by hand); None when unset. Checked when `serve` or `train` starts: `abc` ended the trainer in int()'s
    ValueError traceback (under `serve`, at every restart of the trainer), 0 in torch's RuntimeError."""
    value = os.environ.get("RLPROXY_TORCH_THREADS", "").strip()
    if not value:
        return None
    if not (value.isascii() and value.isdigit() and 1 <= int(value) <= MAX_TORCH_THREADS):
        raise ConfigError(
            f"RLPROXY_TORCH_THREADS={value[:20]!r} is not a number of threads: give a whole number from 1 to "
            f"{MAX_TORCH_THREADS} (the trainer's CPU threads), or unset it"
        )
    return int(value)


def load_backend(settings: Settings, team: Team | None = None) -> TrainingBackend:
    """`settings.backend` loaded (seeded: a fresh adapter is the same on every run and every rank),
    on `team`'s ranks when given."""
    import torch

    torch.manual_seed(settings.seed)
    threads = torch_threads()
    if threads and team is None:  # a rank's share was set when it joined
        # Beside a local engine on the same cores, two processes each spinning one
        # OpenMP thread per core make both many times slower: `serve` gives each half.
        torch.set_num_threads(threads)
    started = time.perf_counter()
    backend = get_backend(settings.backend)(settings)
    if team is not None:
        backend.attach_team(team)
    if team is None or team.is_leader:
        log.info(
            "trainer: %s on %s, %d LoRA parameters, loaded in %.1f s",
            settings.base_model,
            backend.device,
            backend.trainable_parameters(),
            time.perf_counter() - started,
        )
    return backend


def rows_within_context(settings: Settings, backend: TrainingBackend) -> Settings:
    """`settings` with `max_tokens_per_row` no longer than the base model's context. A recorded
    sample can be longer than the model reads (an upstream's, re-rendered, or a teacher's): fed
    whole, its later positions have no embedding (GPT-2: an IndexError, the step failed) or lie
    past the context a rotary model was configured for, which it never served (the engines refuse
    a request past it). Cut to the context, it trains its first tokens, as one longer than a row
    does (`trainer.data.fit_to_rows`)."""
    context = backend.context_length
    if context is None or context >= settings.max_tokens_per_row:
        return settings
    if backend.team is None or backend.team.is_leader:  # every rank caps alike (they pack the same rows)
        log.info(
            "the base model reads %d positions (its config's context), fewer than --max-tokens-per-row %d: "
            "rows take %d tokens, and a sample longer than that is trained on its first %d",
            context,
            settings.max_tokens_per_row,
            context,
            context,
        )
    return settings.model_copy(update={"max_tokens_per_row": context})
