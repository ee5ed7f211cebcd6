"""The `unsloth` backend: Unsloth's FastLanguageModel (LoRA) on one NVIDIA GPU.

What it does, in Unsloth's documented calls:
- base model in 16 bit by default, on the exact id vLLM serves: `from_pretrained(model_name,
  load_in_4bit=False, dtype=bfloat16, use_exact_model_name=True)` - the trainer scores the
  policy vLLM samples from, so the importance ratio measures policy change, not quantisation;
  `--load-in-4bit` (opt-in, `--engine local` only: vLLM 0.28+ has no bitsandbytes) trains QLoRA
  on a bnb-4bit checkpoint, which must then be the `--base-model` itself so the engine serves
  the same weights;
- forward under `torch.autocast("cuda", bfloat16)`, as Unsloth's own trainers run it; the
  output head applied here honours `logit_scale` (Cohere) and `final_logit_softcapping` (Gemma 2)
  and `logits_scaling` (Granite), the transforms Unsloth applies where it returns hidden states;
- the base model's dropout off before LoRA is added (`switch_off_base_dropout`, as the peft
  backend): Unsloth leaves a config's dropout on in train mode, and scores would be noise;
- LoRA: `FastLanguageModel.get_peft_model(model, r, lora_alpha, lora_dropout, target_modules,
  use_gradient_checkpointing="unsloth", random_state)` (Unsloth's offloaded checkpointing);
- packed rows go in as Unsloth's own GRPO sends them: restarting `position_ids` plus
  `packed_seq_lengths` (its variable-length attention keeps samples apart), no 4D mask;
- logprobs in chunks: with `UNSLOTH_RETURN_HIDDEN_STATES=1` the model returns its last hidden
  states instead of logits, and the output head is applied a few hundred positions at a time,
  each chunk recomputed in backward, so the [T, vocab] logits never exist whole (for Qwen2.5,
  152k entries per token: 4096 tokens would be 2.5 GB of float32);
- `model.save_pretrained(dir)`: PEFT's `adapter_config.json` + `adapter_model.safetensors`,
  the format vLLM's `/v1/load_lora_adapter` reads.

Unsloth itself is imported only when the backend is built, after the GPU check: on a
machine without one it fails at import with a message about something else.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gateway.errors import ConfigError
from gateway.settings import Settings
from trainer.backends.base import (
    LORA_TARGET_MODULES,
    TrainingBackend,
    load_peft_checkpoint,
    save_peft_checkpoint,
    switch_off_base_dropout,
)
from trainer.packing import PackedRow

if TYPE_CHECKING:
    from transformers import PretrainedConfig

log = logging.getLogger("rlproxy.trainer")

LOGIT_CHUNK_BYTES = 256 * 1024 * 1024
"""Float32 logits materialised at once (per chunk of positions)."""


def require_gpu(device: str) -> int:
    """The CUDA device index to train on, or a ConfigError that says what to change."""
    if not torch.cuda.is_available():
        raise ConfigError(
            "the unsloth backend trains on an NVIDIA GPU and torch sees none here; "
            "use --backend peft (CPU or GPU), or run on a machine with CUDA"
        )
    if not device.startswith("cuda"):
        raise ConfigError(f"the unsloth backend trains on a GPU: pass --device cuda (or cuda:N), not --device {device}")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(f"--device {device}: only {torch.cuda.device_count()} GPU(s) are visible")
    return index


def segment_lengths(segment_ids_T: torch.Tensor) -> torch.Tensor:
    """Lengths of the runs of equal segment ids (the packed samples), int32: `packed_seq_lengths`."""
    return torch.unique_consecutive(segment_ids_T, return_counts=True)[1].to(torch.int32)


def logit_chunk_size(vocab_size: int) -> int:
    return max(1, LOGIT_CHUNK_BYTES // (4 * vocab_size))


# Config fields that transform the logits after the output head, and what they do. The same
# table Unsloth's loss reads (unsloth/models/llama.py, `resolve_logit_transforms`, 2026.10.9).
_SOFTCAP_FIELDS = ("final_logit_softcapping", "logits_soft_cap", "output_logit_soft_cap")
_MULTIPLY_FIELDS = ("logit_scale", "lm_head_multiplier", "output_multiplier")
_DIVIDE_FIELDS = ("logits_scaling",)
# `logits_scaling` multiplies in HyperCLOVA X and scales hidden states (not logits) in MiniCPM3.
_DIVIDE_OVERRIDES = {"hyperclovax": "multiply", "minicpm3": None}


def head_transform(config: PretrainedConfig | dict[str, Any]) -> tuple[float, float | None]:
    """(multiplier, softcap) the architecture applies to its logits after the output head:
    logits * multiplier, then cap * tanh(logits / cap) (Gemma 2's final-logit softcapping)."""
    get: Callable[[str], Any] = (
        (lambda name: getattr(config, name, None)) if not isinstance(config, dict) else config.get
    )
    first = lambda names: next((float(get(n)) for n in names if get(n)), None)  # noqa: E731
    scale = first(_MULTIPLY_FIELDS) or 1.0
    divide = first(_DIVIDE_FIELDS)
    if divide:
        kind = _DIVIDE_OVERRIDES.get(get("model_type") or "", "divide")
        if kind == "divide":
            scale /= divide
        elif kind == "multiply":
            scale *= divide
    return scale, first(_SOFTCAP_FIELDS)


def _chunk_logprobs(
    hidden_CH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_C: torch.Tensor,
    scale: float = 1.0,
    softcap: float | None = None,
    temperatures_C: torch.Tensor | None = None,
) -> torch.Tensor:
    logits_CV = (hidden_CH @ weight_VH.T).float()  # matmul in the model's dtype, softmax in float32
    if scale != 1.0:
        logits_CV = logits_CV * scale
    if softcap:
        logits_CV = softcap * torch.tanh(logits_CV / softcap)
    if temperatures_C is not None:  # the model's final logits, then the sampler's temperature (vLLM's order)
        logits_CV = logits_CV / temperatures_C[:, None]
    return logits_CV.gather(-1, targets_C[:, None]).squeeze(-1) - torch.logsumexp(logits_CV, dim=-1)


def chunked_token_logprobs(
    hidden_TH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_T: torch.Tensor,
    chunk: int | None = None,
    scale: float = 1.0,
    softcap: float | None = None,
    temperatures_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """log softmax(hidden @ weight.T / T_t)[t, targets[t]] for every t, `chunk` positions at a time.

    `temperatures_T` is the temperature each target was sampled at (None: 1), so the trainer
    scores the distribution the engine sampled from.

    With gradients on, each chunk runs under activation checkpointing: backward recomputes
    its logits instead of keeping them, so peak memory is one chunk's [chunk, V] logits.
    """
    chunk = chunk or logit_chunk_size(weight_VH.shape[0])
    grad = torch.is_grad_enabled() and (hidden_TH.requires_grad or weight_VH.requires_grad)
    out = []
    for start in range(0, hidden_TH.shape[0], chunk):
        h_CH, t_C = hidden_TH[start : start + chunk], targets_T[start : start + chunk]
        temp_C = temperatures_T[start : start + chunk] if temperatures_T is not None else None
        if grad:
            out.append(
                torch.utils.checkpoint.checkpoint(
                    _chunk_logprobs, h_CH, weight_VH, t_C, scale, softcap, temp_C, use_reentrant=False
                )
            )
        else:
            out.append(_chunk_logprobs(h_CH, weight_VH, t_C, scale, softcap, temp_C))
    return torch.cat(out) if out else hidden_TH.new_zeros(0, dtype=torch.float32)


class UnslothBackend(TrainingBackend):
    name = "unsloth"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        index = require_gpu(settings.device)
        # Unsloth reads this at every forward: return hidden states, we apply the head in chunks.
        os.environ["UNSLOTH_RETURN_HIDDEN_STATES"] = "1"
        try:
            from unsloth import FastLanguageModel  # patches transformers/peft: import it first
        except ImportError as exc:
            raise ConfigError(f"the unsloth backend needs Unsloth: pip install 'rlproxy[gpu]' ({exc})") from exc
        self._fast = FastLanguageModel
        four_bit = settings.load_in_4bit
        if four_bit and "bnb-4bit" not in settings.base_model and "bnb_4bit" not in settings.base_model:
            raise ConfigError(
                f"--load-in-4bit trains on a bnb-4bit checkpoint, and the engine must serve that same checkpoint: pass "
                f"one as --base-model (e.g. unsloth/...-bnb-4bit), not '{settings.base_model}', or drop "
                "--load-in-4bit to train 16-bit LoRA on the model vLLM serves"
            )
        from gateway.models.registry import resolve_base_model

        source = resolve_base_model(settings.base_model, settings.state_dir)  # a built-in: its directory
        try:
            model, self._tokenizer = FastLanguageModel.from_pretrained(
                model_name=source,
                max_seq_length=settings.max_tokens_per_row,
                load_in_4bit=four_bit,
                load_in_16bit=not four_bit,  # 16-bit LoRA: the weights vLLM serves
                dtype=torch.bfloat16,
                use_exact_model_name=True,  # never swap to Unsloth's bnb-4bit copy of the model
                device_map={"": index},
            )
        except OSError as exc:
            raise ConfigError(f"cannot load base model '{settings.base_model}' with Unsloth: {exc}") from exc
        from gateway.models.templates import use_template

        use_template(self._tokenizer, settings.chat_template, source)  # what vLLM renders with
        # Unsloth trains in train mode and leaves the config's dropout on (its Granite attention and
        # the transformers layers of the models it does not rewrite drop out): off, before LoRA's own.
        if switched := switch_off_base_dropout(model):
            log.info("the base model's dropout is off for training (%d layers): scores are the policy's", switched)
        # Same seed, same fresh adapter on every machine (A random, B zero).
        self.model: Any = FastLanguageModel.get_peft_model(  # Unsloth's patched PeftModel (untyped)
            model,
            r=settings.lora_rank,
            lora_alpha=settings.lora_alpha,
            lora_dropout=settings.lora_dropout,
            target_modules=list(LORA_TARGET_MODULES),
            use_gradient_checkpointing="unsloth",
            random_state=settings.seed,
        )
        FastLanguageModel.for_training(self.model)
        self._scale, self._softcap = head_transform(getattr(self.model, "config", {}) or {})
        self.init_optimizer()

    # -- what the model is
    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- forward passes
    def token_logprobs(self, row: PackedRow) -> torch.Tensor:
        device = self.device
        ids_T = row.input_ids_T.to(device)
        positions_T = row.position_ids_T.to(device)
        next_temps_T = row.temperatures_T[1:].to(device)  # the temperature token t was sampled at
        # Unsloth trains on CUDA only; the CPU stand-in in the tests runs in float32.
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out_TH = self.model(
                input_ids=ids_T[None],
                position_ids=positions_T[None],
                packed_seq_lengths=segment_lengths(row.segment_ids_T).to(device),
                use_cache=False,
            ).logits[0]
            head_VH = self.model.get_output_embeddings().weight
            if out_TH.shape[-1] == head_VH.shape[1]:
                # hidden states at t-1 predict token t; the head's scale / softcap applied here
                next_T = chunked_token_logprobs(
                    out_TH[:-1],
                    head_VH,
                    ids_T[1:],
                    scale=self._scale,
                    softcap=self._softcap,
                    temperatures_T=next_temps_T,
                )
            else:  # an Unsloth that ignored UNSLOTH_RETURN_HIDDEN_STATES: its logits are final
                logits_TV = out_TH[:-1].float() / next_temps_T[:, None]
                next_T = torch.log_softmax(logits_TV, dim=-1).gather(-1, ids_T[1:, None]).squeeze(-1)
        logprobs_T = torch.cat([next_T.new_zeros(1), next_T])
        # A sample's first token has no context in its own sample.
        return logprobs_T.masked_fill(positions_T == 0, 0.0)

    @torch.no_grad()
    def reference_logprobs(self, row: PackedRow) -> torch.Tensor:
        with self.model.disable_adapter():
            return self.token_logprobs(row)

    # -- files
    def save(self, directory: Path | None) -> None:
        if directory is None:  # only the ranks of a team save without a directory; Unsloth trains alone
            raise ValueError("the unsloth backend saves into a directory")
        # PEFT format, what vLLM loads; without the embedding layers (Unsloth would otherwise add the
        # full embed/head matrices when it resized or touched them: GBs that vLLM's LoRA loader rejects)
        save_peft_checkpoint(self.model, self.optimizer, directory, save_embedding_layers=False)

    def load(self, directory: Path) -> None:
        load_peft_checkpoint(self.model, self.optimizer, directory, self.device)
