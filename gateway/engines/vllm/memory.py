"""How much of a shared GPU vLLM may take in colocated mode (`--gpu-memory-utilization`).

vLLM's default share (0.92) is sized for a card it has to itself. Colocated, the trainer is a
second process on the same card that keeps its copy of the base model (plus LoRA, AdamW state
and its CUDA context) resident the whole time; only while a step trains does vLLM sleep and
give back its weights and KV cache for the trainer's activations. So vLLM may take what is
left after the trainer's resident memory and a margin:

    share = (card - trainer_resident - margin) / card,   at most MAX_SHARE
    trainer_resident = bytes per parameter x parameters + TRAINER_OVERHEAD_GIB

and refuses (pointing at `--gpu-mode dedicated`) where that share cannot hold vLLM's own
weights plus VLLM_MIN_EXTRA_GIB: such a model does not fit twice on the card.

Parameters come from the model id ("Qwen2.5-7B-Instruct" -> 7e9) or, for a local directory,
from its safetensors bytes; the card's memory from `nvidia-smi` (the gateway never touches
CUDA itself: a CUDA context in the gateway would cost the trainer ~0.5 GiB). When either is
unknown the share is FALLBACK_SHARE and a warning says how to set it (`--vllm-arg
--gpu-memory-utilization=S`, which always wins).
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from pathlib import Path

from gateway.errors import ConfigError

log = logging.getLogger("rlproxy.engines.vllm")

GIB = 1024**3
BYTES_PER_PARAM = 2.0  # bf16: the trainer's base and vLLM's (no 4-bit with vLLM: `Settings` refuses it)
"""The trainer's base weights: bf16 (2 bytes), or bnb 4-bit (0.5 bytes + quantisation state)."""
TRAINER_OVERHEAD_GIB = 2.5
"""CUDA context (~0.5 GiB), LoRA weights and AdamW moments, the caching allocator's slack."""
MARGIN_GIB = 1.0
"""What vLLM's sleeping residue (CUDA graphs, its context) and fragmentation need on top."""
VLLM_MIN_EXTRA_GIB = 3.0
"""What vLLM needs beyond its weights to serve at all: a few GiB of KV cache, activations, graphs."""
MIN_SHARE, MAX_SHARE, FALLBACK_SHARE = 0.25, 0.9, 0.5

_SIZE_IN_NAME = re.compile(r"(?<![0-9.])(\d+(?:\.\d+)?)\s*[bB](?![a-zA-Z])")


def params_from_model(base_model: str) -> float | None:
    """Parameters of `base_model`: from a local directory's safetensors (bf16 bytes / 2), else from
    a size in its name ("7B", "0.5B"; for "8x7B" mixtures the product). None when unknown."""
    path = Path(base_model)
    if path.is_dir():
        total = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        if total:
            return total / 2.0
    name = base_model.rsplit("/", 1)[-1]
    experts = re.search(r"(\d+)x(\d+(?:\.\d+)?)[bB](?![a-zA-Z])", name)
    if experts:
        return int(experts.group(1)) * float(experts.group(2)) * 1e9
    match = _SIZE_IN_NAME.search(name)
    return float(match.group(1)) * 1e9 if match else None


def gpu_total_gib(index: str | None) -> float | None:
    """Total memory of GPU `index` (as CUDA_VISIBLE_DEVICES names it) from `nvidia-smi`; None if unknown."""
    if shutil.which("nvidia-smi") is None:
        return None
    cmd = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    if index is not None:
        cmd += ["-i", index.split(",")[0]]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout
        return float(out.strip().splitlines()[0]) / 1024  # MiB -> GiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def trainer_resident_gib(params: float) -> float:
    return params * BYTES_PER_PARAM / GIB + TRAINER_OVERHEAD_GIB


def colocated_memory_share(card_gib: float, params: float) -> float:
    """vLLM's `--gpu-memory-utilization` on a card it shares with the trainer (see module doc)."""
    trainer = trainer_resident_gib(params)
    share = (card_gib - trainer - MARGIN_GIB) / card_gib
    # vLLM's own copy of the weights plus room for a useful KV cache must fit in its share too
    serving = params * BYTES_PER_PARAM / GIB + VLLM_MIN_EXTRA_GIB
    if share < MIN_SHARE or share * card_gib < serving:
        raise ConfigError(
            f"a {params / 1e9:g}B model cannot be served and trained on one {card_gib:.0f} GiB GPU: the trainer "
            f"keeps ~{trainer:.1f} GiB resident, leaving vLLM {max(share, 0) * card_gib:.1f} GiB where its weights "
            f"and a KV cache need ~{serving:.1f}. Use "
            "--gpu-mode dedicated (two GPUs), a smaller model, or set the share yourself with "
            "--vllm-arg=--gpu-memory-utilization=S"
        )
    return min(MAX_SHARE, int(share * 100) / 100)


def default_memory_share(base_model: str, gpu_index: str | None) -> float:
    """The share rlproxy passes when the user gives none: sized from the card and the model."""
    card, params = gpu_total_gib(gpu_index), params_from_model(base_model)
    if card is None or params is None:
        log.warning(
            "cannot size vLLM's memory share (%s unknown); using %.2f of the GPU. Set it with "
            "--vllm-arg=--gpu-memory-utilization=S (docs/gpu.md has a table)",
            "the GPU's memory" if card is None else "the model's size",
            FALLBACK_SHARE,
        )
        return FALLBACK_SHARE
    share = colocated_memory_share(card, params)
    log.info(
        "colocated: vLLM gets %.2f of the %.0f GiB GPU; the trainer keeps ~%.1f GiB resident",
        share,
        card,
        trainer_resident_gib(params),
    )
    return share


def memory_table(cards_gib=(24, 40, 48, 80, 141), params_b=(0.5, 1.5, 3, 7, 14)) -> str:
    """docs/gpu.md's table: default share per card and model size (`python -m gateway.engines.vllm.memory`)."""
    rows = ["| model | " + " | ".join(f"{c} GiB" for c in cards_gib) + " |", "|---|" + "---|" * len(cards_gib)]
    for b in params_b:
        cells = []
        for card in cards_gib:
            try:
                cells.append(f"{colocated_memory_share(card, b * 1e9):.2f}")
            except ConfigError:
                cells.append("dedicated")
        rows.append(f"| {b:g}B (bf16 trainer) | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(memory_table())
