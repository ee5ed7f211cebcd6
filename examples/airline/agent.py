"""An airline customer-service agent (τ-bench style), trained by pointing it at rlproxy.

    python examples/airline/agent.py --base-url http://localhost:8000/v1 --model agent --rollouts 8

Each task is one customer (a scripted user) with one request: book, change or cancel a
reservation, add bags, or something only a human can do. The agent is the plain tool loop
on the `openai` client (`examples/toolagent.py: run_episode`) over the airline's tools
(`env.py`) under its written policy and fare rules (`policy.md`). The reward is 1 when the
database ends exactly as the task's goal requires and no policy rule was broken, else 0.
The `sdk` ties each rollout's calls to a session and the task's rollouts to a group, and
posts the reward.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: `examples.*` importable

from examples.airline.env import AirlineEnv  # noqa: E402
from examples.airline.tasks import TASKS  # noqa: E402
from examples.toolagent import Example, main  # noqa: E402

POLICY = (Path(__file__).parent / "policy.md").read_text()

RUBRIC = (
    "The agent serves one airline customer under the policy and fare rules in the system prompt. "
    "Score highest the trajectories that do what the customer asked, exactly and only that, with the "
    "tools, within the policy: the customer's user id looked up first, every change confirmed with an "
    "explicit 'yes' after stating what it costs, prices and bags computed by the rules, forbidden "
    "requests refused politely. A trajectory that changes the wrong thing, charges the wrong amount "
    "or breaks a rule scores below one that does nothing; among the right ones, fewer turns is better."
)

AIRLINE = Example(name="airline", policy=POLICY, tasks=TASKS, new_env=AirlineEnv, rubric=RUBRIC)

if __name__ == "__main__":
    main(AIRLINE)
