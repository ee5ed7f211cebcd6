"""Defaults tuned per model: each built-in model learns with other settings than `Settings`'
(which are for real models of a billion parameters and more).

`Settings` holds the defaults for real (pretrained) models. On the built-in model, which is
random, those learn nothing in any reasonable time: LoRA has to move its output
distribution a long way in a few dozen steps, so its learning rate is 200 times higher (a
single-turn task trained with 5e-5 on it stayed flat, 0.097 -> 0.097 over 28 steps; with
1e-2 it rose). The built-in instruct model, the same tiny network after a minute of
instruction tuning, learns with the same values (tic-tac-toe in process: 1e-2 beat 3e-3
and 3e-2). `for_model` fills in the tuned values for every setting the user did not give
(flag or RLPROXY_* variable): what the user says always wins.
"""

from __future__ import annotations

import logging

from gateway.settings import SMOLLM2_MODEL_ID, TINY_INSTRUCT_MODEL_ID, TINY_MODEL_ID, Settings

TINY_MODEL_SETTINGS = {
    "learning_rate": 1e-2,
    "lora_rank": 8,
    "lora_alpha": 16,
    "groups_per_step": 4,
}
"""What `rlproxy serve`, `rlproxy train` and `rlproxy demo` use on either tiny built-in model."""

SMOLLM2_SETTINGS = {
    "learning_rate": 1e-3,
    "beta": 0.2,
    "kl_estimator": "low_var_kl",
    # the clamp that keeps json from collapsing also lets SHOUT's capitals turn to gibberish
    # (English 0.19); a trajectory's KL taken off its reward holds them (0.47-0.78)
    "reward_kl": 0.1,
    # but any KL to the base itself keeps only as many of the capital replies English as the base
    # writes (0.57-0.59: bench/shout_frontier.py); one to the base sharpened to pi_ref^1.2 also
    # favours the capital replies the base finds likely, which are its words
    "reward_kl_sharpen": 1.2,
    "lora_rank": 8,
    "lora_alpha": 16,
    "groups_per_step": 4,
}
"""SmolLM2-135M-Instruct's: measured on the demo's tasks (docs/training.md, "Reward hacking")."""

MODEL_SETTINGS = {
    TINY_MODEL_ID: TINY_MODEL_SETTINGS,
    TINY_INSTRUCT_MODEL_ID: TINY_MODEL_SETTINGS,
    SMOLLM2_MODEL_ID: SMOLLM2_SETTINGS,
}


def tuned_defaults(base_model: str) -> dict:
    """The defaults that differ from `Settings`' for this base model."""
    return dict(MODEL_SETTINGS.get(base_model, {}))


def for_model(settings: Settings) -> Settings:
    """`settings` with the model's tuned defaults in place of the settings nobody gave."""
    tuned = {k: v for k, v in tuned_defaults(settings.base_model).items() if k not in settings.model_fields_set}
    if not tuned:
        return settings
    tuned_settings = settings.model_copy(update=tuned)
    # model_copy counts the updated fields as given; "given" must stay what the user said,
    # or `log_settings` never names what tuning chose.
    object.__setattr__(tuned_settings, "__pydantic_fields_set__", set(settings.model_fields_set))
    return tuned_settings


def log_settings(settings: Settings, logger: logging.Logger, what: str) -> None:
    """The settings in force, once at start (secrets masked), and which came from tuning."""
    tuned = sorted(k for k in tuned_defaults(settings.base_model) if k not in settings.model_fields_set)
    note = f" (tuned for {settings.base_model}: {', '.join(tuned)})" if tuned else ""
    logger.info("%s settings%s: %s", what, note, settings.public_dict())
