"""The policy loss's flags (`trainer.losses`, `trainer.types.LossConfig`): a mixin of
`gateway.settings.Settings`, kept apart for its size.

Each combination that cannot train as asked is refused here, when the settings are read (at
`rlproxy serve` or `rlproxy train`), with the reason: the trainer builds its `LossConfig` only
at a step, where the same mistake failed every group in turn and set them aside as if the data
were at fault.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from gateway.settings_bounds import MAX_BETA, MAX_RATIO

KL_ESTIMATOR_HELP = (
    "the --beta term per token: k3 (TRL's); low_var_kl, k3 clamped at 10 (verl's), so that one sampled token "
    "the base prefers cannot outweigh the batch; or k2, 0.5 (log pi - log ref)^2, whose gradient is the "
    "reverse KL's (docs/training.md, Reward hacking)"
)
REWARD_KL_HELP = (
    "subtract this times each trajectory's KL to the base model (log mu - log pi_ref summed over its "
    "trained tokens) from its reward before the group's advantages: a guard against a gamed reward that "
    "holds however small the group's reward differences become; 0 turns it off"
)
REWARD_KL_SHARPEN_HELP = (
    "with --reward-kl, take the KL to the base sharpened to pi_ref^A (log mu - A log pi_ref summed over the "
    "trajectory's trained tokens): above 1 it also favours the replies the base itself finds likelier, which "
    "keeps a real model's replies in its own language while a reward pulls them (docs/training.md, Reward "
    "hacking); 1 is the plain KL"
)


class LossSettings(BaseModel):
    """The policy loss and its parameters: flags of `Settings`."""

    loss_type: Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo"] = Field("grpo", description="policy loss")
    epsilon: float = Field(0.2, gt=0, le=MAX_RATIO, description="lower clip range of the ratio")
    epsilon_high: float | None = Field(
        None, ge=0, le=MAX_RATIO, description="upper clip range (default: epsilon); cispo: the cap of the ratio itself"
    )
    beta: float = Field(0.0, ge=0, le=MAX_BETA, description="weight of the KL against the base model (--kl-estimator)")
    kl_estimator: Literal["k3", "low_var_kl", "k2"] = Field("k3", description=KL_ESTIMATOR_HELP)
    reward_kl: float = Field(0.0, ge=0, description=REWARD_KL_HELP)
    reward_kl_sharpen: float = Field(1.0, ge=1.0, le=4.0, description=REWARD_KL_SHARPEN_HELP)
    scale_rewards: Literal["group", "batch", "none"] = Field("group", description="divide advantages by this std")
    tis_cap: float = Field(
        2.0,
        ge=0,
        le=MAX_RATIO,
        description="truncated importance sampling: weight each token by "
        "min(pi_old/mu, C), mu the sampler's probability; 0 turns it off",
    )
    delta: float | None = Field(
        None,
        le=MAX_RATIO,
        description="dual clip: cap the ratio at delta for negative advantages "
        "(TRL's delta; must exceed 1 + epsilon_high; not with cispo); default off",
    )
    max_tokens_norm: int | None = Field(
        None,
        ge=1,
        description="dr_grpo: the fixed token budget a trajectory's "
        "loss is divided by; default: the largest max_tokens among the run's first step's calls "
        "(--default-max-tokens for calls that set none), fixed for the run and saved with the checkpoints",
    )

    @model_validator(mode="after")
    def _dual_clip_above_the_clip_range(self) -> LossSettings:
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        if self.delta is not None and not self.delta > 1.0 + high:
            raise ValueError(
                f"delta ({self.delta}) must exceed 1 + epsilon_high ({1.0 + high}): it caps the ratio "
                "above the clip range; leave it unset to turn the dual clip off"
            )
        return self

    @model_validator(mode="after")
    def _parameters_the_loss_uses(self) -> LossSettings:
        # A flag the chosen loss never reads would be ignored without a word; refused instead.
        if self.loss_type == "cispo" and self.delta is not None:
            raise ValueError(
                "--delta has nothing to cap under --loss-type cispo: its weight min(ratio, epsilon_high) is "
                "already capped and detached; the dual clip is for grpo, dr_grpo, dapo and gspo"
            )
        if self.loss_type == "cispo" and self.epsilon_high == 0:
            raise ValueError(
                "--loss-type cispo caps each token's weight at --epsilon-high itself (TRL's eps_max; 5.0 when "
                "unset): 0 weighs every token 0 and trains nothing"
            )
        if self.max_tokens_norm is not None and self.loss_type != "dr_grpo":
            raise ValueError(
                f"--max-tokens-norm is dr_grpo's fixed divisor; --loss-type {self.loss_type} never uses it: "
                "drop it, or use --loss-type dr_grpo"
            )
        return self
