"""Training throughput: packed rows vs a padded batch, and our loss vs TRL's GRPO loss.

One batch of mixed-length samples (long-tailed completion lengths, as agent rollouts
are), a LoRA adapter on a small random Qwen2 (the architecture of the models rlproxy
serves; random weights make no difference to the compute). Each variant times
forward + GRPO loss + backward over the whole batch, median of `--runs` runs after one
warm-up, in a FRESH SUBPROCESS, so its peak resident memory (`ru_maxrss`, which sees
torch's allocations, unlike tracemalloc) is its own:

- packed: `trainer.packing.pack` rows of at most `--row-tokens` tokens, one
  forward/backward per row through the peft backend (`trainer.backends.peft`), loss
  from `trainer.losses` with batch-wide normalisation;
- padded: the same samples right-padded to the longest one, `--micro-batch` sequences per
  forward (TRL's default per-device batch of 8), same loss;
- trl: TRL's `GRPOTrainer._compute_loss` (what its `compute_loss` calls: the per-token
  logprobs through its fused LM head, then the clipped GRPO loss) + backward, on the
  same samples in TRL's layout (prompts left-padded, completions right-padded), same
  micro-batches. `_compute_loss` reads a dozen trainer attributes, so a GRPOTrainer is
  built around the same model and LoRA config, with a placeholder reward function and
  dataset that are never used (nothing is generated). TRL's default gradient
  checkpointing is turned off: it would recompute the forward in backward, which is a
  memory trade, not the loss path being compared.

TRL comes from PyPI into a venv under bench/out/ that sees the system packages, with
`torch==2.13.0` pinned on the same pip command line so it cannot pull another torch.

    python bench/train.py              # all variants, 3 timed runs each; installs TRL if missing
    python bench/train.py --no-trl     # skip TRL
    python bench/train.py --samples 16 # a batch without a long rollout: less padding to save

A second table measures the pi_old pass of a real training step (`trainer.step.train_step`:
pi_old scored without gradients before the first pass, then forward + loss + backward and
the optimizer step per pass), as the share of the step it takes: with
`--epochs-per-step 2`, and with one pass where LoRA dropout forces a separate pass (one
pass without dropout reuses the pass's own detached logprobs: no extra forward at all).

How much packing gains is how much padding there was to save: the table's `pad x` column
(tokens computed / real tokens) says it. With 32 samples one rollout is long (844 tokens)
and pads every other one, as a single long tool-using episode does in a real batch.

Results: a table on stdout, JSON in bench/out/train.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"
TRL_VENV = OUT / "trl-venv"
TORCH_PIN = "torch==2.13.0"
sys.path.insert(0, str(ROOT))

# A small Qwen2: big enough that matmuls, not Python, dominate; small enough for 2 CPU cores.
MODEL_CONFIG = dict(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)
LORA = dict(lora_rank=16, lora_alpha=32)
GROUP_SIZE = 4


# ---------------------------------------------------------------- the batch (same in every process)


def batch_spec(n_samples: int, seed: int = 0) -> list[dict]:
    """Prompt and completion ids of `n_samples` rollouts: prompts 32-160 tokens, completions
    log-normal around 120 tokens (a few near 700), capped so any sample fits a row."""
    rng = random.Random(seed)
    vocab = MODEL_CONFIG["vocab_size"]
    specs = []
    for _ in range(n_samples):
        prompt_len = rng.randint(32, 160)
        completion_len = max(8, min(700, int(rng.lognormvariate(math.log(120), 0.8))))
        specs.append(
            {
                "prompt": [rng.randrange(3, vocab) for _ in range(prompt_len)],
                "completion": [rng.randrange(3, vocab) for _ in range(completion_len)],
                "reward": float(rng.random() < 0.5) + rng.random() * 0.1,
                "noise": [rng.gauss(0.0, 0.05) for _ in range(completion_len)],
            }
        )
    return specs


def ensure_model(directory: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from gateway.models.tiny import ensure_tiny_model

    if (directory / "config.json").is_file():
        return directory
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**MODEL_CONFIG)).float()
    model.save_pretrained(directory)
    # Any tokenizer will do (ids are given): take the tiny model's.
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(ensure_tiny_model(OUT / "cache")).save_pretrained(directory)
    return directory


def build_samples(specs: list[dict], old_logprobs: list[list[float]]):
    """`Sample`s with group advantages; old logprobs = the model's own plus noise, so
    ratios differ from 1 and some tokens clip."""
    from trainer.advantages import compute_advantages
    from trainer.types import Sample

    groups = {f"g{i // GROUP_SIZE}": [] for i in range(len(specs))}
    for i, spec in enumerate(specs):
        groups[f"g{i // GROUP_SIZE}"].append(spec["reward"])
    advantages, _ = compute_advantages(groups)
    samples = []
    for i, spec in enumerate(specs):
        p, c = spec["prompt"], spec["completion"]
        adv = advantages.get(f"g{i // GROUP_SIZE}", [0.0] * GROUP_SIZE)[i % GROUP_SIZE]
        old = [math.nan] * len(p) + [lp + n for lp, n in zip(old_logprobs[i], spec["noise"], strict=False)]
        samples.append(
            Sample(
                tuple(p + c),
                (False,) * len(p) + (True,) * len(c),
                tuple(old),
                adv,
                f"t{i}",
                f"g{i // GROUP_SIZE}",
                reward=spec["reward"],  # --reward-kl (smollm2's default) takes the KL off it
            )
        )
    return samples


def maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def timed_runs(run_once, runs: int) -> tuple[list[float], float]:
    """(seconds of each timed run, loss of the last) after one warm-up run."""
    run_once()
    times, loss = [], None
    for _ in range(runs):
        started = time.perf_counter()
        loss = run_once()
        times.append(time.perf_counter() - started)
    return times, loss


# ---------------------------------------------------------------- variants (each in its own process)


def load_backend(model_dir: Path, state_dir: Path, **settings):
    from gateway.settings import Settings
    from trainer.backends.peft import PeftBackend

    return PeftBackend(Settings(base_model=str(model_dir), state_dir=state_dir, **LORA, **settings))


def sample_logprobs(model, specs) -> list[list[float]]:
    """Completion logprobs of each sample alone, adapter as loaded (no grad)."""
    import torch

    out = []
    with torch.no_grad():
        for spec in specs:
            ids = torch.tensor([spec["prompt"] + spec["completion"]])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
            n = len(spec["prompt"])
            out.append([float(logp[n + j - 1, t]) for j, t in enumerate(spec["completion"])])
    return out


def variant_ours(args, layout: str) -> dict:
    from trainer.losses import compute_loss
    from trainer.packing import PaddedBatch, pack, padded_batch, padded_token_logprobs
    from trainer.step import loss_config
    from trainer.types import LossNorm

    specs = batch_spec(args.samples)
    backend = load_backend(Path(args.model_dir), Path(tempfile.mkdtemp()))
    samples = build_samples(specs, sample_logprobs(backend.model, specs))
    config = loss_config(backend.settings)
    norm = LossNorm.from_samples(samples)
    real_tokens = sum(len(s.token_ids) for s in samples)

    if layout == "packed":
        rows = pack(samples, args.row_tokens)
        compute_tokens = sum(len(r.input_ids_T) for r in rows)
        forwards = len(rows)

        def run_once() -> float:
            backend.zero_grad()
            total = 0.0
            for row in rows:
                logprobs_T = backend.token_logprobs(row)
                loss, _ = compute_loss(
                    logprobs=logprobs_T,
                    old_logprobs=row.old_logprobs_T,
                    advantages=row.advantages_T,
                    loss_mask=row.loss_mask_T,
                    segment_ids=row.segment_ids_T,
                    trajectory_tokens=row.trajectory_tokens_T,
                    config=config,
                    norm=norm,
                )
                loss.backward()
                total += float(loss)
            return total
    else:
        full = padded_batch(samples, backend.pad_token_id)
        B, T = full.input_ids_BT.shape
        chunks = [
            PaddedBatch(*(getattr(full, f)[i : i + args.micro_batch] for f in full.__dataclass_fields__))
            for i in range(0, B, args.micro_batch)
        ]
        compute_tokens = B * T
        forwards = len(chunks)

        def run_once() -> float:
            backend.zero_grad()
            total = 0.0
            for chunk in chunks:
                logprobs_BT = padded_token_logprobs(backend.model, chunk)
                loss, _ = compute_loss(
                    logprobs=logprobs_BT,
                    old_logprobs=chunk.old_logprobs_BT,
                    advantages=chunk.advantages_BT,
                    loss_mask=chunk.loss_mask_BT,
                    segment_ids=chunk.segment_ids_BT,
                    trajectory_tokens=chunk.trajectory_tokens_BT,
                    config=config,
                    norm=norm,
                )
                loss.backward()
                total += float(loss)
            return total

    base_mb = maxrss_mb()
    times, loss = timed_runs(run_once, args.runs)
    return {
        "variant": layout,
        "times": times,
        "loss": loss,
        "real_tokens": real_tokens,
        "compute_tokens": compute_tokens,
        "forwards": forwards,
        "base_mb": base_mb,
        "peak_mb": maxrss_mb(),
    }


def variant_step(args, epochs: int, dropout: float) -> dict:
    """Whole `train_step`s: how much of one the pi_old pass takes."""
    from trainer.step import train_step

    specs = batch_spec(args.samples)
    backend = load_backend(
        Path(args.model_dir),
        Path(tempfile.mkdtemp()),
        epochs_per_step=epochs,
        lora_dropout=dropout,
        max_tokens_per_row=args.row_tokens,
    )
    samples = build_samples(specs, sample_logprobs(backend.model, specs))
    train_step(backend, samples, backend.settings)  # warm-up
    old, total = [], []
    for _ in range(args.runs):
        metrics = train_step(backend, samples, backend.settings)
        old.append(metrics["old_policy_seconds"])
        total.append(metrics["train_seconds"])
    return {
        "variant": f"step-e{epochs}-d{dropout}",
        "epochs": epochs,
        "dropout": dropout,
        "old_s": old,
        "step_s": total,
        "real_tokens": sum(len(s.token_ids) for s in samples),
    }


def variant_trl(args) -> dict:
    """TRL's GRPOTrainer._compute_loss + backward on the same samples (runs in the TRL venv)."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from trainer.advantages import compute_advantages
    from trainer.backends.peft import lora_targets

    model_dir = Path(args.model_dir)
    specs = batch_spec(args.samples)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(
        r=LORA["lora_rank"],
        lora_alpha=LORA["lora_alpha"],
        lora_dropout=0.0,
        target_modules=lora_targets(base),
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):  # the same adapter as the peft backend's (seed 0)
        torch.manual_seed(0)
        model = get_peft_model(base, lora)
    old_lp = sample_logprobs(model, specs)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    P = max(len(s["prompt"]) for s in specs)
    C = max(len(s["completion"]) for s in specs)
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=args.micro_batch,
        num_generations=GROUP_SIZE,
        max_completion_length=C,
        report_to="none",
        use_cpu=True,
        bf16=False,
        beta=0.0,
        loss_type="grpo",
        epsilon=0.2,
        scale_rewards="group",
        logging_steps=1000,
        save_strategy="no",
        gradient_checkpointing=False,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=config,
        train_dataset=Dataset.from_list([{"prompt": "unused"}] * GROUP_SIZE),
        processing_class=tokenizer,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which is not run

    groups = {}
    for i, spec in enumerate(specs):
        groups.setdefault(f"g{i // GROUP_SIZE}", []).append(spec["reward"])
    advantages, _ = compute_advantages(groups)
    pad = tokenizer.pad_token_id
    micro = []
    for start in range(0, len(specs), args.micro_batch):
        part = range(start, min(start + args.micro_batch, len(specs)))
        prompt_ids = torch.full((len(part), P), pad)
        prompt_mask = torch.zeros((len(part), P), dtype=torch.long)
        completion_ids = torch.full((len(part), C), pad)
        completion_mask = torch.zeros((len(part), C), dtype=torch.long)
        old = torch.zeros((len(part), C))
        adv = torch.zeros(len(part))
        for b, i in enumerate(part):
            p, c = specs[i]["prompt"], specs[i]["completion"]
            prompt_ids[b, P - len(p) :] = torch.tensor(p)  # TRL left-pads prompts
            prompt_mask[b, P - len(p) :] = 1
            completion_ids[b, : len(c)] = torch.tensor(c)
            completion_mask[b, : len(c)] = 1
            old[b, : len(c)] = torch.tensor([lp + n for lp, n in zip(old_lp[i], specs[i]["noise"], strict=False)])
            adv[b] = advantages.get(f"g{i // GROUP_SIZE}", [0.0] * GROUP_SIZE)[i % GROUP_SIZE]
        micro.append(
            {
                "prompt_ids": prompt_ids,
                "prompt_mask": prompt_mask,
                "completion_ids": completion_ids,
                "completion_mask": completion_mask,
                "advantages": adv,
                "old_per_token_logps": old,
                "num_items_in_batch": completion_mask.sum(),
            }
        )

    def run_once() -> float:
        trainer.model.zero_grad(set_to_none=True)
        total = 0.0
        for inputs in micro:
            loss = trainer._compute_loss(trainer.model, inputs)
            loss.backward()
            total += float(loss) * len(inputs["advantages"]) / len(specs)  # micro-batch means -> batch mean
        return total

    base_mb = maxrss_mb()
    times, loss = timed_runs(run_once, args.runs)
    real = sum(len(s["prompt"]) + len(s["completion"]) for s in specs)
    return {
        "variant": "trl",
        "times": times,
        "loss": loss,
        "real_tokens": real,
        "compute_tokens": len(specs) * (P + C),
        "forwards": len(micro),
        "base_mb": base_mb,
        "peak_mb": maxrss_mb(),
        "trl_version": __import__("trl").__version__,
    }


# ---------------------------------------------------------------- driver


def ensure_trl() -> Path | None:
    python = TRL_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(TRL_VENV)], check=True)
    probe = subprocess.run([str(python), "-c", "import trl"], capture_output=True)
    if probe.returncode != 0:
        print(f"installing TRL into {TRL_VENV} (pip install trl {TORCH_PIN}) ...", file=sys.stderr)
        done = subprocess.run([str(python), "-m", "pip", "install", "-q", "trl", TORCH_PIN])
        if done.returncode != 0:
            print("TRL could not be installed; its row is left out", file=sys.stderr)
            return None
    return python


def run_child(python: str, variant: str, args, model_dir: Path) -> dict:
    cmd = [
        python,
        __file__,
        "--child",
        variant,
        "--model-dir",
        str(model_dir),
        "--samples",
        str(args.samples),
        "--runs",
        str(args.runs),
        "--row-tokens",
        str(args.row_tokens),
        "--micro-batch",
        str(args.micro_batch),
        "--threads",
        str(args.threads),
    ]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
        "TRANSFORMERS_VERBOSITY": "error",
        "OMP_NUM_THREADS": str(args.threads),
    }
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"variant {variant} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-trl", action="store_true", help="skip the TRL comparison")
    parser.add_argument("--samples", type=int, default=32, help="rollouts in the batch (groups of 4)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per variant (median reported)")
    parser.add_argument("--row-tokens", type=int, default=1024, help="packing: max tokens per row")
    parser.add_argument("--micro-batch", type=int, default=8, help="padded/TRL: sequences per forward")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: stable figures on a shared machine)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        if args.child == "trl":
            result = variant_trl(args)
        elif args.child.startswith("step-"):
            _, epochs, dropout = args.child.split("-")
            result = variant_step(args, int(epochs), float(dropout))
        else:
            result = variant_ours(args, args.child)
        print(json.dumps(result))
        return 0

    OUT.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_model(OUT / "bench-qwen2-small")
    results = [
        run_child(sys.executable, "packed", args, model_dir),
        run_child(sys.executable, "padded", args, model_dir),
    ]
    if not args.no_trl:
        python = ensure_trl()
        if python is not None:
            results.append(run_child(str(python), "trl", args, model_dir))

    print(
        f"\n{args.samples} samples, {results[0]['real_tokens']} tokens; Qwen2 {MODEL_CONFIG['hidden_size']}x"
        f"{MODEL_CONFIG['num_hidden_layers']} layers, vocab {MODEL_CONFIG['vocab_size']}, LoRA r{LORA['lora_rank']}; "
        f"{args.threads} thread(s); forward + loss + backward, median of {args.runs}\n"
    )
    header = (
        f"{'variant':<26}{'forwards':>9}{'computed tok':>14}{'pad x':>7}{'seconds':>9}{'tokens/s':>10}{'vs padded':>11}"
        f"{'peak MB':>9}{'+MB':>7}{'loss':>10}"
    )
    print(header)
    print("-" * len(header))
    padded_tps = None
    for r in results:
        r["median_s"] = statistics.median(r["times"])
        r["tokens_per_s"] = r["real_tokens"] / r["median_s"]
        if r["variant"] == "padded":
            padded_tps = r["tokens_per_s"]
    names = {
        "packed": f"ours, packed ({args.row_tokens}/row)",
        "padded": f"ours, padded ({args.micro_batch}/fwd)",
        "trl": f"TRL {results[-1].get('trl_version', '')} _compute_loss",
    }
    for r in results:
        print(
            f"{names[r['variant']]:<26}{r['forwards']:>9}{r['compute_tokens']:>14}"
            f"{r['compute_tokens'] / r['real_tokens']:>7.2f}{r['median_s']:>9.3f}"
            f"{r['tokens_per_s']:>10.0f}{r['tokens_per_s'] / padded_tps:>10.2f}x{r['peak_mb']:>9.0f}"
            f"{r['peak_mb'] - r['base_mb']:>7.0f}{r['loss']:>10.5f}"
        )
    print(
        "\ntokens/s counts real (non-padding) tokens; peak MB = ru_maxrss of the variant's own process, "
        "+MB = above its size once model and batch were loaded."
    )
    steps = [run_child(sys.executable, child, args, model_dir) for child in ("step-1-0.05", "step-2-0.0")]
    print(
        f"\npi_old pass of a training step (trainer.step.train_step incl. the optimizer step), median of {args.runs}\n"
    )
    header = f"{'step':<34}{'pi_old s':>10}{'step s':>9}{'pi_old share':>14}{'target':>9}"
    print(header)
    print("-" * len(header))
    for r in steps:
        r["median_old_s"], r["median_step_s"] = statistics.median(r["old_s"]), statistics.median(r["step_s"])
        share = r["median_old_s"] / r["median_step_s"]
        r["share"] = share
        what = f"{r['epochs']} pass(es), LoRA dropout {r['dropout']}"
        print(f"{what:<34}{r['median_old_s']:>10.3f}{r['median_step_s']:>9.3f}{share:>13.1%}{'<= 35%':>9}")
    print("one pass without dropout: pi_old = the pass's own detached logprobs, 0 s (no extra forward)")
    (OUT / "train.json").write_text(json.dumps({"args": vars(args), "results": results, "steps": steps}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
