"""What one training rank needs of a GPU, checked at start (`check_fits`) and tabled in deploy/README.md
(`python -m trainer.distributed.memory` prints that table).

The estimate is for the `peft` backend in 16 bit: the base in bfloat16, the LoRA in float32 (peft's
`autocast_adapter_dtype`), SDPA attention with rlproxy's 4-D packed-row mask, one packed row of
`--max-tokens-per-row` tokens at a time (`trainer.step` runs backward per row), no gradient
checkpointing unless asked. Per rank:

    weights      base parameters x 2 bytes; / world under --shard full
    gathered     --shard full only: FSDP2 keeps the root unit (embeddings, final norm, head) unsharded
                 from forward to backward (`fully_shard`'s default for the root), and holds one decoder
                 layer gathered plus the next one prefetched
    lora         adapter parameters x 16 bytes (float32 weight 4, gradient 4, AdamW's two moments 8),
                 + 4 for DDP's gradient buckets (a second copy of the gradients); / world under full
    activations  what autograd keeps of one row's forward for its backward (ACTIVATION_BYTES), layer
                 by layer, plus one layer's worth of backward temporaries and the T x T mask
    logits       LOGITS_BYTES x row x vocab (the chunked float32 log-softmax and its gradient)
    reference    the no-grad forwards (the reference model, pi_old): their peak, never beside the
                 trained forward's (they run before it), so the total takes the larger of the two
    overhead     OVERHEAD_BYTES: CUDA context, NCCL, the caching allocator's slack

Torch-free: the gateway's commands and the docs table import it without a GPU stack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from gateway.errors import ConfigError
from trainer.backends.base import LORA_TARGET_MODULES

if TYPE_CHECKING:
    from gateway.settings import Settings

GIB = 1024**3
BASE_BYTES = 2
"""bfloat16: the base weights in 16 bit (the peft backend's dtype on a GPU)."""
LORA_BYTES = 16
"""float32 weight (4), its gradient (4), AdamW's exp_avg and exp_avg_sq (4 + 4)."""
DDP_BUCKET_BYTES = 4
"""DDP copies the gradients into its all-reduce buckets (`gradient_as_bucket_view=False`, the default)."""
LOGITS_BYTES = 8
"""Per token and vocabulary entry: `selective_log_softmax` keeps each 1024-row chunk's float32 logits
for backward (4), and backward builds a whole-row bfloat16 gradient per chunk, added into another (2 + 2).
The bfloat16 logits themselves (2) are freed when the forward returns."""
OVERHEAD_BYTES = 2 * GIB
"""Fixed headroom: the CUDA context (~0.5 GiB on an H100 with lazy module loading, outside torch's
allocator), NCCL's communicator buffers (~0.5 GiB), the caching allocator's fragmentation (~1 GiB)."""
LOG_SOFTMAX_CHUNK = 1024
"""`trainer.packing.selective_log_softmax`'s rows per float32 chunk."""
_SUPPORTED = ("llama", "mistral", "qwen2")


def activation_bytes(hidden: int, attention: int, intermediate: int, heads: int, rank: int) -> int:
    """Bytes autograd saves per token per decoder layer (gradient checkpointing off).

    Read off `torch.autograd.graph.saved_tensors_hooks` around the peft backend's forward
    (transformers 5, peft 0.21, SDPA; tests/test_distributed_memory.py measures it again). The base
    weights are frozen, so a base projection saves no input; what stays:
      28 h   the two RMSNorms' float32 inputs (4 h each), and peft's float32 copy of the input for each
             LoRA (`_cast_input_dtype`): q, k, v (4 h each), gate, up (4 h each)
      12 a   q, and k, v repeated to every head (transformers' `repeat_kv`: SDPA's GQA path is off
             with a mask), 2 a each; attention's output (2 a); o's float32 LoRA input (4 a)
      10 i   gate's output (SiLU's input), SiLU's and up's outputs (their product), 2 i each, and
             down's float32 LoRA input (4 i)
      28 r   the seven LoRA A outputs in float32
      4 heads + 8   attention's logsumexp, the norms' reciprocal RMS
    with h the hidden size, a heads x head_dim, i the MLP's intermediate size, r the LoRA rank.
    For a Llama-style layer with i = 3.5 h that is about 75 h, twice Korthikanti et al. (2022)'s 34 h
    for a GPT layer: the float32 LoRA inputs and the wider SwiGLU MLP.
    """
    return 28 * hidden + 12 * attention + 10 * intermediate + 28 * rank + 4 * heads + 8


@dataclass(frozen=True)
class ModelShape:
    """A Llama/Qwen2/Mistral-style causal LM's dimensions, as its config.json gives them."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    """tie_word_embeddings: the output head is the embedding matrix."""
    head_dim: int = 0
    """0: hidden / heads."""
    bias_per_layer: int = 0
    """Bias parameters in one decoder layer (Qwen2's q, k, v biases)."""

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        """From a Hugging Face config.json (`AutoConfig.to_dict()` gives the same keys). ValueError for
        an architecture the estimate does not know."""
        kind = config.get("model_type")
        if kind not in _SUPPORTED:
            raise ValueError(f"model_type {kind!r}: the memory estimate knows {', '.join(_SUPPORTED)} layouts")
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        kv_heads = int(config.get("num_key_value_heads") or heads)
        intermediate = int(config["intermediate_size"])
        q, kv = heads * head_dim, kv_heads * head_dim
        bias = q + 2 * kv if kind == "qwen2" else 0
        if config.get("attention_bias"):  # Llama's flag: q, k, v and o
            bias = q + 2 * kv + hidden
        if config.get("mlp_bias"):
            bias += 2 * intermediate + hidden
        return cls(
            layers=int(config["num_hidden_layers"]),
            hidden=hidden,
            intermediate=intermediate,
            heads=heads,
            kv_heads=kv_heads,
            vocab=int(config["vocab_size"]),
            tied=bool(config.get("tie_word_embeddings", False)),  # False: Llama's, Qwen2's and Mistral's default
            head_dim=head_dim,
            bias_per_layer=bias,
        )

    @property
    def attention(self) -> int:
        """Width of q and of attention's output: heads x head_dim."""
        return self.heads * (self.head_dim or self.hidden // self.heads)

    @property
    def kv(self) -> int:
        return self.kv_heads * (self.head_dim or self.hidden // self.heads)

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each LoRA target projection of one decoder layer."""
        h, a, kv, i = self.hidden, self.attention, self.kv, self.intermediate
        return {
            "q_proj": (h, a),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (a, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def layer_params(self) -> int:
        """One decoder layer: its projections, biases and two RMSNorm weights."""
        return sum(n_in * n_out for n_in, n_out in self.projections().values()) + self.bias_per_layer + 2 * self.hidden

    @property
    def root_params(self) -> int:
        """What is not in a decoder layer: embeddings, the final norm, an untied head."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    def lora_params(self, rank: int) -> int:
        """A (rank x in) and B (out x rank) on each of `LORA_TARGET_MODULES`, in every layer."""
        dims = self.projections()
        return self.layers * sum(rank * sum(dims[name]) for name in LORA_TARGET_MODULES)


def _shape(
    kind: str, layers: int, hidden: int, intermediate: int, heads: int, kv: int, vocab: int, tied: bool
) -> ModelShape:
    return ModelShape.from_config(
        {
            "model_type": kind,
            "num_hidden_layers": layers,
            "hidden_size": hidden,
            "intermediate_size": intermediate,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "vocab_size": vocab,
            "tie_word_embeddings": tied,
        }
    )


# config.json of each model on huggingface.co (Qwen/Qwen2.5-*-Instruct, meta-llama/Llama-3.1-*-Instruct);
# the parameter counts these give are checked against the published ones in tests/test_distributed_memory.py.
KNOWN_SIZES: dict[str, ModelShape] = {
    "Qwen2.5-0.5B": _shape("qwen2", 24, 896, 4864, 14, 2, 151936, True),
    "Qwen2.5-1.5B": _shape("qwen2", 28, 1536, 8960, 12, 2, 151936, True),
    "Qwen2.5-7B": _shape("qwen2", 28, 3584, 18944, 28, 4, 152064, False),
    "Llama-3.1-8B": _shape("llama", 32, 4096, 14336, 32, 8, 128256, False),
    "Qwen2.5-14B": _shape("qwen2", 48, 5120, 13824, 40, 8, 152064, False),
    "Qwen2.5-32B": _shape("qwen2", 64, 5120, 27648, 40, 8, 152064, False),
    "Llama-3.1-70B": _shape("llama", 80, 8192, 28672, 64, 8, 128256, False),
    "Qwen2.5-72B": _shape("qwen2", 80, 8192, 29568, 64, 8, 152064, False),
}


@dataclass(frozen=True)
class Footprint:
    """Bytes one rank needs, by part (see the module doc)."""

    weights: int
    gathered: int
    lora: int
    activations: int
    logits: int
    reference: int
    overhead: int

    @property
    def training(self) -> int:
        """The trained forward and backward of one row."""
        return self.activations + self.logits

    @property
    def total(self) -> int:
        return self.weights + self.gathered + self.lora + max(self.training, self.reference) + self.overhead

    def describe(self) -> str:
        parts = [("base weights", self.weights), ("FSDP2's gathered layers", self.gathered)]
        parts += [("adapter, gradients and AdamW", self.lora), ("activations", self.activations)]
        parts += [("logits", self.logits), ("CUDA and NCCL headroom", self.overhead)]
        return ", ".join(f"{name} {size / GIB:.1f}" for name, size in parts if size)


def footprint(
    shape: ModelShape,
    *,
    rank: int,
    tokens_per_row: int,
    world: int = 1,
    shard: Literal["none", "full"] = "none",
    checkpointing: bool = False,
) -> Footprint:
    """What one of `world` ranks needs to train a LoRA of `rank` on `shape`, a row of `tokens_per_row`
    tokens at a time. One rank shards nothing: `shard` counts from two on. `checkpointing`: each layer
    keeps only its bfloat16 input and recomputes the rest in backward (one layer's worth at a time)."""
    T, sharded = tokens_per_row, shard == "full" and world > 1
    parts = world if sharded else 1
    weights = math.ceil(shape.params / parts) * BASE_BYTES
    lora_params = shape.lora_params(rank)
    per_param = LORA_BYTES + (DDP_BUCKET_BYTES if world > 1 and not sharded else 0)
    lora = math.ceil(lora_params / parts) * per_param
    gathered = 0
    if sharded:
        layer = shape.layer_params * BASE_BYTES + lora_params // shape.layers * 4  # the LoRA gathers in float32
        gathered = shape.root_params * BASE_BYTES + 2 * layer  # the root, this layer and the prefetched next
    layer_T = activation_bytes(shape.hidden, shape.attention, shape.intermediate, shape.heads, rank) * T
    if checkpointing:  # each layer's bfloat16 input, and one layer recomputed with its backward's temporaries
        saved = shape.layers * 2 * shape.hidden * T + 2 * layer_T
    else:  # every layer's saved tensors, and one layer's worth of backward temporaries
        saved = (shape.layers + 1) * layer_T
    mask = 2 * T * T  # the bfloat16 additive T x T mask, one per row, shared by the layers
    activations = saved + mask + 4 * shape.hidden * T  # and the final norm's float32 input
    logits = LOGITS_BYTES * shape.vocab * T
    # No grad: one layer's tensors at a time, the bfloat16 logits, two float32 chunks of them.
    reference = layer_T + mask + 2 * shape.vocab * T + 2 * 4 * shape.vocab * min(T, LOG_SOFTMAX_CHUNK)
    return Footprint(weights, gathered, lora, activations, logits, reference, OVERHEAD_BYTES)


_NPROC_TRIED = (2, 4, 8, 16, 32, 64)
_SHORTEST_ROW = 256


def check_fits(
    shape: ModelShape, settings: Settings, world: int, device_bytes: int, *, checkpointing: bool = False
) -> Footprint:
    """The footprint of one of `world` ranks training `settings` on `shape`, or a ConfigError with the
    numbers and what would fit (gradient checkpointing, --shard full, more processes, shorter rows) when over
    `device_bytes`."""
    rank, T, shard = settings.lora_rank, settings.max_tokens_per_row, settings.shard

    def need(n: int = world, s: Literal["none", "full"] = shard, t: int = T, c: bool = checkpointing) -> int:
        return footprint(shape, rank=rank, tokens_per_row=t, world=n, shard=s, checkpointing=c).total

    found = footprint(shape, rank=rank, tokens_per_row=T, world=world, shard=shard, checkpointing=checkpointing)
    if found.total <= device_bytes:
        return found
    nprocs = [n for n in (world, *_NPROC_TRIED) if n > 1 and (n > world or shard == "none")]
    lengths = [t for t in (T >> k for k in range(1, 12)) if t >= _SHORTEST_ROW]
    fixes = []
    if not checkpointing and need(c=True) <= device_bytes:
        fixes.append(f"--gradient-checkpointing: ~{need(c=True) / GIB:.1f} GiB")
    sharded = [n for n in nprocs if need(n, "full") <= device_bytes]
    if sharded:
        n = sharded[0]
        where = "on these processes" if n == world else f"on {n} processes (--nproc, or torchrun's nodes x GPUs)"
        fixes.append(f"--shard full {where}: ~{need(n, 'full') / GIB:.1f} GiB each")
    shorter = [t for t in lengths if need(t=t) <= device_bytes]
    if shorter:
        fixes.append(f"--max-tokens-per-row {shorter[0]}: ~{need(t=shorter[0]) / GIB:.1f} GiB")
    if not fixes:  # neither alone: both together
        both = [(t, n) for t in lengths for n in nprocs if need(n, "full", t) <= device_bytes]
        if both:
            t, n = both[0]
            fixes.append(
                f"--shard full on {n} processes with --max-tokens-per-row {t}: ~{need(n, 'full', t) / GIB:.1f} GiB"
            )
    advice = "Use " + "; or ".join(fixes) if fixes else "Nothing here fits it: a smaller model or larger devices"
    if any("--max-tokens-per-row" in fix for fix in fixes):
        advice += " (a row must still hold the longest sample)"
    processes = "one training process" if world == 1 else f"each of {world} training processes"
    raise ConfigError(
        f"--base-model {settings.base_model} does not fit: {processes} needs ~{found.total / GIB:.1f} GiB with "
        f"--shard {shard}, --lora-rank {rank} and --max-tokens-per-row {T} ({found.describe()}), and its device "
        f"has {device_bytes / GIB:.1f} GiB. {advice}."
    )


CARDS: tuple[tuple[int, str, float], ...] = (
    (1, "24 GB", 22.5),
    (1, "80 GB", 79.6),
    (2, "80 GB", 79.6),
    (4, "80 GB", 79.6),
    (8, "80 GB", 79.6),
    (8, "141 GB", 140.4),
)
"""(GPUs, card, GiB the card reports): 22.5 for an L4 or A10G, 79.6 for an H100, 140.4 for an H200."""


def memory_table(rank: int = 16, tokens_per_row: int = 4096, checkpointing: bool = False) -> str:
    """deploy/README.md's table: GiB each GPU needs, KNOWN_SIZES x CARDS, DDP and --shard full."""
    lines = [
        f"GiB each GPU needs for a LoRA of rank {rank} on rows of {tokens_per_row} tokens (`--lora-rank`, "
        f"`--max-tokens-per-row`: the defaults), `--backend peft` in bfloat16 {'with' if checkpointing else 'without'} "
        "gradient checkpointing; ✓: it fits a card of 22.5 GiB "
        "(24 GB: what an L4 or A10G reports), 79.6 (80 GB: an H100) or 140.4 (141 GB: an H200).",
        "",
        "| model | parameters | `--shard` | " + " | ".join(f"{n}×{card}" for n, card, _ in CARDS) + " |",
        "|---|---|---|" + "---|" * len(CARDS),
    ]
    for name, shape in KNOWN_SIZES.items():
        for shard in ("none", "full"):
            cells = []
            for n, _, card_gib in CARDS:
                if shard == "full" and n == 1:
                    cells.append("—")  # one process shards nothing
                    continue
                found = footprint(
                    shape, rank=rank, tokens_per_row=tokens_per_row, world=n, shard=shard, checkpointing=checkpointing
                )
                gib = found.total / GIB
                cells.append(f"{gib:.1f} {'✓' if gib <= card_gib else '✗'}")
            label = f"| {name} | {shape.params / 1e9:.2f}B |" if shard == "none" else "| | |"
            lines.append(f"{label} {shard} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(memory_table())
    print()
    print(memory_table(checkpointing=True))
