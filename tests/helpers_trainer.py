"""Stores filled with hand-made rewarded groups, recorded as the local engine would:
token ids from the tiny model's tokenizer, logprobs from a forward pass of the base model
(which step 0's adapter equals: LoRA's B starts at zero)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gateway.models.registry import resolve_base_model
from gateway.settings import Settings
from gateway.store import CallRecord
from gateway.store.sqlite import SQLiteStore

ANSWERS = ["The answer is 7.", "It is 42.", "No.", "Yes, well done!", "Let me think step by step.", "I don't know."]


def trainer_settings(state_dir: Path, **overrides) -> Settings:
    """Small and fast: tiny model, small LoRA, quick polling."""
    values = dict(
        state_dir=state_dir,
        groups_per_step=2,
        poll_interval=0.05,
        lora_rank=4,
        lora_alpha=8,
        learning_rate=1e-2,
        max_tokens_per_row=256,
    )
    return Settings(**{**values, **overrides})


class Recorder:
    """Writes calls and rewards into a store file, like the gateway does."""

    def __init__(self, settings: Settings):
        self.settings = settings
        path = resolve_base_model(settings.base_model, settings.state_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.store = SQLiteStore(settings.db_path)

    def close(self) -> None:
        asyncio.run(self.store.close())

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @torch.no_grad()
    def logprobs(self, prompt: list[int], completion: list[int]) -> list[float]:
        ids = torch.tensor([prompt + completion])
        logp = torch.log_softmax(self.model(input_ids=ids).logits[0].float(), dim=-1)
        n = len(prompt)
        return [float(logp[n + i - 1, t]) for i, t in enumerate(completion)]

    def call(self, session_id: str, group_id: str, question: str, answer: str, step: int | None = 0) -> None:
        messages = [{"role": "user", "content": question}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = self.encode(text)
        completion = self.encode(answer + self.tokenizer.eos_token)
        self.store.record_call_sync(
            CallRecord(
                id=f"{session_id}-call",
                session_id=session_id,
                group_id=group_id,
                split="train",
                model=self.settings.model_name,
                served=f"{self.settings.model_name}@{step}",
                step=step,
                engine="local",
                stream=False,
                status="ok",
                request={"model": self.settings.model_name, "messages": messages},
                response={
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}
                    ]
                },
                latency_ms=1.0,
                prompt_ids=prompt,
                completion_ids=[completion],
                behaviour_logprobs=[self.logprobs(prompt, completion)],
            )
        )

    def group(self, group_id: str, rewards: list[float], step: int | None = 0) -> None:
        """A closed group: one session per reward, each one call answered by adapter `step`."""
        for i, reward in enumerate(rewards):
            session_id = f"{group_id}-s{i}"
            self.call(
                session_id,
                group_id,
                f"What is {i} + {len(group_id)}?",
                ANSWERS[(i + len(group_id)) % len(ANSWERS)],
                step,
            )
            asyncio.run(self.store.set_reward(session_id, reward))
        asyncio.run(self.store.close_group(group_id))


def grpo_samples(
    groups: list[list[tuple[list[int], list[int], list[float]]]],
    rewards: list[float],
    *,
    scale_rewards: str,
    step: int,
    temperature: float = 1.0,
) -> list:
    """The worker's samples for a step of rollouts: `groups[g][i]` is rollout i of group g as
    (prompt ids, completion ids, behaviour logprobs), `rewards` theirs in the same order. GRPO
    advantages within each group (`trainer.advantages`); only the completion is trained."""
    import math

    from trainer.advantages import compute_advantages
    from trainer.types import Sample

    by_group, start = {}, 0
    for g, rollouts in enumerate(groups):
        by_group[f"g{g}"] = rewards[start : start + len(rollouts)]
        start += len(rollouts)
    advantages, _ = compute_advantages(by_group, scale_rewards)
    return [
        Sample(
            token_ids=tuple(prompt + completion),
            loss_mask=(False,) * len(prompt) + (True,) * len(completion),
            old_logprobs=(math.nan,) * len(prompt) + tuple(logprobs),
            advantage=advantages[f"g{g}"][i],
            trajectory_id=f"s{step}-{g}-{i}",
            group_id=f"g{g}",
            temperatures=(1.0,) * len(prompt) + (temperature,) * len(completion),
        )
        for g, rollouts in enumerate(groups)
        if f"g{g}" in advantages  # a group without spread teaches nothing
        for i, (prompt, completion, logprobs) in enumerate(rollouts)
    ]


def tiny_gpt2(directory: Path) -> Path:
    """A two-block GPT-2 (its blocks in `transformer.h`, not `model.layers`) with the tiny model's tokenizer."""
    import shutil

    import transformers

    from gateway.models.cache import model_cache_dir
    from gateway.models.tiny import ensure_tiny_model

    tiny = ensure_tiny_model(model_cache_dir(directory / "cache"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=2, n_positions=512)
    model_dir = directory / "tiny-gpt2"
    transformers.GPT2LMHeadModel(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    shutil.copy(tiny / "chat_template.jinja", model_dir)
    return model_dir


def tiny_qwen2_reading(directory: Path, positions: int) -> Path:
    """The built-in tiny Qwen2 (rotary positions, no table of them) whose config states a context
    of `positions` tokens: the same weights, a model configured for a shorter or longer context."""
    import json
    import shutil

    from gateway.models.cache import model_cache_dir
    from gateway.models.tiny import ensure_tiny_model

    model_dir = directory / f"tiny-qwen2-{positions}"
    shutil.copytree(ensure_tiny_model(model_cache_dir(directory / "cache")), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}))
    return model_dir
