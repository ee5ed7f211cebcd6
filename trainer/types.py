"""The trainer's data types: frozen dataclasses, no torch, no I/O."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "gspo", "cispo")
"""The names `trainer.losses.LOSSES` is keyed by; here so that a config is checked
without importing torch."""

KL_ESTIMATORS = ("k3", "low_var_kl", "k2")
"""The KL penalties `trainer.losses.kl_penalty` computes: per token, from log pi and log ref."""

CISPO_CAP = 5.0
"""cispo's ratio cap when `--epsilon-high` is not given: TRL's recommended value (its
`GRPOConfig.epsilon_high` under cispo is ScaleRL's eps_max, recommended 5.0)."""


@dataclass(frozen=True)
class Sample:
    """One training sequence: a trajectory (or a segment of one) as token ids.

    A trajectory becomes several samples only when its calls cannot be merged into one
    sequence (a later prompt does not start with the earlier prompt + completion).
    """

    token_ids: tuple[int, ...]
    """Prompt + completion tokens, length T."""

    loss_mask: tuple[bool, ...]
    """Length T; True exactly on sampled completion tokens (what the policy chose)."""

    old_logprobs: tuple[float, ...]
    """Length T; behaviour logprob log mu of token t: under the distribution the engine
    actually sampled it from (temperature, penalties, top-k, top-p). NaN where unknown:
    prompt tokens, or completions recorded without logprobs (an upstream's; the importance
    weight is then 1)."""

    advantage: float
    """The trajectory's advantage, shared by all of its samples."""

    trajectory_id: str
    """Session id; the samples of one trajectory share it."""

    group_id: str
    """The group whose rewards the advantage was computed against."""

    temperatures: tuple[float, ...] | None = None
    """Length T; the sampling temperature of the call that produced token t: the logits
    that predict token t are divided by it when the policy is scored, so pi_old is the
    policy that sampled. 1.0 on prompt tokens; None means 1.0 everywhere."""

    weights: tuple[float, ...] | None = None
    """Length T; the loss weight of token t (its per-token loss is multiplied by it before the
    loss aggregates): below 1 on a turn that also trains in another group, so that its
    occurrences weigh 1 in all (`trainer.publish`). None means 1.0 everywhere."""

    reward: float | None = None
    """The trajectory's reward, which `advantage` was computed from: `--reward-kl` shapes it with
    the trajectory's KL to the base once the step has scored the base (`trainer.reward_kl`)."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if n == 0:
            raise ValueError(f"sample of trajectory {self.trajectory_id!r} has no tokens")
        if self.weights is not None and (
            len(self.weights) != n or not all(w >= 0 and math.isfinite(w) for w in self.weights)
        ):
            raise ValueError(
                f"sample of trajectory {self.trajectory_id!r}: weights must be one finite number >= 0 per token ({n})"
            )
        if self.temperatures is not None:
            if len(self.temperatures) != n:
                raise ValueError(
                    f"sample of trajectory {self.trajectory_id!r}: temperatures "
                    f"({len(self.temperatures)}) must have one entry per token ({n})"
                )
            if not all(t > 0 and math.isfinite(t) for t in self.temperatures):
                raise ValueError(f"sample of trajectory {self.trajectory_id!r}: temperatures must be > 0")
        if len(self.loss_mask) != n or len(self.old_logprobs) != n:
            raise ValueError(
                f"sample of trajectory {self.trajectory_id!r}: token_ids ({n}), loss_mask "
                f"({len(self.loss_mask)}) and old_logprobs ({len(self.old_logprobs)}) "
                "must have the same length"
            )
        # Token 0 has no context, so the model gives no logprob for it: it cannot be trained.
        if self.loss_mask[0]:
            raise ValueError(
                f"sample of trajectory {self.trajectory_id!r} starts with a completion token; "
                "a sample must start with at least one prompt token"
            )
        if not math.isfinite(self.advantage):
            raise ValueError(f"sample of trajectory {self.trajectory_id!r} has advantage {self.advantage}")

    @property
    def num_loss_tokens(self) -> int:
        """How many tokens of this sample are trained on."""
        return sum(self.loss_mask)


@dataclass(frozen=True)
class Trajectory:
    """One rollout of the agent on one task (one session), with its reward."""

    trajectory_id: str
    """Session id."""

    group_id: str
    """The rollouts of one task that GRPO compares share a group id."""

    reward: float
    """The session's scalar reward (posted by the client or given by RULER)."""

    samples: tuple[Sample, ...]
    """The trajectory's training sequences, in call order."""


@dataclass(frozen=True)
class LossConfig:
    """Hyperparameters of the policy-gradient loss (see `trainer.losses`)."""

    loss_type: str = "grpo"
    """A key of `trainer.losses.LOSSES`: grpo, dr_grpo, dapo, gspo or cispo."""

    epsilon: float = 0.2
    """Lower clip: the ratio is clipped below at 1 - epsilon (not used by cispo)."""

    epsilon_high: float | None = None
    """Upper clip: 1 + epsilon_high. None means epsilon (symmetric). DAPO's paper uses
    0.28 with epsilon 0.2; GSPO's uses 4e-4 with epsilon 3e-4. Set it explicitly.
    cispo: the cap of the ratio itself (TRL's eps_max), `CISPO_CAP` when None."""

    beta: float = 0.0
    """Weight of the KL penalty against the base model; 0 turns it off (and then no
    reference logprobs are needed)."""

    kl_estimator: str = "k3"
    """What the beta term puts in each token's loss (`trainer.types.KL_ESTIMATORS`): k3
    (TRL's, Schulman 2020); low_var_kl, k3 clamped at 10 (verl's and slime's); or k2,
    0.5 (log pi - log ref)^2, whose gradient on tokens sampled from the policy is the
    reverse KL's (k3's is the forward KL's)."""

    max_tokens_norm: int | None = None
    """dr_grpo only: the fixed token budget a trajectory's token-loss sum is divided by
    (TRL: max_completion_length). Required for dr_grpo; the worker sets it from
    `--max-tokens-norm`, else from the largest `max_tokens` among the run's first step's
    calls (`--default-max-tokens` for those that set none), saved with the checkpoints."""

    tis_cap: float = 2.0
    """Truncated importance sampling: each token's policy loss is weighted by
    min(pi_old / mu, tis_cap), mu the behaviour probability the engine recorded (sequence
    level for gspo); 1 where mu is unknown. 0 turns the correction off."""

    delta: float | None = None
    """Dual clip (TRL's `delta`): the unclipped ratio is capped at delta, which bounds
    -r*A for negative advantages (PPO's min never clips them from above). Must exceed
    1 + epsilon_high. None: off."""

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown loss_type {self.loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")
        if not self.epsilon >= 0:
            raise ValueError(f"epsilon must be >= 0, got {self.epsilon}")
        if self.epsilon_high is not None and not self.epsilon_high >= 0:
            raise ValueError(f"epsilon_high must be >= 0, got {self.epsilon_high}")
        if not self.beta >= 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown kl_estimator {self.kl_estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}")
        if self.max_tokens_norm is not None and self.max_tokens_norm <= 0:
            raise ValueError(f"max_tokens_norm must be a positive int, got {self.max_tokens_norm}")
        if not self.tis_cap >= 0:
            raise ValueError(f"tis_cap must be >= 0 (0 turns it off), got {self.tis_cap}")
        if self.delta is not None and not self.delta > 1.0 + self.eps_high:
            raise ValueError(f"delta must be > 1 + epsilon_high = {1.0 + self.eps_high}, got {self.delta}")

    @property
    def eps_low(self) -> float:
        return self.epsilon

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def cispo_cap(self) -> float:
        """cispo's cap on the importance ratio: `epsilon_high` itself, as in TRL, or
        `CISPO_CAP` when it is not given."""
        return CISPO_CAP if self.epsilon_high is None else self.epsilon_high


@dataclass(frozen=True)
class LossNorm:
    """Batch-wide counts the loss is normalised by.

    Computed once for the whole batch, so that a batch split into packed rows (one
    forward/backward each) sums to exactly the loss of the batch taken at once.
    """

    num_trajectories: int
    """Trajectories with at least one trained token."""

    num_loss_tokens: int
    """Trained tokens in the batch."""

    max_trajectory_tokens: int
    """Trained tokens of the longest trajectory (reported; dr_grpo uses a fixed budget)."""

    num_known_behaviour_tokens: int = 0
    """Trained tokens whose behaviour logprob is known (the mismatch metric's denominator)."""

    @classmethod
    def from_samples(cls, samples: Sequence[Sample]) -> LossNorm:
        tokens_by_trajectory: dict[str, int] = {}
        known = 0
        for s in samples:
            tokens_by_trajectory[s.trajectory_id] = tokens_by_trajectory.get(s.trajectory_id, 0) + s.num_loss_tokens
            known += sum(1 for m, lp in zip(s.loss_mask, s.old_logprobs, strict=False) if m and not math.isnan(lp))
        counts = [n for n in tokens_by_trajectory.values() if n > 0]
        return cls(
            num_trajectories=len(counts),
            num_loss_tokens=sum(counts),
            max_trajectory_tokens=max(counts, default=0),
            num_known_behaviour_tokens=known,
        )
