"""Token-level policy-gradient losses, as a table keyed by `LossConfig.loss_type`.

Every loss is a per-token surrogate plus an aggregation; `LOSSES` says which pairs make
which loss, so the differences between GRPO, Dr. GRPO, DAPO, GSPO and CISPO are read in
five lines. Inputs are per-token tensors of any shape: one packed row [T], several rows
concatenated, or a padded batch [B, T]; only tokens with `loss_mask` True count.

The ratio is r_t = exp(logp_t - old_logp_t) against the logprobs recorded at sampling
time. Where those are unknown (NaN: calls recorded without logprobs) the current logprob,
detached, stands in: r_t = 1 with gradient grad(logp_t), i.e. plain REINFORCE.

Normalisation is batch-wide (`LossNorm`), so a batch processed as several chunks (one
packed row per forward/backward) gives losses and gradients that *sum* to those of the
whole batch at once; the metrics returned sum the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer.types import LossConfig, LossNorm


@dataclass(frozen=True, eq=False)
class Tokens:
    """The trained tokens of a batch or chunk, flattened: N = number of masked tokens."""

    logprobs_N: torch.Tensor
    """Current policy, float32, carries the gradient."""
    old_logprobs_N: torch.Tensor
    """Sampling policy; NaN already replaced by the detached current logprob."""
    advantages_N: torch.Tensor
    segment_ids_N: torch.Tensor
    """Which sample a token belongs to (GSPO's sequence ratio)."""
    trajectory_tokens_N: torch.Tensor
    """Trained tokens of the token's trajectory over the whole batch."""


Surrogate = Callable[[Tokens, LossConfig], "tuple[torch.Tensor, torch.Tensor, torch.Tensor]"]
"""(tokens, config) -> (loss_N, ratio_N, clipped_N): per-token loss, the ratio it used,
and where clipping removed the gradient."""

Aggregate = Callable[[torch.Tensor, Tokens, LossConfig, LossNorm], torch.Tensor]
"""(values_N, tokens, config, norm) -> scalar."""


# --- per-token surrogates -------------------------------------------------------------


def _clip_min(ratio_N: torch.Tensor, adv_N: torch.Tensor, cfg: LossConfig):
    """PPO's pessimistic bound -min(r A, clip(r, 1-eps, 1+eps_high) A). The clipped term
    wins (and the gradient is 0) only when it is lower: A > 0 with r > 1+eps_high, or
    A < 0 with r < 1-eps."""
    unclipped_N = ratio_N * adv_N
    clipped_N = ratio_N.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * adv_N
    return -torch.minimum(unclipped_N, clipped_N), ratio_N.detach(), clipped_N < unclipped_N


def token_clipped_surrogate(x: Tokens, cfg: LossConfig):
    """GRPO/PPO: one ratio per token."""
    return _clip_min(torch.exp(x.logprobs_N - x.old_logprobs_N), x.advantages_N, cfg)


def sequence_clipped_surrogate(x: Tokens, cfg: LossConfig):
    """GSPO (Zheng et al. 2025): one ratio per sample, s = exp(mean_t(logp - old_logp)),
    clipped per sequence. Written per token as s_t = sg(s) * exp(logp_t - sg(logp_t)):
    its value is s, and averaged over the sample its gradient is s * mean_t grad(logp_t)
    = grad(s), the paper's sequence-level gradient."""
    _, seg_N = torch.unique(x.segment_ids_N, return_inverse=True)
    S = int(seg_N.max()) + 1 if seg_N.numel() else 0
    log_ratio_N = (x.logprobs_N - x.old_logprobs_N).detach()
    sums_S = log_ratio_N.new_zeros(S).index_add(0, seg_N, log_ratio_N)
    counts_S = log_ratio_N.new_zeros(S).index_add(0, seg_N, torch.ones_like(log_ratio_N))
    seq_log_ratio_N = (sums_S / counts_S)[seg_N]
    ratio_N = torch.exp(seq_log_ratio_N + x.logprobs_N - x.logprobs_N.detach())
    return _clip_min(ratio_N, x.advantages_N, cfg)


def cispo_surrogate(x: Tokens, cfg: LossConfig):
    """CISPO (MiniMax-M1, 2025): -sg(min(r, 1+eps_high)) * A * logp_t. The clipped
    importance weight is detached, so every token keeps a REINFORCE gradient (none is
    dropped, unlike PPO clipping). No lower clip, as in MiniMax-M1 (which sets eps_low so
    large it never acts): a token the policy now dislikes still gets its weight."""
    ratio_N = torch.exp(x.logprobs_N - x.old_logprobs_N).detach()
    weight_N = ratio_N.clamp(max=1.0 + cfg.eps_high)
    return -weight_N * x.advantages_N * x.logprobs_N, ratio_N, ratio_N > 1.0 + cfg.eps_high


# --- aggregations ---------------------------------------------------------------------


def mean_per_trajectory(v_N: torch.Tensor, x: Tokens, cfg: LossConfig, norm: LossNorm):
    """Mean over each trajectory's trained tokens, then mean over trajectories: each
    trajectory weighs 1/num_trajectories whatever its length (a long rollout does not
    outvote a short one). Done token-wise as sum(v_t / len(traj(t))) / num_trajectories,
    which stays exact when a trajectory's samples land in different rows."""
    return (v_N / x.trajectory_tokens_N).sum() / norm.num_trajectories


def sum_over_constant(v_N: torch.Tensor, x: Tokens, cfg: LossConfig, norm: LossNorm):
    """Dr. GRPO (Liu et al. 2025): each trajectory's token-loss *sum* divided by one
    constant (max_tokens_norm, else the longest trajectory's length in the batch), then
    mean over trajectories. Every token weighs the same, so a trajectory weighs in
    proportion to its length: no per-length division that would favour long wrong answers
    (small per-token penalty) and short right ones."""
    constant = cfg.max_tokens_norm or norm.max_trajectory_tokens
    return v_N.sum() / (constant * norm.num_trajectories)


def mean_over_tokens(v_N: torch.Tensor, x: Tokens, cfg: LossConfig, norm: LossNorm):
    """DAPO (Yu et al. 2025): token-level mean over every trained token of the batch;
    a trajectory weighs in proportion to its length."""
    return v_N.sum() / norm.num_loss_tokens


@dataclass(frozen=True)
class LossSpec:
    surrogate: Surrogate
    aggregate: Aggregate


LOSSES: dict[str, LossSpec] = {
    "grpo": LossSpec(token_clipped_surrogate, mean_per_trajectory),
    "dr_grpo": LossSpec(token_clipped_surrogate, sum_over_constant),
    # DAPO's other half, clip-higher, is `epsilon_high` > `epsilon` (the paper: 0.28/0.2).
    "dapo": LossSpec(token_clipped_surrogate, mean_over_tokens),
    "gspo": LossSpec(sequence_clipped_surrogate, mean_per_trajectory),
    "cispo": LossSpec(cispo_surrogate, mean_per_trajectory),
}


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || ref) (Schulman 2020):
    exp(ref - logp) - (ref - logp) - 1, non-negative and unbiased for tokens sampled from
    the policy."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def loss_norm(loss_mask: torch.Tensor, trajectory_tokens: torch.Tensor) -> LossNorm:
    """`LossNorm` from tensors holding the *whole* batch (a trajectory of n trained tokens
    adds n * 1/n = 1 to the trajectory count)."""
    ttok_N = trajectory_tokens[loss_mask].double()
    return LossNorm(
        num_trajectories=round(float((1.0 / ttok_N).sum())) if ttok_N.numel() else 0,
        num_loss_tokens=int(loss_mask.sum()),
        max_trajectory_tokens=int(ttok_N.max()) if ttok_N.numel() else 0,
    )


def compute_loss(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    segment_ids: torch.Tensor,
    trajectory_tokens: torch.Tensor,
    config: LossConfig,
    ref_logprobs: torch.Tensor | None = None,
    norm: LossNorm | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The `config.loss_type` loss of a batch, or of one chunk of it.

    All tensors share one shape. `norm` is the whole batch's; leave it None only when the
    tensors are the whole batch. With a chunk, the returned loss is that chunk's share:
    the shares sum to the batch loss, so call backward on each and the gradients add up.

    The k3 KL to the reference (base) model, times `beta`, is added to each token's loss
    before aggregation (as TRL does); `ref_logprobs` is needed only when beta > 0 (given
    with beta = 0, the KL is only reported).
    Metrics (detached floats, additive over chunks): loss, policy_loss (the loss without
    the KL), kl (mean per trained token), clip_fraction (trained tokens whose gradient
    clipping removed or, for cispo, whose weight was capped), ratio_mean.
    """
    spec = LOSSES[config.loss_type]  # LossConfig already checked the name
    if config.beta > 0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs (the base model's, adapter disabled)")
    if norm is None:
        norm = loss_norm(loss_mask, trajectory_tokens)
    mask = loss_mask.bool()
    logprobs_N = logprobs[mask].float()
    old_N = old_logprobs[mask].float()
    x = Tokens(
        logprobs_N=logprobs_N,
        old_logprobs_N=torch.where(torch.isnan(old_N), logprobs_N.detach(), old_N),
        advantages_N=advantages[mask].float(),
        segment_ids_N=segment_ids[mask],
        trajectory_tokens_N=trajectory_tokens[mask].float(),
    )
    if logprobs_N.numel() == 0:
        # Nothing to train on in this chunk; keep the graph so backward() still works.
        zero = logprobs.sum() * 0.0
        return zero, {k: 0.0 for k in ("loss", "policy_loss", "kl", "clip_fraction", "ratio_mean")}

    policy_N, ratio_N, clipped_N = spec.surrogate(x, config)
    loss_N = policy_N
    kl_N = None
    if ref_logprobs is not None:
        kl_N = k3_kl(logprobs_N, ref_logprobs[mask].float())
    if config.beta > 0:
        loss_N = policy_N + config.beta * kl_N
    loss = spec.aggregate(loss_N, x, config, norm)

    per_token = float(norm.num_loss_tokens)
    with torch.no_grad():
        metrics = {
            "loss": float(loss),
            "policy_loss": float(spec.aggregate(policy_N.detach(), x, config, norm)),
            "kl": float(kl_N.sum() / per_token) if kl_N is not None else 0.0,
            "clip_fraction": float(clipped_N.float().sum() / per_token),
            "ratio_mean": float(ratio_N.sum() / per_token),
        }
    return loss, metrics
