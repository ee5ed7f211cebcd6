"""The built-in instruct model: its synthetic training chats, the labels it trains on, and
that the model it yields reads its prompt (names an item of the user's last message),
which the random built-in model does not."""

from __future__ import annotations

import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from gateway.models.instruct import DIGITS, LETTERS, instruction_tune, synthetic_chat, training_example
from gateway.models.registry import resolve_base_model
from gateway.models.tiny import TINY_INSTRUCT_MODEL_ID, TINY_MODEL_ID, _build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return _build_tokenizer()


def items_of(text: str) -> set[str]:
    return {word for word in text.replace("Options:", " ").replace(",", " ").split()}


def test_training_example_labels_exactly_the_replies_and_their_end(tokenizer):
    messages = [
        {"role": "system", "content": "Pick one."},
        {"role": "user", "content": "3 A 7"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "B\nC"},
        {"role": "assistant", "content": "C"},
    ]
    ids, labels = training_example(tokenizer, messages)

    # By hand, from separately encoded pieces of the rendered chat: each prompt (up to and
    # including the generation prompt) is masked, each reply and its <|im_end|> trained,
    # the newline after <|im_end|> masked.
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    first_prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    between = "\n<|im_start|>user\nB\nC<|im_end|>\n<|im_start|>assistant\n"
    expected_ids = encode(first_prompt) + encode("A<|im_end|>") + encode(between) + encode("C<|im_end|>") + encode("\n")
    assert ids == expected_ids
    reply_a, reply_c = encode("A<|im_end|>"), encode("C<|im_end|>")
    expected_labels = [-100] * len(encode(first_prompt)) + reply_a + [-100] * len(encode(between)) + reply_c + [-100]
    assert labels == expected_labels
    assert tokenizer.decode([t for t in labels if t != -100]) == "A<|im_end|>C<|im_end|>"


def test_synthetic_chats_answer_with_an_item_of_the_last_user_turn():
    rng = random.Random(0)
    answers = []
    for _ in range(300):
        messages = synthetic_chat(rng)
        assert messages[0]["role"] == "system"
        for user, assistant in zip(messages[1::2], messages[2::2], strict=False):
            assert (user["role"], assistant["role"]) == ("user", "assistant")
            assert assistant["content"] in items_of(user["content"])
            answers.append(assistant["content"])
    # Both kinds of item are answers: nothing in the data prefers digits (or any one digit).
    assert {a for a in answers if a in DIGITS} == set(DIGITS)
    assert len({a for a in answers if a in LETTERS}) > 20


def test_instruction_tuning_is_deterministic(tokenizer):
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
    )

    def tuned(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
        instruction_tune(model, tokenizer, steps=3, batch_size=4, learning_rate=1e-3, seed=seed)
        return model.state_dict()

    first, again, other = tuned(1), tuned(1), tuned(2)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)  # the data follows the seed


def last_turn_probability(model_dir: str, chats: list[list[dict]]) -> float:
    """Mean probability the model's first reply token gives to the items of the last user turn."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    total = 0.0
    for messages in chats:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            probabilities = model(torch.tensor([ids])).logits[0, -1].softmax(-1)
        items = {tokenizer.convert_tokens_to_ids(item) for item in items_of(messages[-1]["content"])}
        total += float(probabilities[sorted(items)].sum())
    return total / len(chats)


def test_the_instruct_model_reads_its_prompt_and_the_random_one_does_not(tmp_path):
    rng = random.Random(12345)  # chats the build never saw (it draws from the model's seed)
    chats = [synthetic_chat(rng)[:-1] for _ in range(100)]  # up to the last user turn
    instruct = last_turn_probability(resolve_base_model(TINY_INSTRUCT_MODEL_ID, tmp_path), chats)
    random_model = last_turn_probability(resolve_base_model(TINY_MODEL_ID, tmp_path), chats)
    print(f"probability on the last turn's items: instruct {instruct:.3f}, random {random_model:.3f}")
    assert instruct >= 0.7
    assert random_model <= 0.1
