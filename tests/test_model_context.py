"""`stated_context`: the context a model's config states, as vLLM derives its max_model_len.

The expected numbers are the contexts the models' cards and vLLM state for these configs,
written out by hand (not computed by the code under test)."""

import pytest
import transformers

from gateway.models.context import stated_context

YARN_QWEN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "original_max_position_embeddings": 8192,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
}


@pytest.mark.parametrize(
    ("config", "context"),
    [
        # Qwen2.5-7B-Instruct as shipped: 32,768 tokens
        (transformers.Qwen2Config(max_position_embeddings=32768), 32768),
        # the same with the YaRN block its model card adds for 128K (131,072) tokens
        (transformers.Qwen2Config(max_position_embeddings=32768, rope_scaling=YARN_QWEN), 131072),
        # Llama 3.1 states its 128K context itself; the llama3 factor is not applied again
        (transformers.LlamaConfig(max_position_embeddings=131072, rope_scaling=LLAMA3), 131072),
        # linear interpolation by 2 over a 4K model reaches 8K
        (transformers.LlamaConfig(max_position_embeddings=4096, rope_scaling={"type": "linear", "factor": 2.0}), 8192),
        # DeepSeek-V3's YaRN: 4,096 original positions x 40 = the 163,840 it states
        (
            transformers.LlamaConfig(
                max_position_embeddings=163840,
                rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096},
            ),
            163840,
        ),
        # GPT-2's learned table of 1,024 positions (its config calls it n_positions)
        (transformers.GPT2Config(n_positions=1024), 1024),
    ],
    ids=["qwen", "qwen-yarn", "llama3", "linear", "deepseek-yarn", "gpt2"],
)
def test_the_context_a_config_states(config, context):
    assert stated_context(config) == context


def test_gemma3_states_its_scaled_context_and_per_layer_parameters_are_read():
    class Config:
        model_type = "gemma3_text"
        max_position_embeddings = 131072
        rope_parameters = {"full_attention": {"rope_type": "linear", "factor": 8.0}, "sliding_attention": {}}

    assert stated_context(Config()) == 131072  # vLLM serves Gemma 3 at 128K, not 1M
    Config.model_type = "other"  # the same parameters on a model that does not scale already
    assert stated_context(Config()) == 131072 * 8


@pytest.mark.parametrize("positions", [None, 0, -1, "2048", True])
def test_a_config_that_does_not_say_states_no_context(positions):
    class Config:
        max_position_embeddings = positions

    assert stated_context(Config()) is None
