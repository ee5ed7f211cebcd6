"""The model the local engine serves: transformers weights, peft adapters, one forward.

`LocalModel.load` runs once at start, on a thread. After that only the worker thread
(gateway/engines/local/worker.py) calls its methods: `forward` for every prefill and decode
step, `load_adapter` / `unload_adapter` between steps. The event loop reads `tokenizer`,
`context` and `adapters` (to refuse a request for an adapter that is not loaded).
"""

from __future__ import annotations

import inspect
import warnings
from collections import deque
from pathlib import Path
from typing import Any

from gateway.engines.local.jobs import BASE_ADAPTER
from gateway.errors import ConfigError, Conflict, NotFound
from gateway.models.context import stated_context


class LocalModel:
    """The base model (wrapped by peft once an adapter is loaded), its tokenizer and its special tokens."""

    def __init__(self, model, tokenizer, device: Any, eos_ids: set[int], pad_id: int, context: int):
        self.model = model  # what forward calls: the base model, or the PeftModel wrapping it
        self.tokenizer = tokenizer
        self.device = device
        self.eos_ids = eos_ids
        self.pad_id = pad_id
        self.context = context
        self.peft = False
        self.adapters: set[str] = set()  # loaded, written on the worker only
        self.step_batch_sizes: deque[int] = deque(maxlen=100_000)  # rows per forward (instrumentation)
        # transformers renamed `past_key_values` to `cache` (5.2x warns on the old name, 5.40
        # drops it); the model class's own signature says which this version takes.
        forward = inspect.signature(type(model).forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward else "past_key_values"

    @classmethod
    def load(
        cls, model_path: str, *, device: str, dtype: str | None, threads: int | None, chat_template: str | None = None
    ) -> LocalModel:
        """Load weights and tokenizer (with the `--chat-template` in force); `dtype` None is float32
        on CPU, bfloat16 elsewhere."""
        import torch
        from transformers import AutoModelForCausalLM

        from gateway.models.templates import load_tokenizer

        dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
        tokenizer = load_tokenizer(model_path, chat_template)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        model = model.to(device).eval()
        if device == "cpu":
            # smollm2 (134.5M) included: beside `serve`'s trainer on a busy 2-core machine, torch's
            # 2 threads took 19-31 s for an 8-token greedy reply, 1 thread 2-4 s.
            small = sum(p.numel() for p in model.parameters()) < 200_000_000
            threads = threads or (1 if small else None)
            if threads:
                torch.set_num_threads(threads)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        if not eos:
            raise ConfigError(f"the model at {model_path} defines no eos token (generation_config or tokenizer)")
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
        context = stated_context(model.config) or int(tokenizer.model_max_length)
        return cls(model, tokenizer, device, set(eos), pad_id, context)

    def forward(self, ids_BT, mask_BT, cache, adapters: list[str | None], logits_to_keep: int = 1):
        """Logits of the last position of every row, float32: [B, V]."""
        position_BT = (mask_BT.cumsum(-1) - 1).clamp(min=0)[:, -ids_BT.shape[1] :]
        kwargs = {}
        if self.peft:
            kwargs["adapter_names"] = [name or BASE_ADAPTER for name in adapters]
        self.step_batch_sizes.append(ids_BT.shape[0])
        kwargs[self._cache_kwarg] = cache
        out = self.model(
            input_ids=ids_BT,
            attention_mask=mask_BT,
            position_ids=position_BT,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )
        return out.logits[:, -1, :].float()

    # ------------------------------------------------------------ adapters (worker thread)

    def load_adapter(self, name: str, path: Path | None) -> None:
        from peft import PeftModel

        if name in self.adapters:
            raise Conflict(f"adapter '{name}' is already loaded")
        device = str(self.device)
        if not self.peft:
            self.model = PeftModel.from_pretrained(
                self.model, str(path), adapter_name=name, is_trainable=False, torch_device=device
            )
            self.peft = True
        else:
            self.model.load_adapter(str(path), adapter_name=name, is_trainable=False, torch_device=device)
        self.model.eval()
        self.adapters.add(name)

    def unload_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise NotFound(f"adapter '{name}' is not loaded")
        if len(self.adapters) == 1:
            self.model = self.model.unload().eval()  # drop the LoRA layers: back to the plain base model
            self.peft = False
        else:
            with warnings.catch_warnings():  # "adapter X was active": we never use the active adapter
                warnings.simplefilter("ignore")
                self.model.delete_adapter(name)
        self.adapters.discard(name)
