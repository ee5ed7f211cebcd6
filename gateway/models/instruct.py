"""Instruction tuning for the built-in instruct model: a minute of supervised training on
synthetic chats in which the assistant answers with one of the items the user's last
message lists.

Why this skill and nothing more: it is what a real instruct model brings to an agent task
and a randomly initialised network lacks, reading its prompt. A random model trained by RL
through LoRA did not learn to name a free square of a tic-tac-toe board in 150 steps
(docs/demo.md); after this tuning the same network names an item of the last user turn with
~0.85 of its probability, and RL has only to learn *which* item to pick. The chats know
nothing of any demo task: items are single digits and capital letters (each one token of
the built-in tokenizer), laid out in rows, lists or an "Options:" line, and the answer is
drawn uniformly from them, so the tuned model has no preference RL could merely uncover.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Callable

log = logging.getLogger("rlproxy.tiny_model")

DIGITS = tuple("123456789")
LETTERS = tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
SYSTEMS = (
    "You are a helpful assistant.",
    "Answer with one of the items.",
    "Pick one.",
    "Choose an option.",
    "Reply with a single item from the list.",
    "You are a game player. Reply with your choice.",
)
MAX_TURNS = 5

_REPLY = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.DOTALL)


def synthetic_chat(rng: random.Random, max_turns: int = MAX_TURNS) -> list[dict]:
    """A system message, then 1..max_turns user turns each answered by one of its items."""
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}]
    for _ in range(rng.randint(1, max_turns)):
        kind = rng.random()
        pool = DIGITS if kind < 0.4 else LETTERS if kind < 0.6 else DIGITS + LETTERS
        items = [rng.choice(pool) for _ in range(rng.randint(2, 9))]
        messages.append({"role": "user", "content": _layout(rng, items)})
        messages.append({"role": "assistant", "content": rng.choice(items)})
    return messages


def _layout(rng: random.Random, items: list[str]) -> str:
    shape = rng.random()
    if shape < 0.3:
        return " ".join(items)
    if shape < 0.5:
        return ", ".join(items)
    if shape < 0.8:  # rows
        width = rng.choice((2, 3, 4))
        return "\n".join(" ".join(items[i : i + width]) for i in range(0, len(items), width))
    return "Options: " + " ".join(items)


def training_example(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(input ids, labels) of a chat rendered with the chat template: the labels are the
    assistant replies and their <|im_end|>, -100 elsewhere. One render and one tokenization
    (offsets locate the replies), not one render per turn: this runs 30,000 times a build."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = [match.span(1) for match in _REPLY.finditer(text)]
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, labels, span = encoded["input_ids"], [], 0
    for token, (start, end) in zip(ids, encoded["offset_mapping"], strict=False):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        inside = span < len(spans) and spans[span][0] <= start and end <= spans[span][1]
        labels.append(token if inside else -100)
    return ids, labels


def instruction_tune(
    model,
    tokenizer,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    progress: Callable[[int, int, float], None] | None = None,
) -> float:
    """Train `model` in place on `steps` batches of synthetic chats; returns the last loss.
    AdamW, a short warm-up then a linear decay, gradients clipped at 1."""
    import torch

    rng = random.Random(seed)
    pad_id = tokenizer.pad_token_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    warmup = max(1, steps // 60)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.05, 1.0 - s / steps)
    )
    model.train()
    loss_value = float("nan")
    for step in range(steps):
        examples = [training_example(tokenizer, synthetic_chat(rng)) for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in examples)
        input_ids = torch.full((batch_size, width), pad_id)
        labels = torch.full((batch_size, width), -100)
        attention = torch.zeros((batch_size, width), dtype=torch.long)
        for row, (ids, row_labels) in enumerate(examples):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, : len(ids)] = torch.tensor(row_labels)
            attention[row, : len(ids)] = 1
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if progress is not None:
            progress(step + 1, steps, loss_value)
    model.eval()
    return loss_value


def log_progress(every_seconds: float = 10.0) -> Callable[[int, int, float], None]:
    """A `progress` callback that logs a line at most every `every_seconds` (a build takes minutes)."""
    started = last = time.monotonic()

    def report(step: int, steps: int, loss: float) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= every_seconds or step == steps:
            last = now
            log.warning(
                "building the built-in instruct model (once): step %d/%d, loss %.3f, %.0f s",
                step,
                steps,
                loss,
                now - started,
            )

    return report
