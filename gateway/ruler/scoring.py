"""RULER: an LLM judge scores a group's trajectories against each other.

GRPO only needs scores that rank a group's rollouts, and ranking attempts side by
side is far easier for a judge than grading one alone. So the judge gets every
trajectory of the group at once: the messages all of them share (the task) once,
then each trajectory's own rest under an id. Identical trajectories are judged
once and the score fanned back out. The answer must match a JSON schema; a wrong
answer (bad JSON, wrong ids or count, a score outside [0, 1]) gets one retry with
the reason, then the judgement fails with that reason.

Pure: turning recorded calls into trajectories, the prompt, validating the answer.
I/O: the judge call (`gateway.ruler.judges`) and `RulerService`, which reads the group
and stores the result.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.errors import Conflict, RLProxyError
from gateway.ruler.judges import JudgeCall, JudgeError, judge_for, redact
from gateway.store.frozen import frozen_group_reason
from gateway.store.waits import read_within

log = logging.getLogger("rlproxy.ruler")


DEFAULT_RUBRIC = """\
- A trajectory that reaches the goal must score clearly higher than one that does not.
- Between two that reach it, the one that gets there more directly (no needless steps, \
failed tool calls or detours) scores higher.
- Partial progress towards the goal earns partial credit.
- Make score gaps match quality gaps: close attempts get close scores, a much better \
attempt a much higher one."""

# What the judge must answer; sent as OpenAI's `json_schema` response format (strict).
ANSWER_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "scores": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "trajectory_id": {"type": "string"},
                    "explanation": {"type": "string"},
                    "score": {"type": "number"},
                },
                "required": ["trajectory_id", "explanation", "score"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["scores"],
    "additionalProperties": False,
}
RESPONSE_FORMAT: dict = {
    "type": "json_schema",
    "json_schema": {"name": "ruler_scores", "schema": ANSWER_SCHEMA, "strict": True},
}


class InvalidJudgeAnswer(ValueError):
    """The judge's answer does not fit the schema or the trajectories; the message says how."""


# ------------------------------------------------------------------ answer model


class TrajectoryScore(BaseModel):
    model_config = ConfigDict(extra="ignore")
    trajectory_id: str
    explanation: str = ""
    score: float = Field(ge=0.0, le=1.0)


class JudgeAnswer(BaseModel):
    model_config = ConfigDict(extra="ignore")
    scores: list[TrajectoryScore]


# ------------------------------------------------------------------ trajectories (pure)


@dataclass(frozen=True)
class Trajectory:
    """One session as the judge sees it."""

    session_id: str
    messages: list[dict]  # normalized, the final assistant reply included
    tools: list[dict] | None  # the tools the agent was offered, if any


def _content_text(content: Any) -> Any:
    if not isinstance(content, list):
        return content
    parts = []
    for part in content:
        if not isinstance(part, dict):
            continue
        kind = part.get("type", "text")
        parts.append(part.get("text", "") if kind == "text" else f"[{kind}]")
    return "".join(parts)


def normalize_message(message: dict) -> dict:
    """Only what a judge needs, in a fixed shape, so a request's echo of an earlier reply
    compares equal to the reply as it was recorded."""
    out: dict = {"role": message.get("role")}
    content = _content_text(message.get("content"))
    if content not in (None, ""):
        out["content"] = content
    if message.get("name"):
        out["name"] = message["name"]
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": call.get("id"),
                "type": call.get("type", "function"),
                "function": {
                    "name": (call.get("function") or {}).get("name"),
                    "arguments": (call.get("function") or {}).get("arguments"),
                },
            }
            for call in message["tool_calls"]
        ]
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    return out


def trajectory_from_calls(session_id: str, calls: list[dict]) -> Trajectory:
    """A session's calls as one message list: each call's messages, then its reply.

    An agent resends the history with every call, so a call whose messages start
    with everything so far just extends it; one that does not (a rewritten or a
    second conversation) is appended whole. Failed calls are left out.
    """
    history: list[dict] = []
    tools = None
    for call in calls:
        response = call.get("response") or {}
        if call.get("status") != "ok" or not response.get("choices"):
            continue
        request = call.get("request") or {}
        messages = [normalize_message(m) for m in request.get("messages") or []]
        if messages[: len(history)] == history:
            history = messages
        else:
            history = history + messages
        history.append(normalize_message(response["choices"][0].get("message") or {"role": "assistant"}))
        tools = request.get("tools") or tools
    return Trajectory(session_id=session_id, messages=history, tools=tools)


def common_prefix_length(message_lists: list[list[dict]]) -> int:
    """Messages every list starts with; capped so each list keeps at least its last message."""
    if not message_lists:
        return 0
    limit = max(min(len(messages) for messages in message_lists) - 1, 0)
    length = 0
    while length < limit and all(m[length] == message_lists[0][length] for m in message_lists):
        length += 1
    return length


# ------------------------------------------------------------------ prompt (pure)


@dataclass(frozen=True)
class JudgePrompt:
    messages: list[dict]  # what the judge is sent
    members: dict[str, list[str]]  # trajectory id -> the session ids it stands for

    @property
    def ids(self) -> list[str]:
        return list(self.members)


def _json_lines(items: list[dict]) -> str:
    # Keys in their given order: a message reads role first, then content.
    return "\n".join(json.dumps(item, ensure_ascii=False) for item in items)


def _system_prompt(n: int, rubric: str) -> str:
    return (
        f"You judge {n} attempts (trajectories) by an AI agent at the same task. Work out the task "
        "from the shared context (system prompt and user messages), then compare the trajectories "
        "with each other and score each from 0 to 1. The scores rank the attempts against each "
        "other, so use the range to separate better ones from worse ones.\n\n"
        f"Grading rubric:\n{rubric.strip()}\n\n"
        "Messages are given as JSON, one per line. Answer with a JSON object "
        '{"scores": [{"trajectory_id": "...", "explanation": "...", "score": 0.0}]} holding exactly '
        'one entry per trajectory: its id as written in its <trajectory id="..."> tag, one or two '
        "sentences on why, and the score."
    )


def build_prompt(trajectories: list[Trajectory], rubric: str | None = None) -> JudgePrompt:
    """The judge's messages: shared tools and prefix once, then each distinct trajectory under an id."""
    if not trajectories:
        raise ValueError("a judgement needs at least one trajectory")
    unique: list[Trajectory] = []
    members: dict[str, list[str]] = {}
    index_of: dict[str, str] = {}
    for trajectory in trajectories:
        key = json.dumps([trajectory.messages, trajectory.tools], sort_keys=True)
        if key not in index_of:
            unique.append(trajectory)
            index_of[key] = str(len(unique))
            members[index_of[key]] = []
        members[index_of[key]].append(trajectory.session_id)

    prefix = common_prefix_length([t.messages for t in unique])
    shared_tools = all(t.tools == unique[0].tools for t in unique)
    blocks = []
    if shared_tools and unique[0].tools:
        blocks.append(f"<tools>\n{_json_lines(unique[0].tools)}\n</tools>")
    if prefix:
        blocks.append(f"<context>\n{_json_lines(unique[0].messages[:prefix])}\n</context>")
    for trajectory_id, trajectory in zip(members, unique, strict=False):
        body = _json_lines(trajectory.messages[prefix:])
        if trajectory.tools and not shared_tools:
            body = f"<tools>\n{_json_lines(trajectory.tools)}\n</tools>\n{body}"
        blocks.append(f'<trajectory id="{trajectory_id}">\n{body}\n</trajectory>')
    messages = [
        {"role": "system", "content": _system_prompt(len(unique), rubric or DEFAULT_RUBRIC)},
        {"role": "user", "content": "\n\n".join(blocks)},
    ]
    return JudgePrompt(messages=messages, members=members)


def render_prompt(prompt: JudgePrompt) -> str:
    """The prompt as plain text (golden files, debugging)."""
    return "\n\n".join(f"### {m['role']}\n{m['content']}" for m in prompt.messages) + "\n"


# ------------------------------------------------------------------ answer (pure)


_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


def parse_answer(content: str | None, ids: list[str]) -> list[TrajectoryScore]:
    """The judge's scores in `ids` order, or `InvalidJudgeAnswer` saying what is wrong."""
    text = (content or "").strip()
    fenced = _FENCE.match(text)  # some models wrap JSON in a code fence despite the schema
    if fenced:
        text = fenced.group(1)
    if not text:
        raise InvalidJudgeAnswer("the answer was empty")
    try:
        answer = JudgeAnswer.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise InvalidJudgeAnswer(
            f"the answer is not valid JSON of the required shape ({where + ': ' if where else ''}{first['msg']})"
        ) from None
    got = [score.trajectory_id for score in answer.scores]
    if sorted(got) != sorted(ids):
        raise InvalidJudgeAnswer(
            f"expected one score for each of the trajectory ids {ids}, got {len(got)} scores with ids {got}"
        )
    by_id = {score.trajectory_id: score for score in answer.scores}
    return [by_id[i] for i in ids]


def retry_messages(prompt: JudgePrompt, bad_answer: str | None, problem: str) -> list[dict]:
    """The same conversation plus the bad answer and what to fix, for the one retry."""
    return [
        *prompt.messages,
        {"role": "assistant", "content": bad_answer or ""},
        {
            "role": "user",
            "content": (
                f"That answer cannot be used: {problem}. Answer again with only the JSON object: one entry for "
                f"each of the trajectory ids {prompt.ids}, each score a number from 0 to 1."
            ),
        },
    ]


# ------------------------------------------------------------------ judging (I/O)


async def judge(trajectories: list[Trajectory], call: JudgeCall, rubric: str | None = None) -> list[dict]:
    """Score trajectories; returns `{"trajectory_id": session_id, "explanation", "score"}` per session."""
    prompt = build_prompt(trajectories, rubric)
    content = await call(prompt.messages, RESPONSE_FORMAT)
    try:
        scores = parse_answer(content, prompt.ids)
    except InvalidJudgeAnswer as first:
        log.warning("RULER: the judge's answer was invalid (%s); retrying once", first)
        content = await call(retry_messages(prompt, content, str(first)), RESPONSE_FORMAT)
        try:
            scores = parse_answer(content, prompt.ids)
        except InvalidJudgeAnswer as second:
            raise JudgeError(f"the judge answered wrongly twice: first {first}; then {second}") from None
    by_session = {session_id: score for score in scores for session_id in prompt.members[score.trajectory_id]}
    return [
        {
            "trajectory_id": t.session_id,
            "explanation": by_session[t.session_id].explanation,
            "score": by_session[t.session_id].score,
        }
        for t in trajectories
    ]


STOPPED = "the gateway stopped before the judge answered; POST /v1/groups/{group_id}/ruler again"


class RulerService:
    """Judges a stored group and records the outcome; one judgement per group at a time."""

    def __init__(self, services: Any):
        self.services = services
        self._running: set[str] = set()
        self._tasks: set[asyncio.Task] = set()

    def start(
        self, group_id: str, judge_model: str, rubric: str | None = None, judge_api_base: str | None = None
    ) -> asyncio.Task:
        """`score_group` as a task of its own, which a client that hangs up does not cancel and
        `stop` does."""
        task = asyncio.ensure_future(self.score_group(group_id, judge_model, rubric, judge_api_base))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def stop(self) -> None:
        """The gateway is stopping: cancel the judgements still waiting for their judge (each
        marks its group failed, saying so) while the store can still record it."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def trajectories(self, group_id: str) -> list[Trajectory]:
        store = self.services.store
        group = store.get_group(group_id)  # NotFound for an unknown group
        frozen = frozen_group_reason(
            group_id, group.get("trained_step"), group.get("claimed_step"), group.get("failed") or group.get("skipped")
        )
        if frozen is not None:
            raise Conflict(f"RULER cannot score it: {frozen}", param="group_id")
        if not group["sessions"]:  # the client's to fix, not the judge's: nothing is sent
            discarded = len(group["discarded_sessions"])
            raise Conflict(
                f"group '{group_id}' has no sessions to judge"
                + (f": all {discarded} were discarded" if discarded else ""),
                param="group_id",
            )
        return [trajectory_from_calls(s["id"], store.session_calls(s["id"])) for s in group["sessions"]]

    async def score_group(
        self, group_id: str, judge_model: str, rubric: str | None = None, judge_api_base: str | None = None
    ) -> list[dict]:
        """Judge the group, store scores as rewards and close it; on failure mark it failed and raise."""
        call = judge_for(self.services, judge_model, judge_api_base)  # 400 for a judge the operator did not name
        if group_id in self._running:
            raise Conflict(f"group '{group_id}' is being judged already; wait for GET /v1/groups/{group_id}")
        self._running.add(group_id)
        try:
            trajectories = await read_within(self.services.store, self.trajectories, group_id)
            store = self.services.store
            await store.set_ruler_status(group_id, "running", owner=getattr(self.services, "gateway_id", None))
            try:
                scores = await judge(trajectories, call, rubric)
                await store.record_judgement(group_id, judge_model, scores)
            except RLProxyError as exc:  # the judge's failure, or ours with its own status (409: a step took it)
                await store.set_ruler_status(group_id, "failed", exc.message)
                raise
            except asyncio.CancelledError:  # shutting down: else the group shows "running" for ever
                with contextlib.suppress(Exception):  # a store that cannot write must not hide the cancel
                    await asyncio.shield(store.set_ruler_status(group_id, "failed", STOPPED.format(group_id=group_id)))
                raise
            except Exception as exc:  # anything else must not leave the group "running" forever
                message = f"the judgement failed: {type(exc).__name__}: {redact(str(exc))[:500]}"
                await store.set_ruler_status(group_id, "failed", message)
                raise JudgeError(message) from exc
            tracer = self.services.tracer
            if tracer is not None:
                tracer.on_judgement(group_id, scores, judge_model=judge_model)
            return scores
        finally:
            self._running.discard(group_id)
