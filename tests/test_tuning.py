"""Tuned defaults per base model: what the user gives wins, and the log says what tuning chose."""

import logging

from gateway.models.tuning import for_model, log_settings
from gateway.settings import TINY_INSTRUCT_MODEL_ID, Settings


def test_built_in_models_get_their_tuning_and_the_user_still_wins():
    for base_model in ("rlproxy/tiny-qwen2", TINY_INSTRUCT_MODEL_ID):
        settings = for_model(Settings(base_model=base_model, learning_rate=3e-4))
        assert settings.learning_rate == 3e-4  # given
        assert (settings.lora_rank, settings.lora_alpha, settings.groups_per_step) == (8, 16, 4)  # tuned
        assert for_model(settings) == settings  # idempotent
    real = for_model(Settings(base_model="Qwen/Qwen2.5-0.5B-Instruct"))
    assert real.learning_rate == Settings().learning_rate and real.lora_rank == Settings().lora_rank


def test_the_start_log_names_the_settings_tuning_chose(caplog):
    settings = for_model(Settings(base_model=TINY_INSTRUCT_MODEL_ID, learning_rate=3e-4))
    with caplog.at_level(logging.INFO, logger="test.tuning"):
        log_settings(settings, logging.getLogger("test.tuning"), "serve")
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(
        f"serve settings (tuned for {TINY_INSTRUCT_MODEL_ID}: groups_per_step, lora_alpha, lora_rank):"
    )
    assert "'learning_rate': 0.0003" in line


def test_smollm2_has_its_own_tuning_in_serve_and_in_the_demo(tmp_path):
    from gateway.demo.options import demo_settings
    from gateway.models.tuning import SMOLLM2_SETTINGS, TINY_MODEL_SETTINGS

    served = for_model(Settings(base_model="smollm2", beta=0.0, reward_kl=0.0))
    assert (served.beta, served.reward_kl) == (0.0, 0.0)  # the flags that turn the guard off win
    assert served.learning_rate == SMOLLM2_SETTINGS["learning_rate"] != TINY_MODEL_SETTINGS["learning_rate"]
    demo = demo_settings({"base_model": "smollm2"}, tmp_path, task="json")
    assert (demo.learning_rate, demo.beta) == (SMOLLM2_SETTINGS["learning_rate"], SMOLLM2_SETTINGS["beta"])
    assert demo.kl_estimator == "low_var_kl" != Settings().kl_estimator  # k3 clamped: json's collapses
    assert demo.reward_kl == 0.1 != Settings().reward_kl  # what holds SHOUT's words under the clamp
    assert demo.reward_kl_sharpen == 1.2 != Settings().reward_kl_sharpen  # and keeps its capitals words
    assert for_model(Settings(base_model="smollm2", reward_kl_sharpen=1.0)).reward_kl_sharpen == 1.0
    tiny = demo_settings({}, tmp_path, task="shout")
    assert (tiny.learning_rate, tiny.beta, tiny.reward_kl) == (TINY_MODEL_SETTINGS["learning_rate"], 0.0, 0.0)
    assert tiny.reward_kl_sharpen == 1.0
