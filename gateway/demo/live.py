"""`rlproxy demo --live rewards|shadows`: the agent as production traffic, not a harness.

A harness runs each task K times under one X-Group-Id and rewards every rollout at once;
production has none of that. Here sessions arrive one at a time, as a Poisson stream
(`--arrival-rate` per second), each a single episode with no X-Group-Id (SHOUT: one call;
the gateway derives their task key from the system prompt every session of the task
shares), and the stream never waits for the trainer:

- `rewards`: a session's reward is posted after a random delay in [0, `--reward-delay`] s,
  and a share of sessions (`--unrewarded-share`) is never rewarded. The gateway gathers the
  rewarded ones into live groups of `--rollouts` (`--live-group-size`), and a reward for a
  session answered by a step more than `--live-max-staleness` behind the newest is kept but
  never trained (its answer says `trainable: false`: counted as stale). `--shuffle-rewards`
  is the control: each session is posted the score of another recent session, so a reward
  says nothing about the reply it is posted for.
- `shadows`: no reward is ever posted. The gateway samples `--rollouts - 1` shadow
  completions beside each live call, and the scripted judge (`gateway.demo.judge`) ranks the
  live answer and its shadows through RULER; those scores are the group's rewards.

The baseline and final scores are the harness demo's: `Agent.evaluate`, the held-out val set
played as harness groups in split val (never trained, never shadowed).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from dataclasses import asdict, dataclass

from gateway.demo import load_task
from gateway.demo.agent import Agent, Record, episode_scores, sample_lines, steps_bar
from gateway.demo.options import LIVE_ARRIVAL_RATES, DemoOptions
from gateway.demo.processes import Trainer
from gateway.errors import RLProxyError
from gateway.settings import Settings

RECENT = 64  # --shuffle-rewards draws another session's score from the last this many


@dataclass
class LiveStats:
    """What the stream did, for summary.json (`live`)."""

    mode: str  # rewards or shadows
    origin: str  # the origin of the groups the stream makes: live or shadow
    sessions: int = 0  # sessions played to the end
    rewarded: int = 0  # rewards posted
    unrewarded: int = 0  # sessions never rewarded (by --unrewarded-share, or every one with shadows)
    stale_rewards: int = 0  # posted, answered `trainable: false` for staleness
    untrainable_rewards: int = 0  # posted, answered `trainable: false` for another reason
    groups_trained: int = 0  # groups of the stream's origin (live or shadow) a step trained
    groups_skipped: int = 0  # ... that the trainer skipped (no reward spread, or too stale)
    groups_judged: int = 0  # shadow groups RULER scored (ruler_status 'scored')

    def as_dict(self) -> dict:
        return asdict(self)


class LiveStream:
    """Plays sessions as they arrive and posts their rewards later, until the run should stop."""

    def __init__(self, agent: Agent):
        self.agent = agent
        self.options = agent.options
        self.origin = "shadow" if self.options.live == "shadows" else "live"
        self.stats = LiveStats(mode=agent.options.live or "", origin=self.origin)
        self.rng = random.Random(f"live-{agent.settings.seed}")
        self.recent: deque[tuple[str, float]] = deque(maxlen=RECENT)  # (session, its training reward)
        self.tasks: set[asyncio.Task] = set()
        self.failure: BaseException | None = None

    def _spawn(self, session_id: str) -> None:
        task = asyncio.create_task(self.session(session_id))
        self.tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self.failure = task.exception()

    async def session(self, session_id: str) -> None:
        """One live session: the task's episode with no group, then (maybe, later) its reward."""
        agent, record = self.agent, self.agent.record
        steps: list[int] = []
        replies: list[tuple[int | None, str]] = []
        chat = agent.chat_in({"X-Session-Id": session_id}, steps, self.rng, replies)  # no X-Group-Id: live traffic
        result = await agent.task.episode(agent.task.sample(self.rng), chat)
        reward, score = episode_scores(result)
        self.stats.sessions += 1
        if steps:
            record.rewards_by_step.setdefault(min(steps), []).append(score)
        for step, text in replies:
            if step is not None:
                record.replies_by_step.setdefault(step, []).append(text)
        if self.options.live != "rewards" or self.rng.random() < self.options.unrewarded_share:
            self.stats.unrewarded += 1
            return
        self.recent.append((session_id, reward))
        await asyncio.sleep(self.rng.uniform(0.0, self.options.reward_delay))
        posted = reward
        if self.options.shuffle_rewards:
            others = [r for s, r in self.recent if s != session_id]
            posted = self.rng.choice(others) if others else reward
        response = await agent.http.post(
            f"/v1/sessions/{session_id}/reward", json={"reward": posted, "metrics": {"score": score}}
        )
        response.raise_for_status()
        self.stats.rewarded += 1
        answer = response.json()
        if answer.get("trainable") is False:
            if str(answer.get("reason", "")).startswith("stale"):
                self.stats.stale_rewards += 1
            else:
                self.stats.untrainable_rewards += 1

    async def converged(self) -> bool:
        """The harness demo's rule (`--converge-after`), on the stream's groups: the newest
        converge_after complete ones (live: closed; shadow: judged) gave every session the full
        reward. Such groups have no spread, the trainer skips them: nothing is left to learn."""
        n = self.options.converge_after
        params = {"origin": self.origin, "split": "train", "limit": min(4 * n + 8, 200)}
        response = await self.agent.http.get("/v1/groups", params=params)
        response.raise_for_status()
        done = "ruler_status" if self.origin == "shadow" else "closed"
        complete = [group for group in response.json()["data"] if group.get(done) in ("scored", True)][:n]
        return len(complete) == n and all((group.get("reward_min") or 0.0) >= 1.0 for group in complete)

    async def run(self, first: int, on_step) -> str:
        """Sessions arrive until `options.steps` steps after `first` are served, the budget
        is spent or the policy converged; returns why it stopped. `on_step(done, newest)` is
        called as each new step is served, with the step that was served before it."""
        agent, rate = self.agent, self.options.arrival_rate or LIVE_ARRIVAL_RATES[self.options.live or "rewards"]
        served, n = first, 0
        next_arrival = checked = looked = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                if self.failure is not None:
                    raise RLProxyError(f"a live session failed: {self.failure!r}") from self.failure
                if now - checked >= 0.2:
                    checked = now
                    agent.trainer.check_alive()
                    newest = await agent.served_step() or 0
                    if newest > served:
                        on_step(served, newest)
                        served = newest
                    if served >= first + self.options.steps:
                        return "steps"
                    if now > agent.deadline:
                        return "time budget"
                if now - looked >= 1.0:
                    looked = now
                    if await self.converged():
                        return "converged"
                while next_arrival <= now:
                    n += 1
                    self._spawn(f"live-{agent.settings.seed}-{n:06d}")
                    next_arrival += self.rng.expovariate(rate)
                await asyncio.sleep(max(0.0, min(0.05, next_arrival - time.monotonic())))
        finally:
            await self.drain()

    async def drain(self) -> None:
        """Let sessions in flight finish and post their rewards (a few seconds at most), then
        cancel what is left."""
        if self.tasks:
            await asyncio.wait(set(self.tasks), timeout=self.options.reward_delay + 10.0)
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)

    async def count_groups(self) -> None:
        """The stream's groups, trained, skipped and (shadows) judged: GET /v1/groups?origin=..."""
        cursor = None
        while True:
            params: dict = {"limit": 200, "origin": self.origin, **({"cursor": cursor} if cursor else {})}
            response = await self.agent.http.get("/v1/groups", params=params)
            response.raise_for_status()
            page = response.json()
            for group in page["data"]:
                self.stats.groups_trained += group.get("trained_step") is not None
                self.stats.groups_skipped += group.get("skipped") is not None
                self.stats.groups_judged += group.get("ruler_status") == "scored"
            cursor = page.get("next_cursor")
            if not page.get("has_more") or not cursor:
                return


async def drive_live(
    url: str, settings: Settings, options: DemoOptions, trainer: Trainer, deadline: float, progress: bool
) -> tuple[Record, LiveStats]:
    """Baseline on val, the live stream, final score on val (`agent.drive`'s shape)."""
    agent = Agent(url, settings, options, trainer, deadline, load_task(options.task))
    record = agent.record
    stream = LiveStream(agent)
    try:
        await agent.wait_for_step(0, "the untrained adapter (step 0)")
        record.baseline_reward, _ = await agent.evaluate()
        record.baseline_at = time.monotonic()
        bar = steps_bar(f"live {options.live}", options.steps, record.baseline_reward, progress)
        first = await agent.served_step() or 0

        def on_step(done: int, newest: int) -> None:
            scores = record.rewards_by_step.get(done, [])
            if scores:
                mean = sum(scores) / len(scores)
                bar.write(f"step {done:3d}: reward {mean:.2f}  ({len(scores)} live sessions)")
                for line in sample_lines(record.replies_by_step.get(done, [])):
                    bar.write(f"           {line}")
                bar.set_postfix_str(f"reward {mean:.2f} (step {done})")
            bar.update(min(newest - first, options.steps) - bar.n)

        try:
            record.stopped_because = await stream.run(first, on_step)
        finally:
            bar.close()
        record.final_reward, record.final_step = await agent.evaluate()
        record.final_at = time.monotonic()
        await agent.read_mismatch()
        await stream.count_groups()
    finally:
        await agent.close()
    return record, stream.stats
