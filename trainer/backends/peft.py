"""The `peft` backend: transformers + peft on CPU or one GPU.

float32 on CPU (CPU bf16 matmuls are slow and lossy for tiny LoRA updates); on CUDA the
base weights load in bfloat16 where supported, while peft keeps the LoRA weights in
float32 (`autocast_adapter_dtype`), so the optimizer updates full-precision values.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gateway.errors import ConfigError
from gateway.settings import Settings
from trainer.backends.base import (
    LORA_TARGET_MODULES,
    TrainingBackend,
    load_peft_checkpoint,
    read_full_checkpoint,
    save_peft_checkpoint,
    switch_off_base_dropout,
)
from trainer.packing import PackedRow, token_logprobs

if TYPE_CHECKING:  # peft and transformers are imported when the backend is built
    from peft import PeftModel
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("rlproxy.trainer")


def check_memory(settings: Settings, source: str, device: torch.device) -> None:
    """Refuse at start, with the numbers, a model that cannot train on this GPU (`trainer.distributed.memory`);
    an architecture the estimate does not know trains unchecked."""
    import os

    from transformers import AutoConfig

    from trainer.distributed.memory import ModelShape, check_fits

    if settings.load_in_4bit:
        return  # the estimate counts 16-bit weights
    try:
        shape = ModelShape.from_config(AutoConfig.from_pretrained(source).to_dict())
    except ValueError as exc:
        log.warning("no memory check before loading: %s", exc)
        return
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    total = torch.cuda.get_device_properties(device).total_memory
    check_fits(shape, settings, world, total, checkpointing=settings.gradient_checkpointing)


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: no CUDA GPU is visible to torch here; use --device cpu")
    return device


def model_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def lora_targets(model: torch.nn.Module) -> list[str] | str:
    """`LORA_TARGET_MODULES` the model has; "all-linear" (peft: every linear layer but the
    output head) for architectures that name their projections otherwise.

    Never the output head or the embeddings: vLLM loads LoRAs on the projections alone (it
    answers a 500 to an adapter on `lm_head`), and an adapter must be servable by every
    engine. The built-in models learn without them (see `gateway.models.tiny._INIT_STD`)."""
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    found = [m for m in LORA_TARGET_MODULES if m in present]
    return found or "all-linear"


class PeftBackend(TrainingBackend):
    name = "peft"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # per-load bars would drown the step log

        from gateway.models.registry import resolve_base_model
        from gateway.models.templates import load_tokenizer

        self._device = resolve_device(settings.device)
        source = resolve_base_model(settings.base_model, settings.state_dir)
        if self._device.type == "cuda":
            check_memory(settings, source, self._device)
        try:
            self._tokenizer = load_tokenizer(source, settings.chat_template)  # the template the gateway renders with
            base = AutoModelForCausalLM.from_pretrained(source, dtype=model_dtype(self._device))
        except OSError as exc:
            raise ConfigError(
                f"cannot load base model '{settings.base_model}': {exc}. Give a local path or a "
                "Hugging Face id available offline (--base-model)"
            ) from exc
        base.to(self._device)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) hides the bound self
        base.config.use_cache = False
        if switched := switch_off_base_dropout(base):
            log.info("the base model's dropout is off for training (%d layers): scores are the policy's", switched)
        config = LoraConfig(
            r=settings.lora_rank,
            lora_alpha=settings.lora_alpha,
            lora_dropout=settings.lora_dropout,
            target_modules=lora_targets(base),
            task_type="CAUSAL_LM",
        )
        # The fresh adapter (A random, B zero) is drawn from the trainer seed: step 0 is
        # the same on every machine.
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            # peft calls transformers' deprecated `is_gradient_checkpointing`: not ours to fix.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            torch.manual_seed(settings.seed)
            self.model: PeftModel = get_peft_model(base, config)
        if settings.gradient_checkpointing:
            # Non-reentrant: it works under DDP and FSDP2 and needs no input that requires grad.
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        self.init_optimizer()

    # -- what the model is
    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def device(self) -> torch.device:
        return self._device

    # -- forward passes
    def token_logprobs(self, row: PackedRow) -> torch.Tensor:
        return token_logprobs(self.forward_model, row)

    @torch.no_grad()
    def reference_logprobs(self, row: PackedRow) -> torch.Tensor:
        with self.model.disable_adapter():
            return token_logprobs(self.model, row)

    # -- files
    def save(self, directory: Path | None) -> None:
        """Under a team every rank calls this (gathering is a collective); rank 0 writes `directory`."""
        full = None
        if self.team is not None:
            self.team.announce("save")
            assert self.replication is not None
            full = self.replication.full_state(self._params, self.optimizer)
            if full is None:
                return
        if directory is None:
            raise ValueError("save needs a directory on rank 0")
        # Only the LoRA weights: the base embeddings are never trained (peft would otherwise copy
        # the tiny model's tied embedding matrix into every checkpoint).
        save_peft_checkpoint(
            self.model, self.optimizer, directory, full=full, safe_serialization=True, save_embedding_layers=False
        )

    def load(self, directory: Path) -> None:
        if self.team is None:
            load_peft_checkpoint(self.model, self.optimizer, directory, self._device)
            return
        full = read_full_checkpoint(self.model, self.optimizer, directory)  # rank 0 reads, every rank loads
        if full["optimizer"] is None:
            log.warning("checkpoint %s has no optimizer state: the optimizer restarts from zero", directory)
        self.team.announce("load", full)
        self.load_full(full)
