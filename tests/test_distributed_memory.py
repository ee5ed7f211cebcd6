"""What a training rank needs of a GPU (trainer/distributed/memory.py): the arithmetic by hand, the
parameter counts against transformers and the published ones, the activations against what autograd
really keeps, the refusal's numbers, and deploy/README.md's table against the code that makes it."""

from __future__ import annotations

import functools
import json
import os
import re
import types
from pathlib import Path
from typing import Literal

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from gateway.errors import ConfigError
from gateway.models.tiny import ensure_tiny_model
from gateway.settings import Settings
from trainer.backends.base import LORA_TARGET_MODULES
from trainer.distributed.memory import (
    GIB,
    KNOWN_SIZES,
    ModelShape,
    activation_bytes,
    check_fits,
    footprint,
    memory_table,
)

ROOT = Path(__file__).resolve().parents[1]

# HuggingFaceTB/SmolLM2-135M's config.json on huggingface.co (the built-in smollm2 is its Instruct twin).
SMOLLM2_135M = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
}

# The totals each model's page on huggingface.co gives (its safetensors' parameter count).
PUBLISHED = {
    "Qwen2.5-0.5B": 494_032_768,
    "Qwen2.5-1.5B": 1_543_714_304,
    "Qwen2.5-7B": 7_615_616_512,
    "Llama-3.1-8B": 8_030_261_248,
    "Qwen2.5-14B": 14_770_033_664,
    "Qwen2.5-32B": 32_763_876_352,
    "Llama-3.1-70B": 70_553_706_496,
    "Qwen2.5-72B": 72_706_203_648,
}


@functools.cache
def _tiny_config() -> dict:
    directory = ensure_tiny_model(Path(os.environ["RLPROXY_CACHE_DIR"]))  # the suite's one cache (conftest)
    return json.loads((directory / "config.json").read_text())


def _on_meta(config: dict) -> torch.nn.Module:
    """The model `config` describes, built by transformers without memory for its weights."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied head is one parameter


def test_the_parameter_counts_are_transformers_and_the_published_ones():
    tiny = _tiny_config()
    assert ModelShape.from_config(tiny).params == _count(_on_meta(tiny))
    assert ModelShape.from_config(SMOLLM2_135M).params == _count(_on_meta(SMOLLM2_135M)) == 134_515_008
    assert {name: shape.params for name, shape in KNOWN_SIZES.items()} == PUBLISHED
    with pytest.raises(ValueError, match="gpt2"):
        ModelShape.from_config({"model_type": "gpt2", "n_embd": 768})


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # peft's call, not ours
def test_the_adapter_has_the_parameters_peft_gives_it():
    from peft import LoraConfig, get_peft_model

    tiny = _tiny_config()
    model = get_peft_model(_on_meta(tiny), LoraConfig(r=8, target_modules=list(LORA_TARGET_MODULES)))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert ModelShape.from_config(tiny).lora_params(8) == trainable


def test_the_footprint_of_the_tiny_model_by_hand():
    shape = ModelShape.from_config(_tiny_config())  # 2 layers, hidden 64, MLP 128, 2 heads over 1 KV head of 32
    assert (shape.layers, shape.hidden, shape.intermediate, shape.heads, shape.kv_heads) == (2, 64, 128, 2, 1)
    assert (shape.vocab, shape.tied) == (770, True)
    # parameters: embeddings 770*64 = 49280 (tied head); a layer: q 64*64 + k 64*32 + v 64*32 + o 64*64
    # = 12288, MLP 3*64*128 = 24576, q/k/v biases 64+32+32 = 128, two norms 128: 37120; final norm 64
    params = 49280 + 2 * 37120 + 64
    # LoRA r=8: r*(in+out) summed over q 128, k 96, v 96, o 128, gate 192, up 192, down 192 = 8*1024 a layer
    lora = 2 * 8 * 1024
    # per token per layer: 28*64 + 12*64 + 10*128 + 28*8 + 4*2 + 8 = 4080 bytes; a row of 256 tokens keeps
    # 3 layers' worth (2 + one for backward), the 256x256 bf16 mask and the final norm's float32 input
    activations = 3 * 4080 * 256 + 2 * 256 * 256 + 4 * 64 * 256
    logits = 8 * 770 * 256
    headroom = 2 * 1024**3

    alone = footprint(shape, rank=8, tokens_per_row=256)
    assert (alone.weights, alone.gathered, alone.lora) == (2 * params, 0, 16 * lora)
    assert (alone.activations, alone.logits) == (activations, logits)
    assert alone.total == 2 * params + 16 * lora + activations + logits + headroom

    ddp = footprint(shape, rank=8, tokens_per_row=256, world=2, shard="none")
    assert (ddp.weights, ddp.lora) == (2 * params, (16 + 4) * lora)  # DDP's buckets: a second gradient

    sharded = footprint(shape, rank=8, tokens_per_row=256, world=2, shard="full")
    root = 49280 + 64  # embeddings (the tied head) and the final norm stay gathered at the root
    layer = 2 * 37120 + 4 * (lora // 2)  # one layer gathered: bf16 base, float32 LoRA
    assert (sharded.weights, sharded.lora) == (params, 16 * lora // 2)
    assert sharded.gathered == 2 * root + 2 * layer  # this layer and the prefetched next
    assert sharded.total == params + 16 * lora // 2 + 2 * root + 2 * layer + activations + logits + headroom


def _saved_bytes_per_token(layers: int, model_type: str, tokens: int = 256) -> float:
    """Bytes autograd keeps of one packed row's forward through a bf16 model with a float32 LoRA
    (the peft backend on a GPU), parameters left out, each storage counted once."""
    from peft import LoraConfig, get_peft_model

    from trainer.packing import token_logprobs

    config = AutoConfig.for_model(
        model_type,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=8, target_modules=list(LORA_TARGET_MODULES)))
    half = tokens // 2
    row = types.SimpleNamespace(
        input_ids_T=torch.randint(0, 512, (tokens,)),
        position_ids_T=torch.cat([torch.arange(half), torch.arange(tokens - half)]),
        segment_ids_T=torch.cat([torch.zeros(half, dtype=torch.long), torch.ones(tokens - half, dtype=torch.long)]),
        temperatures_T=torch.ones(tokens),
    )
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        token_logprobs(model, row)
    return sum(kept.values()) / tokens


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_the_activation_estimate_is_what_autograd_keeps(model_type):
    # What one more decoder layer adds: the per-layer figure, free of the row's mask and logits.
    per_layer = _saved_bytes_per_token(3, model_type) - _saved_bytes_per_token(2, model_type)
    estimate = activation_bytes(hidden=128, attention=128, intermediate=352, heads=4, rank=8)
    assert per_layer == pytest.approx(estimate, rel=0.1)


def test_a_model_that_does_not_fit_is_refused_with_the_numbers():
    shape, card = KNOWN_SIZES["Qwen2.5-14B"], int(79.6 * GIB)  # an H100's 80 GB
    settings = Settings(base_model="Qwen/Qwen2.5-14B-Instruct", lora_rank=16, max_tokens_per_row=4096)

    def gib(world: int, shard: Literal["none", "full"], tokens: int = 4096) -> str:
        found = footprint(shape, rank=16, tokens_per_row=tokens, world=world, shard=shard)
        return f"~{found.total / GIB:.1f} GiB"

    with pytest.raises(ConfigError) as refused:
        check_fits(shape, settings, 2, card)
    message = refused.value.message
    assert f"each of 2 training processes needs {gib(2, 'none')} with --shard none" in message
    assert "--base-model Qwen/Qwen2.5-14B-Instruct" in message and "its device has 79.6 GiB" in message
    # the fewest processes --shard full fits on, and the longest row that fits as it is
    assert f"--shard full on 8 processes (--nproc, or torchrun's nodes x GPUs): {gib(8, 'full')} each" in message
    assert footprint(shape, rank=16, tokens_per_row=4096, world=4, shard="full").total > card
    assert f"--max-tokens-per-row 2048: {gib(2, 'none', 2048)}" in message
    numbers = [float(n) for n in re.findall(r"(\d+\.\d) GiB", message)]
    assert numbers[0] > 79.6 and all(n <= 79.6 for n in numbers[2:])

    fits = check_fits(shape, settings.model_copy(update={"shard": "full"}), 8, card)
    assert fits.total <= card


def test_deploy_readme_has_the_table_the_code_makes():
    # The table is for the defaults it names.
    assert (Settings.model_fields["lora_rank"].default, Settings.model_fields["max_tokens_per_row"].default) == (
        16,
        4096,
    )
    readme = (ROOT / "deploy" / "README.md").read_text()
    assert memory_table() in readme
    assert memory_table(checkpointing=True) in readme
