"""`rlproxy demo [--task NAME]`: the whole loop on the built-in model, watched as a reward curve.

`driver` runs gateway + trainer + a toy agent (its parts: `options`, `processes`, `agent`,
`summary`) and knows nothing about any task; each task (one of TASKS) is one module of this
package with the same small shape, so a new one is a copy of an old one:

    NAME: str                 the `--task` name
    DESCRIPTION: str          one line, printed at start and kept in summary.json
    OPTIONS: dict             the demo options it needs (`rollouts`, `max_tokens`, `steps`, ...)
    SETTINGS: dict            settings tuned for it (flags and env win), including which
                              built-in model it runs on (`base_model`) if not the default
    sample(rng) -> spec       the task of one group: every rollout of the group gets the same
                              spec (a prompt; for a game, the opponent's dice)
    held_out(n) -> [spec]     optional: the val set's n specs, kept apart from what `sample`
                              draws (else val draws from `sample` with its own seed)
    async episode(spec, chat) -> float | (float, float)
                              one rollout: the agent's side of the conversation, each model
                              call an `await chat(messages)` returning the reply text (None
                              for an empty reply); returns the reward, or (training reward,
                              score) when the task shapes its training reward: the score is
                              what is reported and what `val` sessions are given

Pure game or prompt logic plus the `episode` coroutine: the demo's agent (`agent`) does
every piece of HTTP (session and group headers, rewards, group close), so a task never sees
the gateway.
"""

from __future__ import annotations

import importlib
from types import ModuleType

TASKS = ("shout", "tictactoe", "json")
_MODULES = {"json": "json_answer"}  # a task module named `json` would read as the standard library's
DEFAULT_TASK = "shout"
"""What `rlproxy demo` runs without `--task`: the most convincing task that finishes within
about 5 minutes on 2 CPU cores (docs/demo.md, "What the demo shows")."""


def load_task(name: str) -> ModuleType:
    """The task module `name` (one of TASKS; the name never becomes a path unchecked)."""
    if name not in TASKS:
        from gateway.errors import ConfigError

        raise ConfigError(f"unknown demo task '{name}'; choose one of: {', '.join(TASKS)}")
    return importlib.import_module(f"gateway.demo.{_MODULES.get(name, name)}")
