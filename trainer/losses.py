"""Token-level policy-gradient losses, as a table keyed by `LossConfig.loss_type`.

Every loss is a per-token surrogate plus an aggregation; `LOSSES` says which pairs make
which loss, so the differences between GRPO, Dr. GRPO, DAPO, GSPO and CISPO are read in
five lines. Inputs are per-token tensors of any shape: one packed row [T], several rows
concatenated, or a padded batch [B, T]; only tokens with `loss_mask` True count.

Three policies meet here. pi (the adapter being trained, with gradients), pi_old (the
same adapter at the start of the step, scored once without gradients at each call's
sampling temperature) and mu (the behaviour policy: what the engine actually sampled
from, recorded per token). The trust-region ratio is r_t = pi/pi_old, so every pass of
`--epochs-per-step` is clipped against the step's start. The sampler/trainer gap (top-p,
penalties, a stale or differently quantised sampler) is corrected by truncated importance
sampling (Ionides 2008; Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training"): the policy loss of each token is weighted by
w_t = min(pi_old/mu, tis_cap), detached; w = 1 where mu is unknown (NaN) or tis_cap is 0.
GSPO takes the sequence-level weight min(exp(mean_t log(pi_old/mu)), tis_cap), matching
its sequence-level ratio. The KL term is added after the weighting, as TRL does. A token's
loss weight (`Sample.weights`: below 1 on a turn that also trains in another group) then
multiplies its whole loss, policy and KL, before the aggregation; the counts the aggregations
divide by are the batch's tokens and trajectories as they are.

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
    """pi_old, the policy at the start of the step; NaN already replaced by the detached
    current logprob."""
    advantages_N: torch.Tensor
    segment_ids_N: torch.Tensor
    """Which sample a token belongs to (GSPO's sequence ratio)."""
    trajectory_tokens_N: torch.Tensor
    """Trained tokens of the token's trajectory over the whole batch."""
    tis_weight_N: torch.Tensor | None = None
    """Truncated importance weight min(pi_old/mu, cap) of each token (1 where mu is
    unknown); None: no correction."""


Surrogate = Callable[[Tokens, LossConfig], "tuple[torch.Tensor, torch.Tensor, torch.Tensor]"]
"""(tokens, config) -> (loss_N, ratio_N, clipped_N): per-token loss, the ratio it used,
and where clipping removed the gradient."""

Aggregate = Callable[[torch.Tensor, Tokens, LossConfig, LossNorm], torch.Tensor]
"""(values_N, tokens, config, norm) -> scalar."""


# --- per-token surrogates -------------------------------------------------------------


def _clip_min(
    ratio_N: torch.Tensor, adv_N: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's pessimistic bound -min(r A, clip(r, 1-eps, 1+eps_high) A). The clipped term
    wins (and the gradient is 0) only when it is lower: A > 0 with r > 1+eps_high, or
    A < 0 with r < 1-eps."""
    capped_N = ratio_N if cfg.delta is None else ratio_N.clamp(max=cfg.delta)  # dual clip (TRL's delta)
    unclipped_N = capped_N * adv_N
    clipped_N = ratio_N.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * adv_N
    removed_N = (clipped_N < unclipped_N) | (capped_N.detach() < ratio_N.detach())
    return -torch.minimum(unclipped_N, clipped_N), ratio_N.detach(), removed_N


def token_clipped_surrogate(x: Tokens, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GRPO/PPO: one ratio per token."""
    return _clip_min(torch.exp(x.logprobs_N - x.old_logprobs_N), x.advantages_N, cfg)


def sequence_clipped_surrogate(x: Tokens, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def cispo_surrogate(x: Tokens, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, 2025): -sg(min(r, eps_max)) * A * logp_t. The clipped importance
    weight is detached, so every token keeps a REINFORCE gradient (none is dropped, unlike
    PPO clipping). The cap is `epsilon_high` itself, not 1 + epsilon_high, as in TRL
    (`GRPOTrainer._compute_loss`: `torch.clamp(coef_1, max=self.epsilon_high).detach()`;
    `GRPOConfig.epsilon_high`: ScaleRL's eps_max, recommended 5.0), and 5.0 when none is
    given (`LossConfig.cispo_cap`). No lower clip, as in MiniMax-M1 (which sets eps_low so
    large it never acts): a token the policy now dislikes still gets its weight."""
    ratio_N = torch.exp(x.logprobs_N - x.old_logprobs_N).detach()
    cap = cfg.cispo_cap
    weight_N = ratio_N.clamp(max=cap)
    return -weight_N * x.advantages_N * x.logprobs_N, ratio_N, ratio_N > cap


# --- aggregations ---------------------------------------------------------------------


def mean_per_trajectory(v_N: torch.Tensor, x: Tokens, cfg: LossConfig, norm: LossNorm) -> torch.Tensor:
    """Mean over each trajectory's trained tokens, then mean over trajectories: each
    trajectory weighs 1/num_trajectories whatever its length (a long rollout does not
    outvote a short one). Done token-wise as sum(v_t / len(traj(t))) / num_trajectories,
    which stays exact when a trajectory's samples land in different rows."""
    return (v_N / x.trajectory_tokens_N).sum() / norm.num_trajectories


def sum_over_constant(v_N: torch.Tensor, x: Tokens, cfg: LossConfig, norm: LossNorm) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): each trajectory's token-loss *sum* divided by one fixed
    token budget (`max_tokens_norm`; TRL: max_completion_length), then mean over
    trajectories. Every token weighs the same, so a trajectory weighs in proportion to its
    length: no per-length division that would favour long wrong answers (small per-token
    penalty) and short right ones. The budget must not depend on the batch (the longest
    trajectory would make the step size depend on one outlier)."""
    if cfg.max_tokens_norm is None:
        raise ValueError(
            "dr_grpo needs max_tokens_norm, a fixed token budget (--max-tokens-norm, "
            "default: the largest max_tokens among the run's first step's calls)"
        )
    return v_N.sum() / (cfg.max_tokens_norm * norm.num_trajectories)


def mean_over_tokens(v_N: torch.Tensor, x: Tokens, cfg: LossConfig, norm: LossNorm) -> torch.Tensor:
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
    # MiniMax-M1 (eq. 4) and TRL normalise CISPO by the total number of tokens in the batch.
    "cispo": LossSpec(cispo_surrogate, mean_over_tokens),
}


def truncated_importance_weights(
    old_N: torch.Tensor, behaviour_N: torch.Tensor, segment_ids_N: torch.Tensor, cap: float, sequence_level: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights_N, capped_N, known_N): min(pi_old/mu, cap) per token, or per sample (the
    geometric mean over its tokens with a known mu) when `sequence_level`; 1 where mu is
    unknown, and everywhere when cap is 0 (off). All detached."""
    known_N = ~torch.isnan(behaviour_N)
    if cap <= 0:
        return torch.ones_like(old_N), torch.zeros_like(known_N), known_N
    log_w_N = torch.where(known_N, old_N.detach() - behaviour_N, torch.zeros_like(old_N))
    if sequence_level and log_w_N.numel():
        _, seg_N = torch.unique(segment_ids_N, return_inverse=True)
        S = int(seg_N.max()) + 1
        sums_S = log_w_N.new_zeros(S).index_add(0, seg_N, log_w_N)
        counts_S = log_w_N.new_zeros(S).index_add(0, seg_N, known_N.to(log_w_N.dtype))
        log_w_N = (sums_S / counts_S.clamp(min=1))[seg_N]
    weights_N = torch.exp(log_w_N)
    capped_N = weights_N > cap
    return weights_N.clamp(max=cap), capped_N, known_N


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || ref) (Schulman 2020):
    exp(ref - logp) - (ref - logp) - 1, non-negative and unbiased for tokens sampled from
    the policy."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def k2_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k2 estimate (Schulman 2020): 0.5 (logp - ref)^2.

    Why it is offered beside k3: as a loss on tokens sampled from the policy, its expected
    gradient, sum_x pi (log pi - log ref) grad log pi, is the gradient of KL(pi || ref), while
    k3's, sum_x (pi - ref) grad log pi, is the gradient of KL(ref || pi). k3's per-token
    gradient, 1 - ref/pi, is at most 1 on a token the base finds unlikely (where a reward
    hack goes) and unbounded on a token the policy has learnt to avoid but the base prefers;
    k2's, log pi - log ref, grows with the log ratio both ways."""
    d = logprobs - ref_logprobs
    return 0.5 * d * d


LOW_VAR_KL_CLAMP = 10.0
"""low_var_kl's ceiling on a token's k3, verl's and slime's: beyond it (pi_ref / pi above ~13.6,
or pi / pi_ref above ~6e4: x - ln x - 1 = 10) the token adds no KL gradient."""
LOW_VAR_KL_LOG_RATIO = 20.0
"""low_var_kl's bound on log(pi_ref / pi) before exp, verl's: exp overflows float32 from ~88.7, and
the clamp's zero gradient times an infinite exp is a NaN gradient, not zero."""


def kl_penalty(
    estimator: str, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, k3: torch.Tensor | None = None
) -> torch.Tensor:
    """The per-token KL term `--kl-estimator` names (`trainer.types.KL_ESTIMATORS`); `k3`, when
    the caller has it already (the reported KL), is not computed again.

    low_var_kl is k3 clamped at `LOW_VAR_KL_CLAMP`. Why: k3's gradient in log pi, 1 - pi_ref/pi,
    is unbounded on a token the policy has learnt to avoid and the base prefers; sampled once
    (pi_ref/pi = 230: a json reply going back to the base's `{"plural": ...}`), its KL term
    alone outweighed the batch's policy gradient and the next steps collapsed."""
    if estimator == "k2":
        return k2_kl(logprobs, ref_logprobs)
    if estimator == "low_var_kl":
        d = (ref_logprobs - logprobs).clamp(-LOW_VAR_KL_LOG_RATIO, LOW_VAR_KL_LOG_RATIO)
        return (torch.exp(d) - d - 1.0).clamp(max=LOW_VAR_KL_CLAMP)
    return k3_kl(logprobs, ref_logprobs) if k3 is None else k3


def loss_norm(
    loss_mask: torch.Tensor, trajectory_tokens: torch.Tensor, behaviour_logprobs: torch.Tensor | None = None
) -> LossNorm:
    """`LossNorm` from tensors holding the *whole* batch (a trajectory of n trained tokens
    adds n * 1/n = 1 to the trajectory count)."""
    mask = loss_mask.bool()
    ttok_N = trajectory_tokens[mask].double()
    known = int((~torch.isnan(behaviour_logprobs[mask])).sum()) if behaviour_logprobs is not None else 0
    return LossNorm(
        num_trajectories=round(float((1.0 / ttok_N).sum())) if ttok_N.numel() else 0,
        num_loss_tokens=int(mask.sum()),
        max_trajectory_tokens=int(ttok_N.max()) if ttok_N.numel() else 0,
        num_known_behaviour_tokens=known,
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
    behaviour_logprobs: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The `config.loss_type` loss of a batch, or of one chunk of it.

    All tensors share one shape. `old_logprobs` is pi_old (NaN: the detached current
    logprob stands in, ratio 1); `behaviour_logprobs` is mu, NaN where unknown (None: no
    importance correction). `norm` is the whole batch's; leave it None only when the
    tensors are the whole batch. With a chunk, the returned loss is that chunk's share:
    the shares sum to the batch loss, so call backward on each and the gradients add up.

    The KL to the reference (base) model (`config.kl_estimator`: k3 as TRL, or k2), times
    `beta`, is added to each token's loss before aggregation; `ref_logprobs` is needed only
    when beta > 0 (given with beta = 0, the KL is only reported). The reported kl is k3's
    whatever the estimator, so that runs compare on one scale. `weights`: each token's loss weight (None: 1).
    Metrics (detached floats, additive over chunks): loss, policy_loss (the loss without
    the KL), kl (mean per trained token), clip_fraction (trained tokens whose gradient
    clipping removed or, for cispo, whose weight was capped), ratio_mean, and with
    `behaviour_logprobs`: mismatch_logprob_abs (mean |log pi_old - log mu| over tokens with
    a known mu), tis_weight_mean, tis_capped_fraction and behaviour_unknown_fraction (shares
    of trained tokens).
    """
    spec = LOSSES[config.loss_type]  # LossConfig already checked the name
    if config.beta > 0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs (the base model's, adapter disabled)")
    if norm is None:
        norm = loss_norm(loss_mask, trajectory_tokens, behaviour_logprobs)
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
    metric_names = ["loss", "policy_loss", "kl", "clip_fraction", "ratio_mean"]
    if behaviour_logprobs is not None:
        metric_names += ["mismatch_logprob_abs", "tis_weight_mean", "tis_capped_fraction", "behaviour_unknown_fraction"]
    if logprobs_N.numel() == 0:
        # Nothing to train on in this chunk; keep the graph so backward() still works.
        zero = logprobs.sum() * 0.0
        return zero, {k: 0.0 for k in metric_names}

    tis = None
    if behaviour_logprobs is not None:
        tis = truncated_importance_weights(
            x.old_logprobs_N,
            behaviour_logprobs[mask].float(),
            x.segment_ids_N,
            config.tis_cap,
            sequence_level=config.loss_type == "gspo",
        )
    policy_N, ratio_N, clipped_N = spec.surrogate(x, config)
    if tis is not None:
        policy_N = policy_N * tis[0]
    loss_N = policy_N
    kl_N = None
    if ref_logprobs is not None:
        ref_N = ref_logprobs[mask].float()
        kl_N = k3_kl(logprobs_N, ref_N)
    if config.beta > 0 and kl_N is not None:  # beta > 0 without ref_logprobs raised above
        penalty_N = kl_penalty(config.kl_estimator, logprobs_N, ref_N, k3=kl_N)
        loss_N = policy_N + config.beta * penalty_N
    if weights is not None:
        weight_N = weights[mask].float()
        loss_N, policy_N = loss_N * weight_N, policy_N * weight_N
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
        if tis is not None and behaviour_logprobs is not None:  # tis is None without them
            weights_N, capped_N, known_N = tis
            gap_N = (x.old_logprobs_N - behaviour_logprobs[mask].float()).abs()
            metrics.update(
                mismatch_logprob_abs=float(torch.where(known_N, gap_N, 0.0).sum())
                / max(norm.num_known_behaviour_tokens, 1),
                tis_weight_mean=float(weights_N.sum() / per_token),
                tis_capped_fraction=float((capped_N & known_N).float().sum() / per_token),
                behaviour_unknown_fraction=float((~known_N).float().sum() / per_token),
            )
    return loss, metrics
