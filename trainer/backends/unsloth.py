"""The `unsloth` backend: Unsloth's FastLanguageModel (QLoRA) on one NVIDIA GPU.

What it does, in Unsloth's documented calls:
- base model in 4 bit: `FastLanguageModel.from_pretrained(model_name, max_seq_length,
  load_in_4bit=True, dtype=None)` (dtype None: bfloat16 where the GPU has it, else float16);
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
from pathlib import Path

import torch

from gateway.errors import ConfigError
from gateway.settings import Settings
from trainer.backends.base import (
    LORA_TARGET_MODULES,
    TrainingBackend,
    load_peft_checkpoint,
    save_peft_checkpoint,
)
from trainer.packing import PackedRow

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


def _chunk_logprobs(hidden_CH: torch.Tensor, weight_VH: torch.Tensor, targets_C: torch.Tensor) -> torch.Tensor:
    logits_CV = (hidden_CH @ weight_VH.T).float()  # matmul in the model's dtype, softmax in float32
    return logits_CV.gather(-1, targets_C[:, None]).squeeze(-1) - torch.logsumexp(logits_CV, dim=-1)


def chunked_token_logprobs(hidden_TH: torch.Tensor, weight_VH: torch.Tensor, targets_T: torch.Tensor,
                           chunk: int | None = None) -> torch.Tensor:
    """log softmax(hidden @ weight.T)[t, targets[t]] for every t, `chunk` positions at a time.

    With gradients on, each chunk runs under activation checkpointing: backward recomputes
    its logits instead of keeping them, so peak memory is one chunk's [chunk, V] logits.
    """
    chunk = chunk or logit_chunk_size(weight_VH.shape[0])
    grad = torch.is_grad_enabled() and (hidden_TH.requires_grad or weight_VH.requires_grad)
    out = []
    for start in range(0, hidden_TH.shape[0], chunk):
        h_CH, t_C = hidden_TH[start : start + chunk], targets_T[start : start + chunk]
        if grad:
            out.append(torch.utils.checkpoint.checkpoint(_chunk_logprobs, h_CH, weight_VH, t_C, use_reentrant=False))
        else:
            out.append(_chunk_logprobs(h_CH, weight_VH, t_C))
    return torch.cat(out) if out else hidden_TH.new_zeros(0, dtype=torch.float32)


class UnslothBackend(TrainingBackend):
    name = "unsloth"

    def __init__(self, settings: Settings):
        super().__init__(settings)
        index = require_gpu(settings.device)
        # Unsloth reads this at every forward: return hidden states, we apply the head in chunks.
        os.environ["UNSLOTH_RETURN_HIDDEN_STATES"] = "1"
        try:
            from unsloth import FastLanguageModel  # patches transformers/peft: import it first
        except ImportError as exc:
            raise ConfigError(f"the unsloth backend needs Unsloth: pip install 'rlproxy[gpu]' ({exc})") from exc
        self._fast = FastLanguageModel
        try:
            model, self._tokenizer = FastLanguageModel.from_pretrained(
                model_name=settings.base_model,
                max_seq_length=settings.max_tokens_per_row,
                load_in_4bit=True,
                dtype=None,
                device_map={"": index},
            )
        except OSError as exc:
            raise ConfigError(f"cannot load base model '{settings.base_model}' with Unsloth: {exc}") from exc
        # Same seed, same fresh adapter on every machine (A random, B zero).
        self.model = FastLanguageModel.get_peft_model(
            model,
            r=settings.lora_rank,
            lora_alpha=settings.lora_alpha,
            lora_dropout=settings.lora_dropout,
            target_modules=list(LORA_TARGET_MODULES),
            use_gradient_checkpointing="unsloth",
            random_state=settings.seed,
        )
        FastLanguageModel.for_training(self.model)
        self.init_optimizer()

    # -- what the model is
    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- forward passes
    def token_logprobs(self, row: PackedRow) -> torch.Tensor:
        device = self.device
        ids_T = row.input_ids_T.to(device)
        positions_T = row.position_ids_T.to(device)
        out_TH = self.model(
            input_ids=ids_T[None],
            position_ids=positions_T[None],
            packed_seq_lengths=segment_lengths(row.segment_ids_T).to(device),
            use_cache=False,
        ).logits[0]
        head_VH = self.model.get_output_embeddings().weight
        if out_TH.shape[-1] == head_VH.shape[1]:
            # hidden states at t-1 predict token t
            next_T = chunked_token_logprobs(out_TH[:-1], head_VH, ids_T[1:])
        else:  # an Unsloth that ignored UNSLOTH_RETURN_HIDDEN_STATES and gave logits
            next_T = torch.log_softmax(out_TH[:-1].float(), dim=-1).gather(-1, ids_T[1:, None]).squeeze(-1)
        logprobs_T = torch.cat([next_T.new_zeros(1), next_T])
        # A sample's first token has no context in its own sample.
        return logprobs_T.masked_fill(positions_T == 0, 0.0)

    @torch.no_grad()
    def reference_logprobs(self, row: PackedRow) -> torch.Tensor:
        with self.model.disable_adapter():
            return self.token_logprobs(row)

    # -- files
    def save(self, directory: Path) -> None:
        save_peft_checkpoint(self.model, self.optimizer, directory)  # PEFT format: what vLLM loads

    def load(self, directory: Path) -> None:
        load_peft_checkpoint(self.model, self.optimizer, directory, self.device)
