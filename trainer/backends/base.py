"""The interface a training backend implements (`peft` here; `unsloth` beside it).

A backend owns the model, its LoRA adapter, the tokenizer and the optimizer. It knows
nothing of the store, the loss or the checkpoint layout: `trainer.step` drives it with
packed rows, `trainer.checkpoints` asks it to write and read its files. So a new backend
is one class with the methods below, and `get_backend(name)` (in `trainer/backends/`)
imports it only when chosen.

Life of a backend in the worker:

    backend = get_backend(settings.backend)(settings)   # load base model + tokenizer, wrap with LoRA
    backend.load(checkpoint_dir)                         # resume: adapter weights + optimizer state
    for each step:
        backend.zero_grad()
        for row in rows:
            ref_T = backend.reference_logprobs(row)      # adapter disabled, no grad: the KL to the base
            logprobs_T = backend.token_logprobs(row)     # adapter on, with grad
            loss(logprobs_T, ...).backward()
        backend.optimizer_step()                         # clip to max_grad_norm, AdamW step
        backend.save(tmp_dir)                            # PEFT files + optimizer.pt
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch stays out of import time for code that only needs the interface
    import torch
    from peft import PeftModel

    from gateway.settings import Settings
    from trainer.distributed.team import Team
    from trainer.distributed.wrap import Replication
    from trainer.packing import PackedRow

LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Attention and MLP projections of Llama/Qwen/Mistral-style models: LoRA on all of them
trains better than attention alone (QLoRA, Dettmers et al. 2023) at a small cost."""

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
"""What PEFT's `save_pretrained` writes and `PeftModel.from_pretrained` (and vLLM's
`load_lora_adapter`) reads."""

OPTIMIZER_FILE = "optimizer.pt"
"""The optimizer's `state_dict()`, saved beside the adapter so a resumed run continues
with the same AdamW moments instead of restarting them at zero."""


_RUN_SETTINGS = ("lr", "weight_decay")
"""Optimizer param-group entries taken from the run's settings, never from a checkpoint."""


def switch_off_base_dropout(model: torch.nn.Module) -> int:
    """The base model's dropout set to 0 (its `nn.Dropout`s, the `attention_dropout` rate
    attention layers pass to SDPA, and the config's, which Unsloth's Granite attention reads
    in training), as TRL's GRPO does by default (`disable_dropout`): the trainer runs in train
    mode, and a model whose config drops out (GPT-2's 10 %) would score every token under a
    random mask, so pi_old and the ratios would be noise, not the policy the sampler ran.
    Modern instruct configs have 0 already; neither peft nor Unsloth switches it off. Returns
    how many were switched off; LoRA's own dropout (`--lora-dropout`) is added after this
    (`get_peft_model`) and stays as asked."""
    import torch

    switched = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            module.p = 0.0
            switched += 1
        for holder in (module, getattr(module, "config", None)):
            rate = getattr(holder, "attention_dropout", None)
            if isinstance(rate, float) and rate > 0:
                holder.attention_dropout = 0.0  # type: ignore[union-attr]  # a float attribute, not a submodule
                switched += 1
    return switched


def save_peft_checkpoint(
    model: PeftModel,
    optimizer: torch.optim.Optimizer,
    directory: Path,
    *,
    full: dict | None = None,
    **save_options: Any,
) -> None:
    """The adapter in PEFT format plus the optimizer state, checked: a library version
    that names its files otherwise must not pass silently. `full`: the state several ranks
    gathered (`trainer.distributed.wrap.Replication.full_state`), written as one process writes its own."""
    import torch

    directory = Path(directory)
    optimizer_state = optimizer.state_dict()
    if full is not None:
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        save_options["state_dict"] = dict(zip(names, full["params"], strict=True))
        optimizer_state = full["optimizer"]
    model.save_pretrained(str(directory), **save_options)
    missing = [name for name in ADAPTER_FILES if not (directory / name).is_file()]
    if missing:
        raise RuntimeError(f"save_pretrained did not write {', '.join(missing)} in {directory}")
    torch.save(optimizer_state, directory / OPTIMIZER_FILE)


def read_full_checkpoint(model: PeftModel, optimizer: torch.optim.Optimizer, directory: Path) -> dict:
    """A `save_peft_checkpoint` directory as the whole state `Replication.set_full_state` puts back
    on every rank: the trained parameters in `model.parameters()` order, the optimizer state with
    this run's learning rate and weight decay. Read by rank 0 alone."""
    import torch
    from safetensors.torch import load_file

    from gateway.errors import ConfigError

    directory = Path(directory)
    weights = load_file(directory / ADAPTER_FILES[1], device="cpu")
    adapter = getattr(model, "active_adapter", "default")
    params = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        key = name.replace(f".{adapter}.", ".")  # peft's file names leave the adapter's name out
        if key not in weights:
            raise ConfigError(
                f"checkpoint {directory} does not fit this adapter (no weights for {key}); it was trained "
                "with other LoRA settings or another base model"
            )
        params.append(weights.pop(key))
    if weights:
        raise ConfigError(
            f"checkpoint {directory} does not fit this adapter (unexpected weights such as {next(iter(weights))}); "
            "it was trained with other LoRA settings or another base model"
        )
    saved = None
    optimizer_file = directory / OPTIMIZER_FILE
    if optimizer_file.is_file():
        saved = torch.load(optimizer_file, map_location="cpu", weights_only=True)
    return {"params": params, "optimizer": saved}


def load_peft_checkpoint(
    model: PeftModel, optimizer: torch.optim.Optimizer, directory: Path, device: torch.device
) -> None:
    """Adapter weights (and the optimizer state when saved) from a `save_peft_checkpoint` dir."""
    import logging

    import torch
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from gateway.errors import ConfigError

    directory = Path(directory)
    weights = load_file(directory / ADAPTER_FILES[1], device=str(device))
    unexpected = getattr(set_peft_model_state_dict(model, weights), "unexpected_keys", None)
    if unexpected:
        raise ConfigError(
            f"checkpoint {directory} does not fit this adapter (unexpected weights such as "
            f"{unexpected[0]}); it was trained with other LoRA settings or another base model"
        )
    optimizer_file = directory / OPTIMIZER_FILE
    if optimizer_file.is_file():
        # load_state_dict restores the saved param groups (their lr, weight decay) with the
        # moments: the settings of this run must win, or a new --learning-rate is ignored.
        current = [{k: v for k, v in group.items() if k in _RUN_SETTINGS} for group in optimizer.param_groups]
        optimizer.load_state_dict(torch.load(optimizer_file, map_location=device, weights_only=True))
        for group, settings in zip(optimizer.param_groups, current, strict=True):
            group.update(settings)
    else:
        logging.getLogger("rlproxy.trainer").warning(
            "checkpoint %s has no %s: the optimizer restarts from zero", directory, OPTIMIZER_FILE
        )


class TrainingBackend(ABC):
    """A base model with one trainable LoRA adapter, and its optimizer.

    Construction loads everything (`settings.base_model` resolved to a path,
    `settings.device`, LoRA `lora_rank`/`lora_alpha`/`lora_dropout` on
    `LORA_TARGET_MODULES` where the model has them, AdamW at `learning_rate`, `weight_decay`), seeded
    with `settings.seed` so a fresh adapter is the same on every run. Misconfiguration
    (no GPU for a GPU backend, a model that cannot be found) raises `ConfigError` with a
    message saying what to change.
    """

    name: str = "base"

    model: torch.nn.Module
    """The base model with the adapter attached (set by the subclass before `init_optimizer`)."""
    optimizer: torch.optim.Optimizer
    _params: list[torch.nn.Parameter]
    team: Team | None = None
    """The ranks this backend trains with (`attach_team`); None: one process."""
    replication: Replication | None = None
    _snapshots_taken = 0

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def attach_team(self, team: Team) -> None:
        """Train with the other ranks of `team` (every rank calls this once, after construction):
        the model wrapped for DDP or FSDP2, the optimizer made again over the wrapped parameters."""
        from trainer.distributed.wrap import Replication

        self.team = team
        self.replication = Replication(self.model, team)
        self._new_optimizer()

    @property
    def forward_model(self) -> torch.nn.Module:
        """What the trained (gradient) forwards call: the DDP wrapper under a team, else the model."""
        return self.replication.forward_model if self.replication is not None else self.model

    # -- what the model is
    @property
    @abstractmethod
    def tokenizer(self) -> Any:
        """The base model's Hugging Face tokenizer (chat template included): the trainer
        re-renders calls that were recorded without token ids with it."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the model's parameters live; rows are moved there."""

    @property
    def pad_token_id(self) -> int:
        """Token id used to pad a batch (never attended to, never trained on)."""
        tokenizer = self.tokenizer
        for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
            if candidate is not None:
                return int(candidate)
        return 0

    # -- forward passes
    @abstractmethod
    def token_logprobs(self, row: PackedRow) -> torch.Tensor:
        """logprobs_T (float32, on `device`) of one packed row under the policy (adapter
        on), with gradients: entry t is log p(token t | earlier tokens of its own sample),
        0 at each sample's first token. `trainer.packing.token_logprobs` does exactly
        this for any causal LM that takes a 4D attention mask."""

    @abstractmethod
    def reference_logprobs(self, row: PackedRow) -> torch.Tensor:
        """Like `token_logprobs`, under the base model (adapter disabled) and without
        gradients: the reference of the KL to the base, asked for at every step (reported
        whatever beta is; in the loss when beta > 0)."""

    # -- optimisation
    def init_optimizer(self) -> None:
        """AdamW at `learning_rate` and `weight_decay` (0 by default, as in TRL and
        transformers; torch's own default is 0.01) over `self.model`'s trainable (LoRA)
        parameters; call it once the adapter is attached. The methods below work on what it sets.
        Under a team every rank starts a fresh optimizer too."""
        if self.team is not None:
            self.team.announce("init_optimizer")
        self._new_optimizer()

    def _new_optimizer(self) -> None:
        import torch

        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self._params, lr=self.settings.learning_rate, weight_decay=self.settings.weight_decay
        )

    def zero_grad(self) -> None:
        """Clear the adapter's gradients before a pass accumulates new ones."""
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self, require_finite: bool = False) -> float:
        """Clip the accumulated gradients to `settings.max_grad_norm`, take one optimizer
        step, clear the gradients; return the gradient norm before clipping. With
        `require_finite`, a NaN or infinite norm skips the step (AdamW would spread it into
        every weight and moment)."""
        import math

        import torch

        norm = torch.nn.utils.clip_grad_norm_(self._params, self.settings.max_grad_norm)
        full_tensor = getattr(norm, "full_tensor", None)  # sharded gradients: the norm over every rank's shards
        grad_norm = float(full_tensor() if full_tensor is not None else norm)
        if not require_finite or math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def snapshot(self) -> dict:
        """A copy of the adapter weights and the optimizer state, for `restore`. Kept in host
        memory: on a GPU shared with a sleeping vLLM every megabyte of device memory counts.
        Under a team each rank copies what it holds (its shards under FSDP2)."""
        from trainer.distributed.wrap import _local

        number = self._snapshots_taken = self._snapshots_taken + 1
        if self.team is not None:
            self.team.announce("snapshot", number)

        def host(value: torch.Tensor) -> torch.Tensor:
            return _local(value).detach().to("cpu", copy=True)

        return {
            "id": number,  # the other ranks keep theirs under the same number
            "params": [host(p) for p in self._params],
            "optimizer": [{k: host(v) for k, v in self.optimizer.state.get(p, {}).items()} for p in self._params],
        }

    def restore(self, snapshot: dict) -> None:
        """Put back what `snapshot` copied: a step that failed half-way leaves no trace. Under a team
        every rank puts back its own copy of the same number."""
        import torch

        from trainer.distributed.wrap import _local

        if self.team is not None:
            self.team.announce("restore", snapshot["id"])
        with torch.no_grad():
            for param, saved, state in zip(self._params, snapshot["params"], snapshot["optimizer"], strict=True):
                _local(param).copy_(saved)
                if not state:
                    self.optimizer.state.pop(param, None)  # the step that made the moments is undone
                    continue
                current = self.optimizer.state[param]
                for key, value in state.items():
                    _local(current[key]).copy_(value)

    # -- files
    @abstractmethod
    def save(self, directory: Path | None) -> None:
        """Write the adapter in PEFT format (`ADAPTER_FILES`) and the optimizer state
        (`OPTIMIZER_FILE`) into an existing, empty `directory`. Atomicity is the
        caller's job (`trainer.checkpoints` writes to a temporary directory)."""

    @abstractmethod
    def load(self, directory: Path) -> None:
        """Restore the adapter weights and, when `OPTIMIZER_FILE` is there, the optimizer
        state from a directory `save` wrote."""

    def load_full(self, full: dict) -> None:
        """Every rank of a team: the whole state rank 0 read (`read_full_checkpoint`), each keeping its part."""
        if self.replication is None:
            raise RuntimeError("load_full is for the ranks of a team")
        self.replication.set_full_state(self._params, self.optimizer, full["params"], full["optimizer"])

    # -- introspection
    @property
    def context_length(self) -> int | None:
        """The positions the base model reads, as its config states them (`stated_context`: the
        context the local engine and vLLM serve). A learned table of positions (GPT-2, OPT) has no
        embedding past it (IndexError); a rotary model (Qwen, Llama, SmolLM) computes a rotation
        for any position, but one past its context was never trained and is never served."""
        from gateway.models.context import stated_context

        return stated_context(self.model.config)

    def trainable_parameters(self) -> int:
        """Number of trained (LoRA) parameters, for the log."""
        return sum(p.numel() for p in self._params)
