"""Warm-started against cold-started demo runs: wall time to a val score of 0.8.

    python bench/warm_start.py                      # tic-tac-toe, seeds 0-2, both ways (about 30 min on 2 cores)
    python bench/warm_start.py --seeds 0 --out /tmp/ws

Each run is `rlproxy demo --task tictactoe` with its defaults, once as is (GRPO from the built-in
instruct model, its 480 s budget) and once with `--warm-start sft` (the scripted teacher's games
recorded and distilled first, then GRPO for `--warm-seconds`). The time counted is the demo's
wall time from its start (teacher recording and SFT included; the built-in model's build, a
one-off like a download, excluded) to the first val evaluation scoring at least 0.8
(`seconds_to_aim` in summary.json): after SFT for a warm start, at the end for a cold one (the
demo plays the val set before and after training only). Runs one at a time: two at once would share the cores.
Prints a markdown table; the summaries stay under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(out: Path, seed: int, warm: bool, warm_seconds: float) -> dict:
    cmd = [sys.executable, "-m", "gateway.cli", "demo", "--task", "tictactoe", "--seed", str(seed), "--out", str(out)]
    if warm:
        cmd += ["--warm-start", "sft", "--seconds", str(warm_seconds)]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=Path("/tmp/rlproxy-bench-warm-start"))
    parser.add_argument(
        "--warm-seconds",
        type=float,
        default=120.0,
        help="a warm run's GRPO budget after SFT (its time to 0.8 is usually the score after SFT already)",
    )
    args = parser.parse_args()
    rows = []
    for seed in args.seeds:
        for warm in (True, False):
            summary = run(args.out / f"{'warm' if warm else 'cold'}-{seed}", seed, warm, args.warm_seconds)
            rows.append((seed, warm, summary))
            print(f"seed {seed} {'warm' if warm else 'cold'}: {summary['seconds_to_aim']} s", file=sys.stderr)
    print("| seed | start | val after SFT | final val (step) | s to val >= 0.8 | demo s (incl. start-up) |")
    print("|---|---|---|---|---|---|")
    for seed, warm, s in rows:
        print(
            f"| {seed} | {'warm (sft)' if warm else 'cold'} | {fmt(s['baseline_reward'], 2) if warm else '-'} "
            f"| {fmt(s['final_reward'], 2)} ({s['final_step']}) | {fmt(s['seconds_to_aim'])} "
            f"| {fmt(s['seconds'] + s['startup_seconds'])} |"
        )
    for warm in (True, False):
        times = [s["seconds_to_aim"] for _, w, s in rows if w == warm and s["seconds_to_aim"] is not None]
        label = "warm" if warm else "cold"
        print(
            f"\nmedian s to val >= 0.8, {label}: {fmt(statistics.median(times)) if times else '-'} ({len(times)} runs)"
        )


if __name__ == "__main__":
    main()
