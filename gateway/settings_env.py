"""`RLPROXY_*` variables that no setting and nothing else of rlproxy reads.

Settings ignores the variables it has no field for (`extra="ignore"`), so a misspelt one,
RLPROXY_APIKEY for RLPROXY_API_KEY, was dropped without a word and the gateway ran without its key.
The command the user ran says so once, never with the value (it may be a key); the processes it
starts (the trainer, its ranks) get the environment without them, so they do not say it again.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from gateway.settings import Settings

PREFIX = "RLPROXY_"
OTHER_VARIABLES = frozenset(
    PREFIX + name
    for name in (
        *("CACHE_DIR", "JUDGE_API_KEY", "TORCH_THREADS", "URL", "SMOLLM2_WHEEL", "WORD_LIST"),
        *("LOOPBACK_STORE", "STORE_FD"),  # set by `train --nproc N` for its ranks (trainer/distributed/)
        *("TEST_PAUSE_AT", "TEST_PAUSE_SECONDS", "TEST_POSTGRES", "TEST_VLLM_PYTHON"),  # test hooks
        *("UPDATE_SCREENSHOT", "CHROMIUM", "NGINX", "BENCH_YAPPI"),  # tests/ and bench/
    )
)
"""What rlproxy, its SDK, tests and benches read besides the settings' own variables."""


def _settings_variables() -> set[str]:
    return {PREFIX + name.upper() for name in Settings.model_fields}


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """The RLPROXY_* names in `environ` that nothing reads (Settings reads them case-insensitively)."""
    known = _settings_variables() | OTHER_VARIABLES
    return sorted(key for key in environ if key.upper().startswith(PREFIX) and key.upper() not in known)


def unknown_variables_warning(environ: Mapping[str, str]) -> str | None:
    """One line naming each variable nothing reads and the closest setting's, without their values."""
    unknown = unknown_variables(environ)
    if not unknown:
        return None
    said = []
    for key in unknown:
        close = difflib.get_close_matches(key.upper(), sorted(_settings_variables() | OTHER_VARIABLES), n=1)
        said.append(f"{key} (did you mean {close[0]}?)" if close else key)
    return f"{', '.join(said)}: no such variable, ignored (`rlproxy serve --help` lists each setting's)"


def without_unknown(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` for a child process of rlproxy's: the command that started it has said the rest once."""
    unknown = set(unknown_variables(environ))
    return {key: value for key, value in environ.items() if key not in unknown}
