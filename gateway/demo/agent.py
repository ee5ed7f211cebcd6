"""The demo's toy agent: plays the task against the gateway, round after round.

Each round samples `groups_per_step` groups of `rollouts` parallel rollouts from whatever
step `NAME` serves, posts their rewards, closes the groups, and waits until the trainer's
next step is served. A group whose rollouts all scored the same teaches nothing (the
trainer skips it), so the round samples another one in its place. The held-out `val` set
is played before the first step and after the last; the progress bar shows each step's
reward as it goes.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from types import ModuleType

from gateway.demo import load_task
from gateway.demo.options import DemoOptions
from gateway.demo.processes import Trainer, client_key
from gateway.errors import RLProxyError
from gateway.settings import Settings


@dataclass
class Record:
    """What the agent saw, for the summary and the curve."""

    baseline_reward: float | None = None
    final_reward: float | None = None
    final_step: int | None = None
    rewards_by_step: dict[int, list[float]] = field(default_factory=dict)
    # mean |log pi_old - log mu| over the tokens step N sampled, as the trainer measured it when it
    # trained step N + 1 on them: how far the engine's behaviour logprobs are from the trainer's
    mismatch_by_step: dict[int, float] = field(default_factory=dict)
    # the replies of the train rollouts each step sampled (by the step that answered each call),
    # and of the last val evaluation, in the held-out set's order: what was learned, seen
    replies_by_step: dict[int, list[str]] = field(default_factory=dict)
    final_replies: list[str] = field(default_factory=list)
    groups_skipped: int = 0
    stopped_because: str = ""
    baseline_at: float | None = None  # time.monotonic() when each val evaluation ended
    final_at: float | None = None


def episode_scores(result) -> tuple[float, float]:
    """(training reward, score) of a task's episode: it returns one number, or the two."""
    return (float(result), float(result)) if isinstance(result, (int, float)) else tuple(map(float, result))


def spread(items: list, n: int) -> list:
    """Up to `n` of `items`, evenly spaced (not the first group's alone), in their order."""
    if len(items) <= n:
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def sample_lines(replies: list[str], n: int = 3, width: int = 60) -> list[str]:
    """A few replies for the console, one line each: repr shows a newline as \\n, and a long
    reply is cut to `width` characters."""
    lines = [repr(text) for text in spread(replies, n)]
    return [line if len(line) <= width else line[: width - 1] + "…" for line in lines]


def refused(exc) -> str:
    """The gateway's 400 to the agent's call, in its own words, and the demo flag behind it:
    `--max-tokens 100000` past the model's context ended in openai's traceback and exit 1."""
    body = exc.body if isinstance(exc.body, dict) else {}
    hint = "; lower --max-tokens" if body.get("param") == "max_tokens" else ""
    return f"the gateway refused the agent's call: {body.get('message') or exc.message}{hint}"


def steps_bar(desc: str, steps: int, baseline: float | None, progress: bool):
    """The demo's progress bar over training steps, opened on the baseline reward."""
    from tqdm import tqdm

    bar = tqdm(
        total=steps,
        desc=desc,
        unit="step",
        disable=not progress,
        leave=True,
        bar_format="{desc}: {n_fmt}/{total_fmt} steps |{bar}| {elapsed}{postfix}",
    )
    bar.set_postfix_str(f"baseline reward {baseline:.2f}")
    return bar


class Agent:
    """Plays the task's episodes against the gateway over its real HTTP API."""

    def __init__(
        self, url: str, settings: Settings, options: DemoOptions, trainer: Trainer, deadline: float, task: ModuleType
    ):
        import httpx
        import openai

        self.settings = settings
        self.options = options
        self.task = task
        self.trainer = trainer
        self.deadline = deadline
        self.model = settings.model_name
        key = client_key(settings)
        self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=2, timeout=120)
        self.http = httpx.AsyncClient(base_url=url, timeout=120, headers={"Authorization": f"Bearer {key}"})
        self.rng = random.Random(settings.seed)
        # The held-out set: one task per val rollout (not one per group: a trained policy plays
        # a group's shared task nearly the same way 16 times, so 8 groups would score ~8 games),
        # drawn once, so the baseline and the final score are measured on the same tasks.
        val_rng = random.Random(f"val-{settings.seed}")
        count = options.eval_groups * options.rollouts
        held_out = getattr(task, "held_out", None)
        self.val_specs = held_out(count) if held_out else [task.sample(val_rng) for _ in range(count)]
        self.record = Record()
        self.pending: list[str] = []  # train groups closed but not yet trained or skipped
        self.perfect_in_a_row = 0  # train groups in a row where every rollout got the full reward, across steps
        self._groups = 0

    async def close(self) -> None:
        await self.client.close()
        await self.http.aclose()

    async def served_step(self) -> int | None:
        response = await self.http.get("/healthz")
        response.raise_for_status()
        return response.json().get("step")

    async def read_mismatch(self, sampled_by: int | None = None) -> None:
        """The sampler/trainer mismatch of every step trained so far, from the step rows;
        waiting a moment for the one measured on what step `sampled_by` sampled (the trainer
        records a step just after it saves the adapter the gateway may already serve)."""
        for _ in range(20):
            response = await self.http.get("/v1/training/steps")
            response.raise_for_status()
            for row in response.json()["data"]:
                mismatch = (row.get("metrics") or {}).get("mismatch_logprob_abs")
                if row["step"] > 0 and mismatch is not None:
                    self.record.mismatch_by_step[row["step"] - 1] = float(mismatch)
            if sampled_by is None or sampled_by in self.record.mismatch_by_step:
                return
            await asyncio.sleep(0.1)

    def chat_in(
        self,
        headers: dict[str, str],
        steps: list[int],
        rng: random.Random | None = None,
        replies: list[tuple[int | None, str]] | None = None,
        temperature: float = 1.0,
    ):
        """The task's `chat` for one session: a chat completion with these identity headers,
        sampled at `temperature` with a seed from `rng`; the step that answered each call goes
        into `steps`, and (that step, the reply's text) into `replies` when given."""
        seeds = rng or self.rng

        async def chat(messages: list[dict]) -> str | None:
            import openai

            try:
                raw = await self.client.chat.completions.with_raw_response.create(
                    model=self.model,
                    messages=messages,
                    max_tokens=self.options.max_tokens,
                    temperature=temperature,
                    seed=seeds.getrandbits(31),
                    extra_headers=headers,
                )
            except openai.BadRequestError as exc:  # the demo's own request refused: one line, not a traceback
                raise RLProxyError(refused(exc)) from None
            step = raw.headers.get("x-model-step")
            if step is not None:
                steps.append(int(step))
            content = raw.parse().choices[0].message.content
            if replies is not None:
                replies.append((None if step is None else int(step), content or ""))
            return content

        return chat

    async def rollout(self, group_id: str, index: int, spec, split: str) -> tuple[float, float, int | None, list[str]]:
        """One session: the task's episode, each of its model calls a chat completion in this
        session; its reward posted. Returns (score, training reward, the oldest step that
        answered, the replies); a train rollout's replies are kept by the step that answered."""
        session_id = f"{group_id}-r{index}"
        steps: list[int] = []
        replies: list[tuple[int | None, str]] = []
        headers = {"X-Session-Id": session_id, "X-Group-Id": group_id, "X-Split": split}
        temperature = self.options.eval_temperature if split == "val" else 1.0
        chat = self.chat_in(headers, steps, replies=replies, temperature=temperature)
        result = await self.task.episode(spec, chat)
        reward, score = episode_scores(result)
        posted = reward if split == "train" else score  # val is never trained: it gets the score itself
        (
            await self.http.post(
                f"/v1/sessions/{session_id}/reward", json={"reward": posted, "metrics": {"score": score}}
            )
        ).raise_for_status()
        if split == "train":
            for step, text in replies:
                if step is not None:
                    self.record.replies_by_step.setdefault(step, []).append(text)
        return score, reward, min(steps, default=None), [text for _, text in replies]

    async def group(
        self, split: str, specs: list | None = None
    ) -> tuple[str, list[tuple[float, float, int | None, list[str]]]]:
        """`rollouts` rollouts in parallel, then the group is closed (ready). A train group's
        rollouts share one task (GRPO compares them); `specs` gives each rollout its own."""
        self._groups += 1
        group_id = f"demo-{split}-{self._groups:05d}"
        specs = specs or [self.task.sample(self.rng)] * self.options.rollouts
        results = await asyncio.gather(*(self.rollout(group_id, i, spec, split) for i, spec in enumerate(specs)))
        (await self.http.post(f"/v1/groups/{group_id}/close", json={})).raise_for_status()
        return group_id, list(results)

    async def evaluate(self) -> tuple[float, int | None]:
        """Mean score over the held-out set (val sessions, never trained on), and the step that
        answered; its replies go to `record.final_replies` (the last evaluation's stay)."""
        n = self.options.rollouts
        groups = await asyncio.gather(
            *(self.group("val", self.val_specs[i : i + n]) for i in range(0, len(self.val_specs), n))
        )
        results = [result for _, rollouts in groups for result in rollouts]
        answered_by = [step for _, _, step, _ in results if step is not None]
        self.record.final_replies = [text for *_, replies in results for text in replies]
        return sum(score for score, *_ in results) / len(results), max(answered_by, default=None)

    async def wait_for_step(self, step: int, what: str) -> None:
        while True:
            served = await self.served_step()
            if served is not None and served >= step:
                return
            self.trainer.check_alive()
            if time.monotonic() > self.deadline + 120:
                raise RLProxyError(f"gave up waiting for {what}; see trainer.log and gateway.log")
            await asyncio.sleep(0.1)

    async def _still_pending(self, group_id: str) -> bool:
        response = await self.http.get(f"/v1/groups/{group_id}")
        response.raise_for_status()
        group = response.json()
        return group.get("trained_step") is None and not group.get("skipped")

    async def train_round(self, step: int) -> str | None:
        """Sample groups from `step` until the trainer's next step is served. Returns why
        the run should stop instead, or None."""
        checked = -math.inf  # a new step just took some pending groups: look at once
        while True:
            served = await self.served_step()
            if served is not None and served > step:
                return None
            self.trainer.check_alive()
            if time.monotonic() > self.deadline:
                return "time budget"
            if time.monotonic() - checked > 2.0:
                # Which groups did the new step take? Later, rarely needed: the store has the last word.
                self.pending = [g for g in self.pending if await self._still_pending(g)]
                checked = time.monotonic()
            missing = self.settings.groups_per_step - len(self.pending)
            if missing <= 0:
                await asyncio.sleep(0.05)
                continue
            for group_id, results in await asyncio.gather(*(self.group("train") for _ in range(missing))):
                for score, _, sampled_by, _ in results:
                    if sampled_by is not None:
                        self.record.rewards_by_step.setdefault(sampled_by, []).append(score)
                rewards = [reward for _, reward, *_ in results]  # what the trainer sees
                if max(rewards) - min(rewards) > 1e-6:
                    self.pending.append(group_id)
                else:  # no spread: the trainer skips it (nothing to learn), so another takes its place
                    self.record.groups_skipped += 1
                self.perfect_in_a_row = self.perfect_in_a_row + 1 if min(rewards) >= 1.0 else 0
            if self.perfect_in_a_row >= self.options.converge_after:
                return "converged"  # every rollout earns the full reward: no group has anything left to teach


async def drive(
    url: str, settings: Settings, options: DemoOptions, trainer: Trainer, deadline: float, progress: bool
) -> Record:
    agent = Agent(url, settings, options, trainer, deadline, load_task(options.task))
    record = agent.record
    try:
        await agent.wait_for_step(0, "the untrained adapter (step 0)")
        record.baseline_reward, _ = await agent.evaluate()  # after a warm start: the distilled step
        record.baseline_at = time.monotonic()
        bar = steps_bar("training", options.steps, record.baseline_reward, progress)
        try:
            first = step = await agent.served_step() or 0  # a warm start's GRPO begins after its steps
            while step < first + options.steps:
                stop = await agent.train_round(step)
                rewards = record.rewards_by_step.get(step, [])
                await agent.read_mismatch(step if stop is None else None)
                if rewards and progress:
                    mismatch = record.mismatch_by_step.get(step)
                    bar.write(
                        f"step {step:3d}: reward {sum(rewards) / len(rewards):.2f}  ({len(rewards)} rollouts"
                        + ("" if mismatch is None else f", mismatch {mismatch:.1e}")
                        + ")"
                    )
                    for line in sample_lines(record.replies_by_step.get(step, [])):
                        bar.write(f"           {line}")
                if stop is not None:
                    record.stopped_because = stop
                    break
                if rewards:
                    bar.set_postfix_str(f"reward {sum(rewards) / len(rewards):.2f} (step {step})")
                step = await agent.served_step()
                bar.update(step - first - bar.n)
            else:
                record.stopped_because = "steps"
        finally:
            bar.close()
        record.final_reward, record.final_step = await agent.evaluate()
        record.final_at = time.monotonic()
        await agent.read_mismatch()
    finally:
        await agent.close()
    return record
