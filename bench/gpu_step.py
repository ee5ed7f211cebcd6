"""One GRPO training step of rlproxy's trainer on a GPU, checked against the same step on CPU float32.

Per model, `trainer.step.train_step` with the peft backend (`trainer.backends.load_backend`, as the worker
builds it) runs on CPU in float32 (the reference), then on `--device`: same batch, same initial LoRA
(lora_A as the backend draws it, lora_B drawn with std 0.01 so every gradient is non-trivial). Compared:
the loss, the LoRA gradients as `optimizer_step` gets them (before clipping), the weights after AdamW.
Then `--runs` device steps more (the compared one was the warm-up), timed with the device synchronised.

The batch, as bench/smollm2.py's: 32 rollouts (8 groups of 4) of a 41-45-token prompt + 16 completion
tokens, random ids, behaviour logprobs = the CPU model's + noise (std 0.05), uniform rewards. Each model's
tuned settings (`gateway.models.tuning`) at LoRA rank 16, alpha 32: `tiny`, the built-in tiny model (lr
1e-2, beta 0); `smollm2-random`, SmolLM2-135M's config.json (Llama: 30 layers, hidden 576, 9 heads over 3
KV heads, vocab 49152, tied) with random weights (seed 0, saved in float32: the real ones are too big to
carry, and time the same), smollm2's settings (lr 1e-3, beta 0.2, low_var_kl, reward_kl 0.1).

On CUDA the backend loads the base in bfloat16 (`trainer.backends.peft.model_dtype`; LoRA stays float32);
`--dtype float32` forces float32 (`--dtype auto float32`: a row each). `grad cos`: cosine of the flattened
LoRA gradients; `grad rel`: ||g_dev - g_cpu|| / ||g_cpu||; `upd cos`: of the updates (AdamW's first is
~lr * sign(g)). Exit 1 when a model fails, a device loss is not finite, or `grad cos` < 0.9999 (float32
base) or < 0.95 (16-bit base: on CPU, bfloat16 gave 0.989 on the tiny model, whose logits are large,
0.9998 on smollm2-random; a mask leaking across packed samples gave -0.03).

    python bench/gpu_step.py --device cuda --dtype auto float32 --json bench/out/gpu_step.json
    python bench/gpu_step.py --device cpu --runs 1 --threads 1           # CPU against CPU: a smoke test
    python bench/gpu_step.py --device cpu --dtype bfloat16 --threads 1   # the GPU's precision, on CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# `python bench/gpu_step.py` puts bench/ first on sys.path, where bench/vllm.py would shadow `vllm`: the root instead.
sys.path[0:1] = [str(ROOT)] if Path(sys.path[0] or ".").resolve() == ROOT / "bench" else [str(ROOT), sys.path[0]]

# The config.json of the built-in smollm2 conversion (gateway/models/smollm2.py; transformers 5.24 wrote it).
SMOLLM2_CONFIG = json.loads("""{
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 1,
  "dtype": "float32", "eos_token_id": 2, "head_dim": 64, "hidden_act": "silu", "hidden_size": 576,
  "initializer_range": 0.02, "intermediate_size": 1536, "max_position_embeddings": 8192, "mlp_bias": false,
  "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
  "pad_token_id": 2, "pretraining_tp": 1, "rms_norm_eps": 9.999999747378752e-06,
  "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "tie_word_embeddings": true,
  "unk_token_id": 0, "use_cache": true, "vocab_size": 49152
}""")
MODELS = ("tiny", "smollm2-random")
SAMPLES, COMPLETION_TOKENS, RANK = 32, 16, 16  # groups of 4: bench/train.py's GROUP_SIZE
MIN_COSINE = {"float32": 0.9999}  # a 16-bit base: 0.95


def model_settings(name: str, workdir: Path, device: str):
    from gateway.models.tuning import SMOLLM2_SETTINGS, for_model
    from gateway.settings import TINY_MODEL_ID, Settings

    lora = {"lora_rank": RANK, "lora_alpha": 2 * RANK}
    if name == "tiny":
        return for_model(Settings(base_model=TINY_MODEL_ID, state_dir=workdir, device=device, **lora))
    base = str(random_smollm2(workdir))
    return Settings(base_model=base, state_dir=workdir, device=device, **SMOLLM2_SETTINGS | lora)


def random_smollm2(workdir: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from gateway.models.cache import model_cache_dir
    from gateway.models.tiny import ensure_tiny_model

    directory = workdir / "smollm2-random"
    if not (directory / "config.json").is_file():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            LlamaForCausalLM(LlamaConfig(**SMOLLM2_CONFIG)).float().save_pretrained(directory)
        AutoTokenizer.from_pretrained(ensure_tiny_model(model_cache_dir(workdir))).save_pretrained(directory)
    return directory


def load(settings, dtype: str):
    """The backend as the worker loads it; a `dtype` other than auto overrides the base weights' dtype."""
    import torch

    import trainer.backends.peft as peft_backend
    from trainer.backends import load_backend

    chosen = peft_backend.model_dtype
    if dtype != "auto":
        peft_backend.model_dtype = lambda device: getattr(torch, dtype)
    try:
        return load_backend(settings)
    finally:
        peft_backend.model_dtype = chosen


def lora(backend) -> list:
    return [(name, p) for name, p in backend.model.named_parameters() if p.requires_grad]


def make_samples(backend, seed: int = 0) -> list:
    """The batch, its behaviour logprobs scored by `backend` (the CPU reference, its LoRA drawn)."""
    from bench.train import build_samples, sample_logprobs

    rng, vocab = random.Random(seed), backend.model.get_input_embeddings().weight.shape[0]
    specs = []
    for _ in range(SAMPLES):
        prompt = rng.randint(41, 45)
        ids = [rng.randrange(3, vocab) for _ in range(prompt + COMPLETION_TOKENS)]
        reward = rng.random()
        noise = [rng.gauss(0.0, 0.05) for _ in range(COMPLETION_TOKENS)]
        specs.append({"prompt": ids[:prompt], "completion": ids[prompt:], "reward": reward, "noise": noise})
    return build_samples(specs, sample_logprobs(backend.model, specs))


def step(backend, samples, capture: bool = True) -> dict:
    """One `train_step`: metrics, seconds; with `capture`, the LoRA gradients before clipping and the weights after."""
    import torch

    from trainer.step import NonFiniteStep, train_step

    seen: dict = {}
    inner = backend.optimizer_step

    def capturing(require_finite: bool = False) -> float:
        seen["grads"] = [p.grad.double().cpu() for _, p in lora(backend)]  # every LoRA weight gets one
        return inner(require_finite=require_finite)

    if capture:
        backend.optimizer_step = capturing
    synchronize = torch.cuda.synchronize if backend.device.type == "cuda" else lambda: None
    synchronize()
    started = time.perf_counter()
    try:
        metrics = train_step(backend, samples, backend.settings)
    except NonFiniteStep as exc:
        metrics = {"loss": math.nan, "error": str(exc)}
    finally:
        backend.__dict__.pop("optimizer_step", None)  # the class's method again
    synchronize()
    seconds = time.perf_counter() - started
    weights = [p.detach().double().cpu() for _, p in lora(backend)] if capture else None
    return {"metrics": metrics, "seconds": seconds, "grads": seen.get("grads"), "weights": weights}


def agreement(reference: list, got: list | None) -> dict:
    """How far `got` (tensors) is from `reference`, flattened: cosine, relative L2, max abs, max abs / max |ref|."""
    import torch

    if got is None:
        return dict.fromkeys(("cos", "rel", "max_abs", "max_rel"), math.nan)
    a, b = torch.cat([t.flatten() for t in reference]), torch.cat([t.flatten() for t in got])
    d, na, nb = b - a, a.norm(), b.norm()
    cos = float(a @ b / (na * nb)) if na > 0 and nb > 0 else math.nan
    rel, max_rel = (float(d.norm() / na), float(d.abs().max() / a.abs().max())) if na > 0 else (math.nan, math.nan)
    return {"cos": cos, "rel": rel, "max_abs": float(d.abs().max()), "max_rel": max_rel}


def run_model(name: str, args, workdir: Path) -> list[dict]:
    import torch

    cpu = load(model_settings(name, workdir, "cpu"), "float32")
    generator = torch.Generator().manual_seed(1)
    for _, p in [(n, p) for n, p in lora(cpu) if "lora_B" in n]:
        p.data.copy_(torch.randn(p.shape, generator=generator) * 0.01)
    initial = {param_name: p.detach().clone() for param_name, p in lora(cpu)}
    samples = make_samples(cpu)
    tokens = sum(len(s.token_ids) for s in samples)
    print(f"{name}: {SAMPLES} samples, {tokens} tokens; CPU float32 reference step ...", file=sys.stderr, flush=True)
    reference = step(cpu, samples)
    del cpu
    start = [w.double() for w in initial.values()]
    ref_updates = [w - w0 for w, w0 in zip(reference["weights"], start, strict=True)]
    rows = []
    for dtype in args.dtype:
        print(f"{name}: {args.device} ({dtype}) ...", file=sys.stderr, flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        backend = load(model_settings(name, workdir, args.device), dtype)
        for param_name, p in lora(backend):
            p.data.copy_(initial[param_name])  # to the device, in its dtype
        base, adapter = backend.model.get_input_embeddings().weight.dtype, lora(backend)[0][1].dtype
        got = step(backend, samples)  # the compared step, and the warm-up
        times = [step(backend, samples, capture=False)["seconds"] for _ in range(args.runs)]
        peak = torch.cuda.max_memory_allocated() / 2**20 if backend.device.type == "cuda" else None
        del backend
        grads = agreement(reference["grads"], got["grads"])
        updates = agreement(ref_updates, [w - w0 for w, w0 in zip(got["weights"], start, strict=True)])
        loss, median = float(got["metrics"]["loss"]), statistics.median(times) if times else got["seconds"]
        dtypes = f"{base}/{adapter}".replace("torch.", "")
        row = dict(model=name, device=args.device, dtype=dtype, dtypes=dtypes, tokens=tokens, grad=grads)
        row.update(update=updates, loss_cpu=float(reference["metrics"]["loss"]), loss_device=loss)
        row.update(weights_max_abs=agreement(reference["weights"], got["weights"])["max_abs"])
        row.update(cpu_step_s=reference["seconds"], first_step_s=got["seconds"], step_s=times, median_step_s=median)
        row.update(tokens_per_s=tokens / median, speedup=reference["seconds"] / median, peak_cuda_mb=peak)
        row.update(
            peak="-" if peak is None else f"{peak:.0f}", span=f"{min(times):.3f}-{max(times):.3f}" if times else "-"
        )
        row.update(metrics_cpu=reference["metrics"], metrics_device=got["metrics"])
        floor = MIN_COSINE.get(dtypes.split("/")[0], 0.95)
        row["problems"] = [f"device loss {loss}"] if not math.isfinite(loss) else []
        row["problems"] += [f"grad cos {grads['cos']:.6f} < {floor}"] if not grads["cos"] >= floor else []
        rows.append(row)
    return rows


# fmt: off
AGREEMENT = [("loss cpu", 11, "{loss_cpu:.6f}"), ("loss dev", 11, "{loss_device:.6f}"),
             ("grad cos", 11, "{grad[cos]:.6f}"), ("grad rel", 10, "{grad[rel]:.2e}"),
             ("max|d|/max|g|", 14, "{grad[max_rel]:.2e}"), ("upd cos", 9, "{update[cos]:.4f}"),
             ("w max|d|", 10, "{weights_max_abs:.2e}")]
TIMING = [("tokens", 7, "{tokens}"), ("cpu step s", 11, "{cpu_step_s:.3f}"), ("first s", 9, "{first_step_s:.3f}"),
          ("median s", 10, "{median_step_s:.4f}"), ("min-max s", 16, "{span}"), ("tok/s", 10, "{tokens_per_s:.0f}"),
          ("vs cpu", 8, "{speedup:.1f}x"), ("peak MB", 9, "{peak}")]
# fmt: on


def table(title: str, rows: list[dict], columns: list, verdict: bool = False) -> None:
    print(f"\n{title}\n")
    head = f"{'model':<16}{'device':<8}{'base/lora':<18}" + "".join(f"{h:>{w}}" for h, w, _ in columns)
    print(head + ("  ok" if verdict else "") + "\n" + "-" * len(head))
    for r in rows:
        cells = "".join(f"{c.format(**r):>{w}}" for _, w, c in columns)
        ok = ("  yes" if not r["problems"] else "  NO: " + "; ".join(r["problems"])) if verdict else ""
        print(f"{r['model']:<16}{r['device']:<8}{r['dtypes']:<18}{cells}{ok}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:1, ... or cpu (CPU against CPU: a smoke test)")
    parser.add_argument("--runs", type=int, default=5, help="timed steps on the device after the compared one")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument(
        "--dtype", nargs="+", choices=["auto", "float32", "bfloat16", "float16"], default=["auto"],
        help="the device's base weights: auto (the backend's: bfloat16 on CUDA), or forced; several: a row each",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.pop("RLPROXY_CACHE_DIR", None)  # the tiny model builds in the temporary state dir
    import peft
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    gpu = args.device.startswith("cuda") and torch.cuda.is_available() and torch.cuda.get_device_name(args.device)
    env = dict(python=sys.version.split()[0], torch=torch.__version__, transformers=transformers.__version__)
    env.update(peft=peft.__version__, cpu_threads=torch.get_num_threads(), cuda=torch.version.cuda)
    env.update(gpu=gpu or None, tf32=torch.backends.cuda.matmul.allow_tf32)
    print(" ".join(f"{k}={v}" for k, v in env.items()), file=sys.stderr, flush=True)
    workdir, rows = Path(tempfile.mkdtemp(prefix="gpu-step-")), []
    try:
        for name in args.models:
            try:
                rows += run_model(name, args, workdir)
            except Exception as exc:  # the other model still runs; the run fails
                traceback.print_exc()
                rows.append({"model": name, "problems": [f"{type(exc).__name__}: {exc}"]})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    done = [r for r in rows if "dtypes" in r]
    table("agreement with the CPU float32 step (same batch, same initial LoRA)", done, AGREEMENT, verdict=True)
    table("timing: the CPU step is the reference (1 run, cold); the device's: median of --runs", done, TIMING)
    problems = [f"{r['model']} {r.get('dtype', '')}: {p}" for r in rows for p in r["problems"]]
    print(f"\n{' '.join(f'{k}={v}' for k, v in env.items())}")
    print("FAILED: " + "; ".join(problems) if problems else "all device steps agree with CPU float32")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result = {"env": env, "args": {**vars(args), "json": str(args.json)}, "rows": rows}
        args.json.write_text(json.dumps(result, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
