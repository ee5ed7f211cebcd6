"""The unsloth backend with Unsloth replaced by a recording stand-in (no GPU here).

The stand-in `unsloth` module records what the backend calls, with which arguments and in
which order, and hands back a tiny model that keeps Unsloth's forward contract (returns
hidden states under UNSLOTH_RETURN_HIDDEN_STATES=1, takes `packed_seq_lengths`), wrapped
with real peft so saving writes the PEFT files vLLM loads.
"""

from __future__ import annotations

import json
import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from gateway.errors import ConfigError
from gateway.settings import Settings
from trainer.backends import get_backend
from trainer.backends.base import ADAPTER_FILES, LORA_TARGET_MODULES, OPTIMIZER_FILE
from trainer.backends.unsloth import chunked_token_logprobs, segment_lengths
from trainer.packing import pack
from trainer.step import train_step
from trainer.types import Sample

VOCAB, HIDDEN = 50, 16


class _Config(dict):
    """A model config as peft reads it: keys, attributes and to_dict()."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self.get(name)

    def to_dict(self) -> dict:
        return dict(self)


class TinyUnslothLM(torch.nn.Module):
    """Unsloth's forward contract in miniature (no attention: enough to check the plumbing)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.q_proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.v_proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.config = _Config(model_type="qwen2", tie_word_embeddings=False, _name_or_path="tiny")
        self.forwards: list[dict] = []

    def get_output_embeddings(self):
        return self.lm_head

    def hidden(self, input_ids):
        x = self.embed_tokens(input_ids)
        return torch.tanh(self.q_proj(x)) + self.v_proj(x)

    def forward(self, input_ids=None, position_ids=None, packed_seq_lengths=None, use_cache=None, **kwargs):
        returns_hidden = os.environ.get("UNSLOTH_RETURN_HIDDEN_STATES") == "1"
        self.forwards.append(
            {
                "position_ids": position_ids,
                "packed_seq_lengths": packed_seq_lengths,
                "use_cache": use_cache,
                "returns_hidden": returns_hidden,
                "extra": sorted(kwargs),
            }
        )
        hidden = self.hidden(input_ids)
        return SimpleNamespace(logits=hidden if returns_hidden else self.lm_head(hidden))


class DroppingUnslothLM(TinyUnslothLM):
    """A base model whose config drops out in training, the two ways Unsloth leaves on: a
    residual `nn.Dropout` (GPT-2's `resid_pdrop`, in a model Unsloth does not rewrite) and the
    config's `attention_dropout`, which Unsloth's Granite attention reads while `self.training`."""

    def __init__(self):
        super().__init__()
        self.config["attention_dropout"] = 0.1
        self.resid_dropout = torch.nn.Dropout(0.1)

    def hidden(self, input_ids):
        x = self.embed_tokens(input_ids)
        attention_p = self.config.attention_dropout if self.training else 0.0
        return self.resid_dropout(torch.tanh(torch.nn.functional.dropout(self.q_proj(x), attention_p)) + self.v_proj(x))


def recording_unsloth(calls: list, model_class=TinyUnslothLM):
    """A stand-in `unsloth` module: FastLanguageModel's three static methods, recorded."""
    from peft import LoraConfig, get_peft_model

    class FastLanguageModel:
        @staticmethod
        def from_pretrained(**kwargs):
            calls.append(("from_pretrained", kwargs))
            tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=1)
            return model_class(), tokenizer

        @staticmethod
        def get_peft_model(model, **kwargs):
            calls.append(("get_peft_model", kwargs))
            present = [m for m in kwargs["target_modules"] if hasattr(model, m)]
            config = LoraConfig(
                r=kwargs["r"],
                lora_alpha=kwargs["lora_alpha"],
                lora_dropout=kwargs["lora_dropout"],
                target_modules=present,
                init_lora_weights=False,
            )
            torch.manual_seed(kwargs["random_state"])
            return get_peft_model(model, config)

        @staticmethod
        def for_training(model, use_gradient_checkpointing=True):
            calls.append(("for_training", {}))
            model.train()
            return model

    module = types.ModuleType("unsloth")
    module.FastLanguageModel = FastLanguageModel
    return module


@pytest.fixture
def unsloth_standin(monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "unsloth", recording_unsloth(calls))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("UNSLOTH_RETURN_HIDDEN_STATES", raising=False)
    yield calls
    os.environ.pop("UNSLOTH_RETURN_HIDDEN_STATES", None)


def settings(tmp_path, **overrides) -> Settings:
    values = dict(
        backend="unsloth",
        device="cuda:1",
        base_model="Qwen/Qwen2.5-7B-Instruct",
        lora_rank=8,
        lora_alpha=16,
        lora_dropout=0.05,
        seed=7,
        max_tokens_per_row=1024,
        learning_rate=1e-3,
        state_dir=tmp_path,
    )
    values.update(overrides)
    return Settings(**values)


def sample(ids, n_prompt, advantage=1.0, trajectory="t0"):
    mask = tuple([False] * n_prompt + [True] * (len(ids) - n_prompt))
    return Sample(
        token_ids=tuple(ids),
        loss_mask=mask,
        old_logprobs=tuple([float("nan")] * len(ids)),
        advantage=advantage,
        trajectory_id=trajectory,
        group_id="g",
    )


def test_calls_unsloth_as_documented_in_order(tmp_path, unsloth_standin):
    backend = get_backend("unsloth")(settings(tmp_path))
    assert [name for name, _ in unsloth_standin] == ["from_pretrained", "get_peft_model", "for_training"]
    _, loaded = unsloth_standin[0]
    # 16-bit LoRA on the exact id vLLM serves (issue 8): no swap to a bnb-4bit copy
    assert loaded == {
        "model_name": "Qwen/Qwen2.5-7B-Instruct",
        "max_seq_length": 1024,
        "load_in_4bit": False,
        "load_in_16bit": True,
        "dtype": torch.bfloat16,
        "use_exact_model_name": True,
        "device_map": {"": 1},
    }
    _, peft = unsloth_standin[1]
    assert peft == {
        "r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.05,
        "target_modules": list(LORA_TARGET_MODULES),
        "use_gradient_checkpointing": "unsloth",
        "random_state": 7,
    }
    assert backend.trainable_parameters() > 0 and backend.pad_token_id == 0


def test_packed_logprobs_in_chunks_match_a_full_log_softmax(tmp_path, unsloth_standin):
    backend = get_backend("unsloth")(settings(tmp_path, lora_dropout=0.0))  # no dropout: comparable passes
    samples = [sample([3, 4, 5, 6, 7], 2), sample([8, 9, 10], 1, trajectory="t1")]
    (row,) = pack(samples, max_tokens_per_row=64)
    logprobs_T = backend.token_logprobs(row)
    forward = backend.model.get_base_model().forwards[-1]
    assert forward["returns_hidden"] and forward["use_cache"] is False
    assert forward["packed_seq_lengths"].tolist() == [5, 3] and forward["packed_seq_lengths"].dtype == torch.int32
    assert forward["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    # the same numbers as the full [T, V] log softmax over the model's logits
    with torch.no_grad():
        os.environ["UNSLOTH_RETURN_HIDDEN_STATES"] = "0"
        logits = backend.model(input_ids=row.input_ids_T[None]).logits[0]
        os.environ["UNSLOTH_RETURN_HIDDEN_STATES"] = "1"
    full = torch.log_softmax(logits[:-1].float(), -1).gather(-1, row.input_ids_T[1:, None]).squeeze(-1)
    expected = torch.cat([full.new_zeros(1), full]).masked_fill(row.position_ids_T == 0, 0.0)
    torch.testing.assert_close(logprobs_T.detach(), expected)
    assert logprobs_T.requires_grad
    # the KL reference runs with the adapter off and no graph
    reference = backend.reference_logprobs(row)
    assert not reference.requires_grad and reference.shape == logprobs_T.shape


def test_logprobs_are_scored_at_the_temperature_each_token_was_sampled_at(tmp_path, unsloth_standin):
    """Issue 8: the unsloth backend divides by the recorded temperature, like the peft backend."""
    backend = get_backend("unsloth")(settings(tmp_path, lora_dropout=0.0))
    ids = [3, 4, 5, 6, 7]
    temps = (1.0, 1.0, 0.5, 0.7, 1.3)
    hot = Sample(
        token_ids=tuple(ids),
        loss_mask=(False, False, True, True, True),
        old_logprobs=tuple([float("nan")] * 5),
        advantage=1.0,
        trajectory_id="t0",
        group_id="g",
        temperatures=temps,
    )
    (row,) = pack([hot], max_tokens_per_row=64)
    got = backend.token_logprobs(row).detach()
    with torch.no_grad():
        os.environ["UNSLOTH_RETURN_HIDDEN_STATES"] = "0"
        logits = backend.model(input_ids=torch.tensor(ids)[None]).logits[0]
        os.environ["UNSLOTH_RETURN_HIDDEN_STATES"] = "1"
    # token t is predicted by logits at t-1, divided by the temperature token t was sampled at
    expected = [0.0] + [torch.log_softmax(logits[t - 1].float() / temps[t], -1)[ids[t]].item() for t in range(1, 5)]
    torch.testing.assert_close(got, torch.tensor(expected))


def test_chunked_logprobs_and_gradients_equal_unchunked():
    torch.manual_seed(1)
    hidden = torch.randn(37, HIDDEN, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, requires_grad=True)
    targets = torch.randint(0, VOCAB, (37,))
    chunked = chunked_token_logprobs(hidden, weight, targets, chunk=5)
    chunked.sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    full = torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets[:, None]).squeeze(-1)
    full.sum().backward()
    torch.testing.assert_close(chunked, full)
    torch.testing.assert_close(grads[0], hidden.grad)
    torch.testing.assert_close(grads[1], weight.grad)
    assert segment_lengths(torch.tensor([0, 0, 0, 1, 1, 2, -1, -1])).tolist() == [3, 2, 1, 2]


def test_train_save_in_peft_format_and_load(tmp_path, unsloth_standin):
    backend = get_backend("unsloth")(settings(tmp_path, lora_dropout=0.0))
    (row,) = pack([sample([3, 4, 5, 6], 1)], max_tokens_per_row=64)
    backend.zero_grad()
    (-backend.token_logprobs(row)[row.loss_mask_T].sum()).backward()
    assert backend.optimizer_step() > 0
    out = tmp_path / "ckpt"
    out.mkdir()
    backend.save(out)
    assert all((out / name).is_file() for name in (*ADAPTER_FILES, OPTIMIZER_FILE))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 16
    assert backend.model.get_base_model().forwards  # trained through Unsloth's forward contract
    trained = backend.token_logprobs(row).detach()
    fresh = get_backend("unsloth")(settings(tmp_path, lora_dropout=0.0))
    assert not torch.allclose(fresh.token_logprobs(row).detach(), trained)
    fresh.load(out)
    torch.testing.assert_close(fresh.token_logprobs(row).detach(), trained)


def test_a_step_reports_the_kl_to_the_base_with_beta_0(tmp_path, unsloth_standin):
    """Issue 39: the KL to the base is measured at every step, through Unsloth's forward too (the
    stand-in's adapter starts non-zero, so the first step already has a distance to report)."""
    run = settings(tmp_path, lora_dropout=0.0, beta=0.0)
    backend = get_backend("unsloth")(run)
    trained = sample([3, 4, 5, 6, 7], 2)
    (row,) = pack([trained], max_tokens_per_row=64)
    ids = row.input_ids_T
    with torch.no_grad():  # by hand: full log softmax of the adapted model and of a fresh base
        os.environ["UNSLOTH_RETURN_HIDDEN_STATES"] = "0"
        policy = torch.log_softmax(backend.model(input_ids=ids[None]).logits[0].float(), -1)
        base = torch.log_softmax(TinyUnslothLM()(input_ids=ids[None]).logits[0].float(), -1)
        os.environ["UNSLOTH_RETURN_HIDDEN_STATES"] = "1"
    d = torch.stack([base[t - 1, ids[t]] - policy[t - 1, ids[t]] for t in (2, 3, 4)])
    expected = float((torch.exp(d) - d - 1).mean())
    assert expected > 0
    assert train_step(backend, [trained], run)["kl"] == pytest.approx(expected, rel=1e-4)


def test_the_base_models_dropout_is_off_so_a_score_is_the_policys(tmp_path, unsloth_standin, monkeypatch):
    # As the peft backend: trained in train mode, a base that drops out scored every token under
    # a random mask, so pi_old and the ratios were noise. LoRA's own dropout stays as asked.
    monkeypatch.setitem(sys.modules, "unsloth", recording_unsloth(unsloth_standin, DroppingUnslothLM))
    backend = get_backend("unsloth")(settings(tmp_path, lora_dropout=0.05))
    base = backend.model.get_base_model()
    (row,) = pack([sample([3, 4, 5, 6, 7, 8, 9], 2)], max_tokens_per_row=64)
    assert base.training
    with backend.model.disable_adapter():  # the base alone: LoRA's dropout out of the way
        base_scores = [backend.token_logprobs(row).detach() for _ in range(2)]
        base.eval()
        expected = backend.token_logprobs(row).detach()
    assert torch.equal(base_scores[0], base_scores[1])
    torch.testing.assert_close(base_scores[0], expected)
    assert base.config.attention_dropout == 0.0 and base.resid_dropout.p == 0.0
    lora_dropouts = {m.p for name, m in backend.model.named_modules() if "lora_dropout" in name and hasattr(m, "p")}
    assert lora_dropouts == {0.05}


def test_without_a_gpu_the_error_is_clear_and_unsloth_is_not_touched(tmp_path, monkeypatch):
    touched = []

    class Untouchable(types.ModuleType):
        def __getattr__(self, name):
            touched.append(name)
            raise AttributeError(name)

    monkeypatch.setitem(sys.modules, "unsloth", Untouchable("unsloth"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    backend_class = get_backend("unsloth")
    with pytest.raises(ConfigError, match="NVIDIA GPU.*--backend peft"):
        backend_class(settings(tmp_path))
    assert touched == []


def test_a_cpu_device_with_a_gpu_present_says_to_pass_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="--device cuda"):
        get_backend("unsloth")(settings(tmp_path, device="cpu"))
    with pytest.raises(ConfigError, match="only 1 GPU"):
        get_backend("unsloth")(settings(tmp_path, device="cuda:3"))


def test_head_transforms_match_a_direct_computation():
    """Gemma 2's final-logit softcapping and Cohere's logit_scale, applied to the chunked head."""
    from trainer.backends.unsloth import head_transform

    assert head_transform({"final_logit_softcapping": 30.0}) == (1.0, 30.0)
    assert head_transform({"logit_scale": 0.0625}) == (0.0625, None)
    assert head_transform({"logits_scaling": 4.0, "model_type": "granite"}) == (0.25, None)
    assert head_transform({"logits_scaling": 4.0, "model_type": "hyperclovax"}) == (4.0, None)
    assert head_transform({"logits_scaling": 4.0, "model_type": "minicpm3"}) == (1.0, None)
    assert head_transform({"model_type": "qwen2"}) == (1.0, None)
    torch.manual_seed(1)
    hidden_TH, weight_VH = torch.randn(7, HIDDEN) * 3, torch.randn(VOCAB, HIDDEN)
    targets_T = torch.randint(0, VOCAB, (7,))
    for scale, cap in ((1.0, 5.0), (0.0625, None), (0.5, 2.0)):
        logits = hidden_TH @ weight_VH.T * scale
        if cap:
            logits = cap * torch.tanh(logits / cap)
        expected = torch.log_softmax(logits, -1).gather(-1, targets_T[:, None]).squeeze(-1)
        got = chunked_token_logprobs(hidden_TH, weight_VH, targets_T, chunk=3, scale=scale, softcap=cap)
        torch.testing.assert_close(got, expected)


def test_four_bit_is_opt_in_and_needs_the_checkpoint_vllm_serves(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    settings = Settings(backend="unsloth", device="cuda", base_model="Qwen/Qwen2.5-7B-Instruct", load_in_4bit=True)
    monkeypatch.setitem(sys.modules, "unsloth", types.SimpleNamespace(FastLanguageModel=None))
    with pytest.raises(ConfigError, match="bnb-4bit checkpoint.*--base-model"):
        get_backend("unsloth")(settings)
