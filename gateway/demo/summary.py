"""The demo's outputs: summary.json and the reward curve."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from gateway.demo import load_task
from gateway.demo.agent import Record, spread
from gateway.demo.live import LiveStats
from gateway.demo.options import DemoOptions
from gateway.demo.words import dictionary_share
from gateway.settings import Settings

AIM_BASELINE_AT_MOST = 0.3
AIM_FINAL_AT_LEAST = 0.8
SAMPLES_PER_STEP = 8


def seconds_to_aim(record: Record, demo_started: float | None) -> float | None:
    """Wall time from the demo's start (a warm start's teacher and SFT included) to the first
    val evaluation that scored at least `AIM_FINAL_AT_LEAST`; None if none did."""
    if demo_started is None:
        return None
    for reward, at in ((record.baseline_reward, record.baseline_at), (record.final_reward, record.final_at)):
        if reward is not None and at is not None and reward >= AIM_FINAL_AT_LEAST:
            return round(at - demo_started, 1)
    return None


def summarize(
    record: Record,
    settings: Settings,
    options: DemoOptions,
    seconds: float,
    startup_seconds: float = 0.0,
    warm_start: dict | None = None,
    demo_started: float | None = None,
    live: LiveStats | None = None,
) -> dict:
    task = load_task(options.task)
    by_step = {str(step): sum(r) / len(r) for step, r in sorted(record.rewards_by_step.items())}
    samples = {str(step): spread(r, SAMPLES_PER_STEP) for step, r in sorted(record.replies_by_step.items())}
    # A warm start's baseline is the distilled model's score: only the final score is the aim then.
    reached = (
        record.baseline_reward is not None
        and record.final_reward is not None
        and (warm_start is not None or record.baseline_reward <= AIM_BASELINE_AT_MOST)
        and record.final_reward >= AIM_FINAL_AT_LEAST
    )
    return {
        "task": task.NAME,
        "task_description": task.DESCRIPTION,
        "baseline_reward": record.baseline_reward,
        "final_reward": record.final_reward,
        "final_step": record.final_step,
        "reward_by_step": by_step,
        "rollouts_by_step": {str(step): len(r) for step, r in sorted(record.rewards_by_step.items())},
        "mismatch_by_step": {str(step): m for step, m in sorted(record.mismatch_by_step.items())},
        # what was learned, read: replies of each step's train rollouts and of the final val set,
        # and how much of them is dictionary English (a gamed reward rises while it falls)
        "samples_by_step": samples,
        "final_samples": record.final_replies,
        "english": dictionary_share(record.final_replies),
        "english_by_step": {step: dictionary_share(texts) for step, texts in samples.items()},
        "groups_skipped": record.groups_skipped,
        "stopped_because": record.stopped_because,
        "engine": settings.engine,
        "seconds": round(seconds, 1),
        "startup_seconds": round(startup_seconds, 1),
        "seconds_to_aim": seconds_to_aim(record, demo_started),
        "warm_start": warm_start,
        # --live: the mode and what the stream did (None for the harness demo)
        "live": None if live is None else live.as_dict(),
        "aim": {"baseline_at_most": AIM_BASELINE_AT_MOST, "final_at_least": AIM_FINAL_AT_LEAST, "reached": reached},
        "demo": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items()},
        "settings": settings.public_dict(),
    }


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    steps = [int(s) for s in summary["reward_by_step"]]
    rewards = list(summary["reward_by_step"].values())
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    live = summary.get("live")
    what = f"live sessions ({live['mode']}: mean score per step)" if live else "train rollouts (mean reward per step)"
    ax.plot(steps, rewards, marker="o", markersize=3, label=what)
    if summary["baseline_reward"] is not None:
        first = min(steps, default=0) if summary.get("warm_start") else 0
        label = f"after sft (val, step {first})" if summary.get("warm_start") else "baseline (val, step 0)"
        ax.scatter([first], [summary["baseline_reward"]], color="tab:red", zorder=3, label=label)
    if summary["final_reward"] is not None:
        ax.scatter(
            [summary["final_step"] or 0],
            [summary["final_reward"]],
            color="tab:green",
            zorder=3,
            label=f"final (val, step {summary['final_step']})",
        )
    ax.axhline(AIM_FINAL_AT_LEAST, color="grey", linestyle="--", linewidth=1, label=f"aim {AIM_FINAL_AT_LEAST}")
    ax.set(
        xlabel="training step (adapter that sampled)",
        ylabel="reward",
        ylim=(-0.02, 1.02),
        title=f"rlproxy demo: {summary['task']} ({summary['seconds']:.0f} s)",
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
