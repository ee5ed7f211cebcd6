"""What the retail and airline examples share: a tool-using agent's loop, a scripted
customer, the grading rule and the command line. Each example brings its own database,
tools, policy and tasks (`examples/retail/`, `examples/airline/`).

The loop is the one every tool-calling agent runs, on the plain `openai` client:

    call the model -> run the tool calls it asked for -> append the results -> repeat,

until the model answers in words; then the (simulated) customer replies, and the loop
goes on until the customer has nothing more to say or the turns run out. rlproxy's
`sdk` only ties the calls to a session and a group and posts the reward.

The reward is τ-bench's: 1 when the database ends exactly in the state the task's goal
requires (the task's expected write actions replayed on a fresh copy) and no policy
rule was broken, else 0.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# ---------------------------------------------------------------- the environment


class ToolError(Exception):
    """A tool was called wrongly (unknown id, bad arguments): the model is told, no rule is broken."""


class PolicyError(ToolError):
    """The call breaks a rule of the policy: the tool refuses it and the rollout is marked as breaking a rule."""


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}


def type_errors(schema: dict, value: Any, path: str) -> list[str]:
    """Where `value` is not of the JSON Schema types `schema` names (types, items, required
    properties; not enums or bounds, which the tools judge), so a tool body only ever sees
    the types its schema promises."""
    kind = schema.get("type")
    expected = _JSON_TYPES.get(kind)
    if expected and (not isinstance(value, expected) or (isinstance(value, bool) and kind != "boolean")):
        return [f"{path} must be {'an' if kind[0] in 'aeiou' else 'a'} {kind}"]
    errors: list[str] = []
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            errors += type_errors(schema["items"], item, f"{path}[{index}]")
    if isinstance(value, dict) and "properties" in schema:
        errors += [f"{path}.{name} is missing" for name in schema.get("required", []) if name not in value]
        for name, sub in schema["properties"].items():
            if name in value:
                errors += type_errors(sub, value[name], f"{path}.{name}")
    return errors


def write(method: Callable) -> Callable:
    """Marks a tool that changes the database: the policy wants the user's explicit 'yes' before each one."""
    method.writes = True
    return method


class ToolEnv:
    """A database plus the tools over it, and the log of rules broken.

    Subclasses define `TOOLS` (OpenAI function schemas) and one method per tool, named as
    the tool; a method returns something JSON-serialisable or raises `ToolError` /
    `PolicyError`. `db` is the state the grader compares.
    """

    TOOLS: list[dict] = []
    # Affirmative replies that count as the explicit confirmation a write needs.
    CONFIRM = re.compile(r"^\s*yes\b", re.IGNORECASE)

    def __init__(self, db: dict):
        self.db = copy.deepcopy(db)
        self.violations: list[str] = []  # one line per rule broken, in order
        self.confirmed = False  # the user said "yes" since the last write
        self.done = False  # transferred to a human: the conversation ends
        self.replaying = False  # the grader replays a task's expected actions: no conversation to check
        self.user_id: str | None = None  # the authenticated user

    @property
    def tool_names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.TOOLS]

    def require_user(self, owner: str) -> None:
        """The policy: act only for an authenticated user, and only on what is theirs."""
        if self.replaying:
            return
        if self.user_id is None:
            raise PolicyError("the user is not authenticated yet: identify them first")
        if owner != self.user_id:
            raise PolicyError(f"that belongs to another user, not to the authenticated user {self.user_id}")

    def on_user(self, text: str) -> None:
        """A user turn arrived; an explicit 'yes' allows the next write."""
        self.confirmed = bool(self.CONFIRM.match(text))

    def call(self, name: str, arguments: str | dict) -> str:
        """Run one tool call as the model sent it; the text is the tool message's content."""
        if name not in self.tool_names:
            return f"Error: there is no tool '{name}'; the tools are {', '.join(self.tool_names)}"
        try:
            args = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
            if not isinstance(args, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            return f"Error: the arguments of {name} are not a JSON object ({exc})"
        method = getattr(self, name)
        try:
            inspect.signature(method).bind(**args)
        except TypeError as exc:
            return f"Error: wrong arguments for {name}: {exc}"
        schema = next(t["function"]["parameters"] for t in self.TOOLS if t["function"]["name"] == name)
        errors = type_errors(schema, args, "arguments")
        if errors:
            return f"Error: wrong arguments for {name}: {'; '.join(errors)}"
        writes = getattr(method, "writes", False) and not self.replaying
        unconfirmed = writes and not self.confirmed
        try:
            result = method(**args)
        except PolicyError as exc:
            result, broken = f"Error: {exc}", f"{name}: {exc}"
        except ToolError as exc:  # a mistake in the call, nothing attempted: the confirmation still holds
            return f"Error: {exc}"
        else:
            result, broken = result if isinstance(result, str) else json.dumps(result, sort_keys=True), None
        if unconfirmed:
            self.violations.append(f"{name}: attempted without the user's explicit confirmation")
        if broken:
            self.violations.append(broken)
        if writes:
            self.confirmed = False  # one confirmation, one write
        return result

    def replay(self, actions: list[Action]) -> ToolEnv:
        """Apply a task's expected actions (the goal state); they must all succeed."""
        self.replaying = True
        for action in actions:
            result = self.call(action.name, action.arguments)
            if result.startswith("Error"):
                raise ValueError(f"the task's expected action {action.name}({action.arguments}) failed: {result}")
        self.replaying = False
        return self


# ---------------------------------------------------------------- tasks and grading


@dataclass(frozen=True)
class Action:
    """One expected tool call, replayed to build a task's goal state."""

    name: str
    arguments: dict


@dataclass(frozen=True)
class Task:
    """A customer's request and what the database must look like after it is served."""

    id: str
    instruction: str  # the customer's opening message: who they are and what they want
    actions: tuple[Action, ...] = ()  # the writes a correct agent makes (none: the request must be refused)
    follow_ups: tuple[str, ...] = ()  # what the customer says next when not asked to confirm


@dataclass(frozen=True)
class Grade:
    reward: float  # 1 if the database matches the goal and no rule was broken, else 0
    db_match: bool  # the database ends exactly in the goal state
    violations: tuple[str, ...]  # the rules broken, in order
    partial: float  # of the records the goal or the agent changed, the fraction that ended right

    def metrics(self) -> dict[str, float]:
        return {"db_match": float(self.db_match), "violations": float(len(self.violations)), "partial": self.partial}


def by_record(db: dict) -> dict[tuple[str, str], Any]:
    """The database as {(table, key): record}; top-level values that are not tables are records of their own."""
    out: dict[tuple[str, str], Any] = {}
    for table, rows in db.items():
        if isinstance(rows, dict):
            out.update({(table, key): row for key, row in rows.items()})
        else:
            out[(table, "")] = rows
    return out


def grade(initial: dict, final: dict, goal: dict, violations: list[str]) -> Grade:
    """τ-bench's rule: reward 1 iff `final == goal` and no rule was broken. `partial` is a
    metric only: among the records that the goal or the agent changed, the share that
    ended as the goal has them (1 when neither changed anything)."""
    before, after, wanted = by_record(initial), by_record(final), by_record(goal)
    touched = {
        key
        for key in before.keys() | after.keys() | wanted.keys()
        if before.get(key) != wanted.get(key) or before.get(key) != after.get(key)
    }
    right = sum(1 for key in touched if after.get(key) == wanted.get(key))
    db_match = final == goal
    return Grade(
        reward=float(db_match and not violations),
        db_match=db_match,
        violations=tuple(violations),
        partial=right / len(touched) if touched else 1.0,
    )


# ---------------------------------------------------------------- the customer


class SimulatedUser:
    """A scripted customer: opens with the task's instruction; says "yes" when asked to confirm
    (a message that mentions confirming or proceeding); otherwise says the next follow-up, and
    when none is left ends the conversation. Deterministic, so a group's rollouts differ only
    by the agent."""

    ASKS_TO_CONFIRM = re.compile(r"\b(confirm|proceed|go ahead|yes/no)\b", re.IGNORECASE)
    YES = "Yes, please go ahead."

    def __init__(self, task: Task):
        self.task = task
        self.follow_ups = list(task.follow_ups)

    def first(self) -> str:
        return self.task.instruction

    def reply(self, agent_text: str) -> str | None:
        """The customer's next message, or None: the conversation is over."""
        if self.ASKS_TO_CONFIRM.search(agent_text):
            return self.YES
        return self.follow_ups.pop(0) if self.follow_ups else None


# ---------------------------------------------------------------- the agent's loop


@dataclass
class Episode:
    messages: list[dict]  # the conversation as the client sent it, plus the last answer
    model_calls: int = 0
    tool_calls: int = 0
    stop: str = "user_done"  # user_done | transferred | max_turns


def run_episode(
    client: Any,
    model: str,
    system: str,
    env: ToolEnv,
    user: SimulatedUser,
    *,
    max_turns: int = 30,
    temperature: float = 1.0,
    max_tokens: int = 1024,
) -> Episode:
    """The tool loop: the model calls tools until it answers in words, the customer replies, repeat.

    A call the server refuses (a conversation longer than the model's context, say) raises:
    the rollout failed, and `group.run` leaves it out of the group."""
    episode = Episode([{"role": "system", "content": system}, {"role": "user", "content": user.first()}])
    messages = episode.messages
    while True:
        if episode.model_calls == max_turns:
            episode.stop = "max_turns"
            return episode
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=env.TOOLS, temperature=temperature, max_tokens=max_tokens
        )
        episode.model_calls += 1
        message = reply.choices[0].message
        if message.tool_calls:
            messages.append(
                {
                    "role": "assistant",
                    "content": message.content,
                    "tool_calls": [
                        {
                            "id": call.id,
                            "type": "function",
                            "function": {"name": call.function.name, "arguments": call.function.arguments},
                        }
                        for call in message.tool_calls
                    ],
                }
            )
            for call in message.tool_calls:
                episode.tool_calls += 1
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.id,
                        "content": env.call(call.function.name, call.function.arguments),
                    }
                )
            continue
        messages.append({"role": "assistant", "content": message.content or ""})
        if env.done:
            episode.stop = "transferred"
            return episode
        answer = user.reply(message.content or "")
        if answer is None:
            return episode
        env.on_user(answer)
        messages.append({"role": "user", "content": answer})


# ---------------------------------------------------------------- the command line


@dataclass(frozen=True)
class Example:
    """What one tool-agent example plugs into `main`."""

    name: str
    policy: str  # the system prompt
    tasks: dict[str, list[Task]]  # by split: train, val
    new_env: Callable[[], ToolEnv]  # a fresh database
    rubric: str  # what a RULER judge is told to reward

    def grade(self, task: Task, env: ToolEnv) -> Grade:
        goal = self.new_env().replay(list(task.actions))
        return grade(self.new_env().db, env.db, goal.db, env.violations)


def parse_args(example: Example, argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"{example.name}/agent.py", description=f"The {example.name} tool agent, rewarded by its database state."
    )
    parser.add_argument("--base-url", default="http://localhost:8000/v1", help="rlproxy's /v1 URL")
    parser.add_argument("--api-key", default=None, help="rlproxy's --api-key, if it has one")
    parser.add_argument("--model", default="agent", help="served name: agent, agent@N, or the base model's id")
    parser.add_argument("--split", choices=["train", "val"], default="train", help="val: scored, never trained on")
    parser.add_argument(
        "--tasks",
        type=int,
        default=None,
        help="groups to run: the split's tasks (or --task's) in order, round and round (default: each once)",
    )
    parser.add_argument(
        "--task", action="append", default=None, metavar="ID", help="run only this task of the split (repeatable)"
    )
    parser.add_argument("--rollouts", type=int, default=4, help="rollouts per task, one group (GRPO compares them)")
    parser.add_argument("--concurrency", type=int, default=None, help="rollouts at a time (default: all of a group)")
    parser.add_argument("--max-turns", type=int, default=30, help="model calls per rollout")
    parser.add_argument("--max-tokens", type=int, default=1024, help="tokens per model call")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--ruler",
        action="store_true",
        help="also score each group with RULER (POST /v1/groups/{id}/ruler): the judge's scores "
        "become the rewards, the database reward is kept as the metric independent_reward",
    )
    parser.add_argument(
        "--judge-model",
        default="self",
        help="RULER judge: a litellm id (openai/o3, ...) or 'self', the model the gateway serves; "
        "another than self must be one the gateway was started with (rlproxy serve --judge-model)",
    )
    parser.add_argument(
        "--judge-api-base",
        default=None,
        help="RULER judge at an OpenAI-compatible URL (one the gateway was started with: --judge-api-base)",
    )
    parser.add_argument("--rubric", default=None, help="RULER rubric (default: this example's)")
    parser.add_argument("--out", default=None, help="append one JSON line per rollout to this file")
    args = parser.parse_args(argv)
    if args.rollouts < 1 or (args.tasks is not None and args.tasks < 1):
        parser.error("--tasks and --rollouts must be at least 1")
    return args


def main(example: Example, argv: list[str] | None = None) -> list[dict]:
    """Run the groups; returns (and with --out, writes) one record per rollout."""
    from sdk import RLProxy, RLProxyAPIError, RolloutsFailed

    args = parse_args(example, argv)
    tasks = example.tasks[args.split]
    if args.task:
        unknown = sorted(set(args.task) - {t.id for t in tasks})
        if unknown:
            sys.exit(f"no task {unknown} in the {args.split} split; its tasks: {', '.join(t.id for t in tasks)}")
        tasks = [t for t in tasks if t.id in args.task]
    chosen = [tasks[i % len(tasks)] for i in range(args.tasks or len(tasks))]
    proxy = RLProxy(base_url=args.base_url, api_key=args.api_key)
    lock = threading.Lock()
    every: list[dict] = []
    try:
        for task in chosen:
            group_records: list[dict] = []

            def rollout(session, task: Task = task, group_records: list[dict] = group_records) -> None:
                env = example.new_env()
                episode = run_episode(
                    session.openai_client(),
                    args.model,
                    example.policy,
                    env,
                    SimulatedUser(task),
                    max_turns=args.max_turns,
                    temperature=args.temperature,
                    max_tokens=args.max_tokens,
                )
                result = example.grade(task, env)
                metrics = {
                    **result.metrics(),
                    "model_calls": float(episode.model_calls),
                    "tool_calls": float(episode.tool_calls),
                }
                session.reward(result.reward, metrics)
                with lock:
                    group_records.append(
                        {
                            "task": task.id,
                            "group_id": session.group_id,
                            "session_id": session.id,
                            "reward": result.reward,
                            "metrics": metrics,
                            "violations": list(result.violations),
                            "stop": episode.stop,
                            "messages": episode.messages,
                        }
                    )

            with proxy.group(split=args.split) as group:
                try:
                    result = group.run(
                        rollout,
                        n=args.rollouts,
                        concurrency=args.concurrency or args.rollouts,
                        max_exceptions=args.rollouts - 1,
                    )
                except RolloutsFailed as exc:
                    sys.exit(f"every rollout of task {task.id} failed; the last one with: {exc.__cause__}")
                line = f"{task.id} ({group.id}): database rewards {[r['reward'] for r in group_records]}"
                if result.n_failed:  # discarded by group.run: no reward, never trained on
                    line += f", {result.n_failed} failed ({result.exceptions[-1]})"
                if args.ruler:
                    try:
                        scores = {
                            s.session_id: s.score
                            for s in group.ruler(args.judge_model, args.rubric or example.rubric, args.judge_api_base)
                        }
                        for record in group_records:
                            record["ruler_score"] = scores.get(record["session_id"])
                        line += f", RULER {[r.get('ruler_score') for r in group_records]}"
                    except RLProxyAPIError as exc:  # the group keeps its database rewards and closes below
                        line += f", RULER failed: {exc}"
            print(line, flush=True)
            every += group_records
            if args.out:
                with open(args.out, "a") as out:
                    out.writelines(json.dumps(record) + "\n" for record in group_records)
    finally:
        proxy.close()
    rewards = [r["reward"] for r in every]
    print(f"{len(every)} rollouts, mean database reward {sum(rewards) / max(len(rewards), 1):.3f}", flush=True)
    return every
