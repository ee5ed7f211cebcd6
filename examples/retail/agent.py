"""A retail customer-service agent (τ-bench style), trained by pointing it at rlproxy.

    python examples/retail/agent.py --base-url http://localhost:8000/v1 --model agent --rollouts 8

Each task is one customer (a scripted user) with one request: cancel, change, return or
exchange an order, or something only a human can do. The agent is the plain tool loop on
the `openai` client (`examples/toolagent.py: run_episode`) over the store's tools
(`env.py`) under its written policy (`policy.md`). The reward is 1 when the database ends
exactly as the task's goal requires and no policy rule was broken, else 0. The `sdk` ties
each rollout's calls to a session and the task's rollouts to a group, and posts the reward.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: `examples.*` importable

from examples.retail.env import RetailEnv  # noqa: E402
from examples.retail.tasks import TASKS  # noqa: E402
from examples.toolagent import Example, main  # noqa: E402

POLICY = (Path(__file__).parent / "policy.md").read_text()

RUBRIC = (
    "The agent serves one customer of an online store under the policy in the system prompt. "
    "Score highest the trajectories that do what the customer asked, exactly and only that, with the "
    "tools, within the policy: the customer authenticated first, every change confirmed with an explicit "
    "'yes' before it was made, only what the policy allows (refused politely otherwise). A trajectory "
    "that changes the wrong thing, or breaks a rule, scores below one that does nothing; among the "
    "right ones, fewer turns is better."
)

RETAIL = Example(name="retail", policy=POLICY, tasks=TASKS, new_env=RetailEnv, rubric=RUBRIC)

if __name__ == "__main__":
    main(RETAIL)
