import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from gateway.errors import ConfigError
from gateway.models import tiny as tiny_model
from gateway.models.registry import resolve_base_model
from gateway.models.tiny import TINY_MODEL_ID, ensure_tiny_model
from gateway.settings import SMOLLM2_MODEL_ID

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def render(tokenizer, messages, tools=None, generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_loads_like_any_hf_model(model_dir, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.config.model_type == "qwen2"
    assert model.dtype == torch.float32
    assert model.config.tie_word_embeddings
    assert model.config.vocab_size == len(tokenizer)
    assert 512 <= len(tokenizer) <= 1024
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert model.generation_config.eos_token_id == im_end
    assert (model_dir / "model.safetensors").is_file()
    # every special and tool token is one atom
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"):
        assert len(encode(tokenizer, token)) == 1, token
    # the tool-call tags survive skip_special_tokens (the parser needs them), chat markers do not
    ids = encode(tokenizer, "<|im_start|>assistant\n<tool_call>{}</tool_call><|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<tool_call>{}</tool_call>"
    out = model(torch.tensor([ids])).logits
    assert out.shape == (1, len(ids), len(tokenizer)) and torch.isfinite(out).all()


def test_build_is_deterministic_and_seeded(tmp_path, model_dir):
    again = ensure_tiny_model(tmp_path / "a")
    assert (again / "tokenizer.json").read_text() == (model_dir / "tokenizer.json").read_text()
    weights, same = load_file(model_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert weights.keys() == same.keys() and all(torch.equal(weights[k], same[k]) for k in weights)
    other = load_file(ensure_tiny_model(tmp_path / "b", seed=1) / "model.safetensors")
    assert not torch.equal(weights["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_cached_and_atomic(tmp_path, monkeypatch):
    first = ensure_tiny_model(tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns

    def boom(directory, seed, instruct=False):
        (directory / "config.json").write_text("{}")  # half a model...
        raise RuntimeError("crash while building")

    assert ensure_tiny_model(tmp_path) == first  # cached: no rebuild
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    monkeypatch.setattr(tiny_model, "_build", boom)
    with pytest.raises(RuntimeError):
        ensure_tiny_model(tmp_path, seed=7)
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # ...never left behind


def test_resolve_base_model(tmp_path, monkeypatch):
    monkeypatch.delenv("RLPROXY_CACHE_DIR", raising=False)
    path = resolve_base_model(TINY_MODEL_ID, tmp_path)
    assert (tmp_path / "cache") in Path(path).parents
    monkeypatch.setenv("RLPROXY_CACHE_DIR", str(tmp_path / "shared"))  # one build for every state dir
    assert Path(resolve_base_model(TINY_MODEL_ID, tmp_path / "other-state")).parent == tmp_path / "shared"
    assert AutoTokenizer.from_pretrained(path).eos_token == "<|im_end|>"
    assert resolve_base_model("Qwen/Qwen2.5-0.5B-Instruct", tmp_path) == "Qwen/Qwen2.5-0.5B-Instruct"
    assert resolve_base_model(str(tmp_path), tmp_path) == str(tmp_path)  # a local directory, as it is
    with pytest.raises(ConfigError, match="--base-model '/some/local/dir' is not a directory"):
        resolve_base_model("/some/local/dir", tmp_path)  # not an id from_pretrained would fetch


def test_smollm2_is_converted_once_per_user_outside_every_state_dir(tmp_path, monkeypatch):
    """Issue 39: 517 MB converted once per machine, not again under each state dir or demo --out."""
    from gateway.models import smollm2

    asked: list[Path] = []
    monkeypatch.setattr(smollm2, "ensure_smollm2", lambda cache_dir: asked.append(cache_dir) or cache_dir / "m")
    monkeypatch.delenv("RLPROXY_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    resolve_base_model(SMOLLM2_MODEL_ID, tmp_path / "state-a")
    resolve_base_model(SMOLLM2_MODEL_ID, tmp_path / "state-b")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    resolve_base_model(SMOLLM2_MODEL_ID, tmp_path / "state-c")
    monkeypatch.setenv("RLPROXY_CACHE_DIR", str(tmp_path / "shared"))
    resolve_base_model(SMOLLM2_MODEL_ID, tmp_path / "state-d")
    xdg = tmp_path / "xdg" / "rlproxy"
    assert asked == [xdg, xdg, tmp_path / "home" / ".cache" / "rlproxy", tmp_path / "shared"]


def test_chat_template_renders_qwen_style(tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
    ]
    text = render(tokenizer, messages, TOOLS, generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
    ) in text
    assert (
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\nsunny\n'
        "</tool_response><|im_end|>\n"
    ) in text
    assert text.endswith("<|im_start|>assistant\n")
    # arguments given as an object render the same as the JSON string
    messages[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    assert render(tokenizer, messages, TOOLS, generation_prompt=True) == text
    plain = render(tokenizer, [{"role": "user", "content": "Hi"}], generation_prompt=True)
    assert (
        plain == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert list(ids) == encode(tokenizer, plain)


@pytest.mark.parametrize(
    "text",
    [
        'Hello, world! 1234 {"a": [1, 2.5, null]}\n\n  indented\ttab',
        "Ünïcödé — 日本語 🙂 and <tool_call> tags </tool_call> inside",
        "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
    ],
)
def test_tokenization_round_trips(tokenizer, text):
    assert tokenizer.decode(encode(tokenizer, text)) == text


def test_rendered_conversations_round_trip(tokenizer):
    messages = [{"role": "user", "content": "Add 2 and 3, then tell me the result."}]
    text = render(tokenizer, messages, TOOLS, generation_prompt=True)
    assert tokenizer.decode(encode(tokenizer, text)) == text


REPLIES = [
    "Sure! The answer is 42.",
    " leading space, trailing dot.",
    'Line one.\nLine two: {"k": [1, 2]}',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
]


@pytest.mark.parametrize("reply", REPLIES)
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_rendering_is_prefix_stable(tokenizer, reply, tools):
    """prompt(messages[:k]) + reply + <|im_end|> is a token prefix of the longer conversation."""
    from gateway.protocols.toolcalls import parse_tool_calls

    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather in Paris?"}]
    prompt_ids = encode(tokenizer, render(tokenizer, history, tools, generation_prompt=True))
    completion_ids = encode(tokenizer, reply) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    content, calls = parse_tool_calls(reply)
    assistant = {"role": "assistant", "content": content}
    if calls:
        assistant["tool_calls"] = calls
    follow_up = (
        [{"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny"}]
        if calls
        else [{"role": "user", "content": "And tomorrow?"}]
    )
    longer = history + [assistant] + follow_up
    full_ids = encode(tokenizer, render(tokenizer, longer, tools, generation_prompt=True))
    assert full_ids[: len(prompt_ids) + len(completion_ids)] == prompt_ids + completion_ids


def test_concurrent_builders_build_once(tmp_path, monkeypatch):
    import threading
    import time

    builds = []

    def slow_build(directory, seed, instruct=False):
        builds.append(seed)
        time.sleep(0.3)  # long enough for the second builder to arrive while this one builds
        (directory / "config.json").write_text("{}")

    monkeypatch.setattr(tiny_model, "_build", slow_build)
    results = []
    threads = [threading.Thread(target=lambda: results.append(ensure_tiny_model(tmp_path, seed=3))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert builds == [3]  # the second waited for the first's build instead of repeating it
    assert results[0] == results[1] and (results[0] / "config.json").is_file()
