"""Every loss type against values and gradients worked out by hand with plain math.

The example batch, laid out as one packed row of 8 tokens:

    sample 0 (trajectory t0, A = +1):   prompt | a   b   f
    sample 1 (trajectory t1, A = -0.5): prompt | c   d   e

with eps = 0.2 (clip range [0.8, 1.2]) and ratios chosen at the edges:
    a r=1.19 inside           b r=1.21 above, A>0: clipped, no gradient
    f r=0.50 below, A>0: the unclipped term is the min, gradient flows
    c r=0.81 inside           d r=0.79 below, A<0: clipped, no gradient
    e r=1.50 above, A<0: the unclipped term is the min, gradient flows
"""

import math

import pytest
import torch

from trainer.losses import LOSSES, compute_loss, k3_kl, kl_penalty
from trainer.types import LOSS_TYPES, LossConfig, LossNorm

NAN = float("nan")
LOGP = {"a": -1.0, "b": -0.5, "f": -2.0, "c": -0.3, "d": -1.2, "e": -0.7}
RATIO = {"a": 1.19, "b": 1.21, "f": 0.5, "c": 0.81, "d": 0.79, "e": 1.5}
ADV = {"a": 1.0, "b": 1.0, "f": 1.0, "c": -0.5, "d": -0.5, "e": -0.5}
ORDER = ["P", "a", "b", "f", "P", "c", "d", "e"]  # P: prompt token


def batch(ratio=RATIO, old_nan=(), ref=None):
    """The example as flat tensors; old logprob = logp - log(r) so that exp(logp - old) = r."""
    logp = [0.0 if k == "P" else LOGP[k] for k in ORDER]
    old = [NAN if k == "P" or k in old_nan else LOGP[k] - math.log(ratio[k]) for k in ORDER]
    t = dict(
        logprobs=torch.tensor(logp, requires_grad=True),
        old_logprobs=torch.tensor(old),
        advantages=torch.tensor([1.0] * 4 + [-0.5] * 4),
        loss_mask=torch.tensor([k != "P" for k in ORDER]),
        segment_ids=torch.tensor([0] * 4 + [1] * 4),
        trajectory_tokens=torch.tensor([3.0] * 8),
    )
    if ref is not None:
        t["ref_logprobs"] = torch.tensor([0.0 if k == "P" else ref[k] for k in ORDER])
    return t


def run(cfg, **kw):
    t = batch(**kw)
    loss, metrics = compute_loss(config=cfg, **t)
    loss.backward()
    grad = t["logprobs"].grad.tolist()
    return loss.item(), {k: grad[i] for i, k in enumerate(ORDER) if k != "P"}, grad, metrics


def ppo_token(r, A, lo, hi):
    """-min(rA, clip(r)A) and its derivative in logp (dr/dlogp = r), by hand."""
    unclipped, clipped = r * A, min(max(r, lo), hi) * A
    return (-unclipped, -A * r) if unclipped <= clipped else (-clipped, 0.0)


def test_registry_is_the_documented_table():
    assert tuple(LOSSES) == LOSS_TYPES
    with pytest.raises(ValueError, match="unknown loss_type"):
        LossConfig(loss_type="ppo")


def test_grpo_hand_example():
    loss, grad, full_grad, m = run(LossConfig("grpo", epsilon=0.2))
    # Per-token losses -min(rA, clip(r)A):
    #   a: -1.19   b: -min(1.21, 1.2) = -1.2   f: -min(0.5, 0.8) = -0.5
    #   c: -min(-0.405, -0.405) = 0.405   d: -min(-0.395, -0.4) = 0.4   e: -min(-0.75, -0.6) = 0.75
    # Mean per trajectory, then over the 2 trajectories.
    expected = ((-1.19 - 1.2 - 0.5) / 3 + (0.405 + 0.4 + 0.75) / 3) / 2
    assert loss == pytest.approx(expected, abs=1e-6)
    # d/dlogp = -A r * 1/(3 tokens * 2 trajectories) where unclipped, 0 where clipped.
    w = 1 / 6
    assert grad == pytest.approx(
        {"a": -1.19 * w, "b": 0.0, "f": -0.5 * w, "c": 0.5 * 0.81 * w, "d": 0.0, "e": 0.5 * 1.5 * w},
        abs=1e-6,
    )
    assert full_grad[0] == 0.0 and full_grad[4] == 0.0  # prompt tokens
    assert m["clip_fraction"] == pytest.approx(2 / 6)  # b and d
    assert m["ratio_mean"] == pytest.approx(sum(RATIO.values()) / 6, abs=1e-6)
    assert m["policy_loss"] == pytest.approx(expected, abs=1e-6)
    assert m["kl"] == 0.0


def test_ppo_token_helper_matches_written_out_edges():
    # The independent helper used below, checked on the edges spelled out in the docstring.
    assert ppo_token(1.19, 1.0, 0.8, 1.2) == pytest.approx((-1.19, -1.19))
    assert ppo_token(1.21, 1.0, 0.8, 1.2) == pytest.approx((-1.2, 0.0))
    assert ppo_token(0.79, -0.5, 0.8, 1.2) == pytest.approx((0.4, 0.0))
    assert ppo_token(1.5, -0.5, 0.8, 1.2) == pytest.approx((0.75, 0.75))


def test_epsilon_high_is_asymmetric():
    # clip range [0.8, 1.28]: b (1.21, A>0) is now inside; d (0.79, A<0) is still clipped.
    loss, grad, _, m = run(LossConfig("grpo", epsilon=0.2, epsilon_high=0.28))
    expected = ((-1.19 - 1.21 - 0.5) / 3 + (0.405 + 0.4 + 0.75) / 3) / 2
    assert loss == pytest.approx(expected, abs=1e-6)
    assert grad["b"] == pytest.approx(-1.21 / 6, abs=1e-6)
    assert grad["d"] == 0.0
    assert m["clip_fraction"] == pytest.approx(1 / 6)


def test_dr_grpo_sums_over_a_constant():
    total = -1.19 - 1.2 - 0.5 + 0.405 + 0.4 + 0.75
    # A fixed budget (TRL: max_completion_length), never the batch's longest trajectory.
    with pytest.raises(ValueError, match="max_tokens_norm"):
        run(LossConfig("dr_grpo", epsilon=0.2))
    loss, grad, _, _ = run(LossConfig("dr_grpo", epsilon=0.2, max_tokens_norm=10))
    assert loss == pytest.approx(total / (10 * 2), abs=1e-6)
    assert grad["a"] == pytest.approx(-1.19 / 20, abs=1e-6)
    assert grad["e"] == pytest.approx(0.5 * 1.5 / 20, abs=1e-6)


def test_dapo_token_mean_over_the_batch():
    # Clip-higher [0.8, 1.28] plus one mean over all 6 trained tokens.
    loss, grad, _, _ = run(LossConfig("dapo", epsilon=0.2, epsilon_high=0.28))
    assert loss == pytest.approx((-1.19 - 1.21 - 0.5 + 0.405 + 0.4 + 0.75) / 6, abs=1e-6)
    assert grad["b"] == pytest.approx(-1.21 / 6, abs=1e-6)


def test_trajectories_weigh_equally_under_grpo_but_by_length_under_dapo():
    # Unequal lengths: sample 0 keeps only token a (trajectory of 1 token).
    t = batch()
    t["loss_mask"] = torch.tensor([False, True, False, False, False, True, True, True])
    t["trajectory_tokens"] = torch.tensor([1.0] * 4 + [3.0] * 4)
    grpo, _ = compute_loss(config=LossConfig("grpo"), **t)
    dapo, _ = compute_loss(config=LossConfig("dapo"), **t)
    assert grpo.item() == pytest.approx((-1.19 + (0.405 + 0.4 + 0.75) / 3) / 2, abs=1e-6)
    assert dapo.item() == pytest.approx((-1.19 + 0.405 + 0.4 + 0.75) / 4, abs=1e-6)


def gspo_reference(ratio, lo, hi):
    """GSPO's sequence objective by hand: s_i = (prod_t r_t)^(1/|y_i|), loss_i =
    -min(s A, clip(s) A), mean over the 2 sequences. d loss / d logp_t = -A s / |y| / 2
    when the sequence is not clipped, else 0."""
    out_loss, out_grad = 0.0, {}
    for keys, A in ((("a", "b", "f"), 1.0), (("c", "d", "e"), -0.5)):
        s = math.prod(ratio[k] for k in keys) ** (1 / len(keys))
        value, dvalue_dlogs = ppo_token(s, A, lo, hi)  # d/dlog s of -min(...) = -A s
        out_loss += value / 2
        for k in keys:
            out_grad[k] = dvalue_dlogs / len(keys) / 2
    return out_loss, out_grad


def test_gspo_sequence_ratio():
    loss, grad, _, m = run(LossConfig("gspo", epsilon=0.2))
    ref_loss, ref_grad = gspo_reference(RATIO, 0.8, 1.2)
    # s0 = (1.19 * 1.21 * 0.5)^(1/3) = 0.89626..., s1 = (0.81 * 0.79 * 1.5)^(1/3) = 0.98643...
    assert ref_loss == pytest.approx((-0.8962602 + 0.5 * 0.9864334) / 2, abs=1e-6)
    assert loss == pytest.approx(ref_loss, abs=1e-6)
    assert grad == pytest.approx(ref_grad, abs=1e-6)
    assert m["clip_fraction"] == 0.0


def test_gspo_clips_whole_sequences_with_small_epsilons():
    # The paper's 3e-4 / 4e-4: sample 0 drifts to s = 1.001 (A>0, above 1.0004: clipped,
    # no gradient anywhere in it); sample 1 to s = 0.9999 (inside [0.9997, 1.0004]).
    ratio = {"a": 1.002, "b": 1.0, "f": 1.001**3 / 1.002, "c": 0.9999, "d": 0.9999, "e": 0.9999}
    cfg = LossConfig("gspo", epsilon=3e-4, epsilon_high=4e-4)
    loss, grad, _, m = run(cfg, ratio=ratio)
    ref_loss, ref_grad = gspo_reference(ratio, 1 - 3e-4, 1 + 4e-4)
    assert ref_grad["a"] == 0.0 and ref_grad["c"] != 0.0
    assert loss == pytest.approx(ref_loss, abs=1e-6)
    assert grad == pytest.approx(ref_grad, abs=1e-6)
    assert m["clip_fraction"] == pytest.approx(3 / 6)


def test_cispo_detached_clipped_weight():
    loss, grad, _, m = run(LossConfig("cispo", epsilon=0.2, epsilon_high=1.2))
    # Weight min(r, epsilon_high) (TRL: the cap is epsilon_high itself), no lower clip:
    # a 1.19, b 1.2, f 0.5, c 0.81, d 0.79, e 1.2.
    w = {"a": 1.19, "b": 1.2, "f": 0.5, "c": 0.81, "d": 0.79, "e": 1.2}
    # Token loss -w A logp; mean per trajectory then over 2.
    per = {k: -w[k] * ADV[k] * LOGP[k] for k in w}
    expected = ((per["a"] + per["b"] + per["f"]) / 3 + (per["c"] + per["d"] + per["e"]) / 3) / 2
    assert loss == pytest.approx(expected, abs=1e-6)
    # REINFORCE gradient -w A / 6 on every token, clipped ones included.
    assert grad == pytest.approx({k: -w[k] * ADV[k] / 6 for k in w}, abs=1e-6)
    assert m["clip_fraction"] == pytest.approx(2 / 6)  # b and e capped


def test_k3_kl_value_and_beta():
    # k3 = exp(ref - logp) - (ref - logp) - 1. logp -1.0, ref -1.5: exp(-0.5) + 0.5 - 1.
    assert k3_kl(torch.tensor(-1.0), torch.tensor(-1.5)).item() == pytest.approx(math.exp(-0.5) - 0.5, abs=1e-7)
    assert math.exp(-0.5) - 0.5 == pytest.approx(0.1065306597, abs=1e-9)
    ref = {"a": -1.5, "b": -0.5, "f": -1.0, "c": -0.3, "d": -1.0, "e": -0.9}
    kl = {k: math.exp(ref[k] - LOGP[k]) - (ref[k] - LOGP[k]) - 1 for k in ref}
    beta = 0.1
    loss, grad, _, m = run(LossConfig("grpo", epsilon=0.2, beta=beta), ref=ref)
    policy = ((-1.19 - 1.2 - 0.5) / 3 + (0.405 + 0.4 + 0.75) / 3) / 2
    kl_term = ((kl["a"] + kl["b"] + kl["f"]) / 3 + (kl["c"] + kl["d"] + kl["e"]) / 3) / 2
    assert loss == pytest.approx(policy + beta * kl_term, abs=1e-6)
    assert m["policy_loss"] == pytest.approx(policy, abs=1e-6)
    assert m["kl"] == pytest.approx(sum(kl.values()) / 6, abs=1e-6)
    # d k3 / d logp = 1 - exp(ref - logp); b's policy gradient is 0 (clipped), so its
    # gradient is the KL's alone.
    assert grad["b"] == pytest.approx(beta * (1 - math.exp(ref["b"] - LOGP["b"])) / 6, abs=1e-7)
    assert grad["a"] == pytest.approx((-1.19 + beta * (1 - math.exp(-0.5))) / 6, abs=1e-6)


def test_k2_penalty_hand_example():
    # k2 = 0.5 (logp - ref)^2, d/dlogp = logp - ref; the reported kl stays k3's.
    ref = {"a": -1.5, "b": -0.5, "f": -1.0, "c": -0.3, "d": -1.0, "e": -0.9}
    k2 = {k: 0.5 * (LOGP[k] - ref[k]) ** 2 for k in ref}
    k3 = {k: math.exp(ref[k] - LOGP[k]) - (ref[k] - LOGP[k]) - 1 for k in ref}
    beta = 0.1
    loss, grad, _, m = run(LossConfig("grpo", epsilon=0.2, beta=beta, kl_estimator="k2"), ref=ref)
    policy = ((-1.19 - 1.2 - 0.5) / 3 + (0.405 + 0.4 + 0.75) / 3) / 2
    kl_term = ((k2["a"] + k2["b"] + k2["f"]) / 3 + (k2["c"] + k2["d"] + k2["e"]) / 3) / 2
    assert loss == pytest.approx(policy + beta * kl_term, abs=1e-6)
    assert m["kl"] == pytest.approx(sum(k3.values()) / 6, abs=1e-6)
    assert grad["a"] == pytest.approx((-1.19 + beta * (-1.0 + 1.5)) / 6, abs=1e-6)
    # f: policy ratio 0.5 < 1 - eps with A > 0, so PPO's min keeps the unclipped -rA term
    assert grad["f"] == pytest.approx((-0.5 + beta * (-2.0 + 1.0)) / 6, abs=1e-6)
    with pytest.raises(ValueError, match="kl_estimator"):
        LossConfig("grpo", beta=0.1, kl_estimator="k1")


@pytest.mark.parametrize(("estimator", "direction"), [("k2", "reverse"), ("k3", "forward")])
def test_kl_penalty_expected_gradient_is_a_kl_gradient(estimator, direction):
    # On tokens drawn from pi, the penalty's expected gradient is sum_x pi(x) grad k(x) (pi
    # held fixed as the sampling weight). Reference: autograd on the closed-form KL of two
    # categoricals, KL(pi || ref) for k2 (Schulman 2020; Tang & Munos 2025) and KL(ref || pi)
    # for k3.
    torch.manual_seed(0)
    logits = torch.randn(7, requires_grad=True)
    log_ref = torch.log_softmax(torch.randn(7), -1)
    log_pi = torch.log_softmax(logits, -1)
    expected = (log_pi.exp().detach() * kl_penalty(estimator, log_pi, log_ref)).sum()
    (via_penalty,) = torch.autograd.grad(expected, logits, retain_graph=True)
    pi, ref = log_pi.exp(), log_ref.exp()
    closed_form = (pi * (log_pi - log_ref)).sum() if direction == "reverse" else (ref * (log_ref - log_pi)).sum()
    (via_kl,) = torch.autograd.grad(closed_form, logits, retain_graph=True)
    assert torch.allclose(via_penalty, via_kl, atol=1e-6)
    other = "k3" if estimator == "k2" else "k2"
    (via_other,) = torch.autograd.grad((pi.detach() * kl_penalty(other, log_pi, log_ref)).sum(), logits)
    assert not torch.allclose(via_other, via_kl, atol=1e-3)  # the two estimators differ here


def test_low_var_kl_is_k3_clamped_at_ten():
    # A token like the json collapse's: pi 0.004, pi_ref 0.92 (pi_ref / pi = 230). k3 = 230 - ln 230 - 1
    # = 223.56 with gradient 1 - 230 = -229 in log pi; clamped at 10 (verl's low_var_kl), no pull.
    # A token within the clamp keeps k3's value and gradient: pi 0.5, pi_ref 0.8.
    logp = torch.tensor([math.log(0.004), math.log(0.5)], requires_grad=True)
    ref = torch.tensor([math.log(0.92), math.log(0.8)])
    k3 = kl_penalty("k3", logp, ref)
    assert k3[0].item() == pytest.approx(230 - math.log(230) - 1, rel=1e-5)
    (k3_grad,) = torch.autograd.grad(k3.sum(), logp)
    assert k3_grad[0].item() == pytest.approx(1 - 230, rel=1e-5)
    low = kl_penalty("low_var_kl", logp, ref)
    assert low[0].item() == 10.0
    assert low[1].item() == pytest.approx(1.6 - math.log(1.6) - 1, abs=1e-6)
    (low_grad,) = torch.autograd.grad(low.sum(), logp)
    assert low_grad.tolist() == pytest.approx([0.0, 1 - 1.6], abs=1e-6)


def test_low_var_kl_has_a_zero_not_a_nan_gradient_where_exp_would_overflow():
    # log(pi_ref / pi) = 100 nats: exp overflows float32 (from ~88.7), and the clamp's zero gradient
    # times an infinite exp was NaN, refusing the whole step. Bounded before exp (verl's +-20), it is
    # the clamp's 10 with no pull, as at 230 above; and a token far the other way (pi / pi_ref = e^100)
    # is clamped too: x - ln x - 1 for x = e^-20 is 19 > 10.
    logp = torch.tensor([-100.0, 0.0, math.log(0.5)], requires_grad=True)
    ref = torch.tensor([0.0, -100.0, math.log(0.8)])
    low = kl_penalty("low_var_kl", logp, ref)
    assert low.tolist() == pytest.approx([10.0, 10.0, 1.6 - math.log(1.6) - 1], abs=1e-6)
    (grad,) = torch.autograd.grad(low.sum(), logp)
    assert grad.tolist() == pytest.approx([0.0, 0.0, 1 - 1.6], abs=1e-6)


def test_beta_without_ref_logprobs_is_an_error():
    with pytest.raises(ValueError, match="ref_logprobs"):
        run(LossConfig("grpo", beta=0.1))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_unknown_old_logprobs_mean_ratio_one(loss_type):
    # Sample 1 recorded without logprobs: its ratios are 1 with REINFORCE gradient -A = 0.5,
    # over 6 for every loss here (3 tokens x 2 trajectories; dr_grpo: constant 3 x 2
    # trajectories; dapo: 6 tokens; gspo: s = 1, -A s / 3 / 2; cispo: weight 1, / 6).
    loss, grad, _, m = run(LossConfig(loss_type, epsilon=0.2, max_tokens_norm=3), old_nan=("c", "d", "e"))
    for k in "cde":
        assert grad[k] == pytest.approx(0.5 / 6, abs=1e-6)
    assert math.isfinite(loss)
    if loss_type == "grpo":
        # Sample 1: -min(1 * -0.5, ...) = 0.5 per token.
        assert loss == pytest.approx(((-1.19 - 1.2 - 0.5) / 3 + 0.5) / 2, abs=1e-6)
        assert m["ratio_mean"] == pytest.approx((1.19 + 1.21 + 0.5 + 3) / 6, abs=1e-6)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_padded_layout_and_chunks_give_the_same_loss(loss_type):
    cfg = LossConfig(loss_type, epsilon=0.2, beta=0.05, max_tokens_norm=3)
    ref = {k: v - 0.1 for k, v in LOGP.items()}
    flat = batch(ref=ref)
    whole, _ = compute_loss(config=cfg, **flat)

    # Padded [2, 5]: each sample in its own row, one pad at the end.
    def pad(v, fill):
        return torch.stack([torch.cat([v[:4], fill]), torch.cat([v[4:], fill])])

    def one(x):
        return torch.tensor([x])

    padded = dict(
        logprobs=pad(flat["logprobs"].detach(), one(0.0)),
        old_logprobs=pad(flat["old_logprobs"], one(NAN)),
        advantages=pad(flat["advantages"], one(0.0)),
        loss_mask=pad(flat["loss_mask"], torch.tensor([False])),
        segment_ids=pad(flat["segment_ids"], one(-1)),
        trajectory_tokens=pad(flat["trajectory_tokens"], one(0.0)),
        ref_logprobs=pad(flat["ref_logprobs"], one(0.0)),
    )
    padded_loss, _ = compute_loss(config=cfg, **padded)
    assert padded_loss.item() == pytest.approx(whole.item(), abs=1e-6)
    # Each sample as its own chunk, with the batch's norm: the shares sum to the whole.
    norm = LossNorm(num_trajectories=2, num_loss_tokens=6, max_trajectory_tokens=3)
    shares = [
        compute_loss(config=cfg, norm=norm, **{k: v[sl] for k, v in flat.items()})[0].item()
        for sl in (slice(0, 4), slice(4, 8))
    ]
    assert sum(shares) == pytest.approx(whole.item(), abs=1e-6)


def test_chunk_without_trained_tokens_is_zero_and_backpropagates():
    t = batch()
    t["loss_mask"] = torch.zeros(8, dtype=torch.bool)
    norm = LossNorm(num_trajectories=2, num_loss_tokens=6, max_trajectory_tokens=3)
    loss, m = compute_loss(config=LossConfig(), norm=norm, **t)
    loss.backward()
    assert loss.item() == 0.0 and m["loss"] == 0.0
    assert t["logprobs"].grad.abs().sum().item() == 0.0


def test_cispo_averages_over_every_token_of_the_batch():
    # MiniMax-M1 eq. 4 / TRL: one mean over all trained tokens, so a trajectory weighs in
    # proportion to its length. Trajectory t1 is cut to one token (c): 4 tokens in all.
    t = batch()
    t["loss_mask"] = torch.tensor([False, True, True, True, False, True, False, False])
    t["trajectory_tokens"] = torch.tensor([3.0] * 4 + [1.0] * 4)
    loss, _ = compute_loss(config=LossConfig("cispo", epsilon=0.2, epsilon_high=1.2), **t)
    w = {"a": 1.19, "b": 1.2, "f": 0.5, "c": 0.81}
    expected = sum(-w[k] * ADV[k] * LOGP[k] for k in w) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def tis_batch(behaviour):
    """The example with pi_old = logp (a first pass: ratio 1) and a behaviour logprob per token."""
    logp = [0.0 if k == "P" else LOGP[k] for k in ORDER]
    return dict(
        logprobs=torch.tensor(logp, requires_grad=True),
        old_logprobs=torch.tensor([NAN if k == "P" else LOGP[k] for k in ORDER]),
        behaviour_logprobs=torch.tensor([NAN if k == "P" else behaviour[k] for k in ORDER]),
        advantages=torch.tensor([1.0] * 4 + [-0.5] * 4),
        loss_mask=torch.tensor([k != "P" for k in ORDER]),
        segment_ids=torch.tensor([0] * 4 + [1] * 4),
        trajectory_tokens=torch.tensor([3.0] * 8),
    )


def test_truncated_importance_sampling_hand_example():
    # pi_old/mu per token: a e^0.5 = 1.6487; b e^1.0 = 2.718 -> capped at 2; f e^-0.5 = 0.6065;
    # c unknown mu -> 1; d e^0 = 1; e e^0.2 = 1.2214.
    behaviour = {
        "a": LOGP["a"] - 0.5,
        "b": LOGP["b"] - 1.0,
        "f": LOGP["f"] + 0.5,
        "c": NAN,
        "d": LOGP["d"],
        "e": LOGP["e"] - 0.2,
    }
    w = {"a": math.exp(0.5), "b": 2.0, "f": math.exp(-0.5), "c": 1.0, "d": 1.0, "e": math.exp(0.2)}
    t = tis_batch(behaviour)
    loss, m = compute_loss(config=LossConfig("grpo", epsilon=0.2, tis_cap=2.0), **t)
    loss.backward()
    # ratio 1 everywhere: token loss -A * w, mean per trajectory then over 2.
    expected = (-(w["a"] + w["b"] + w["f"]) / 3 + 0.5 * (w["c"] + w["d"] + w["e"]) / 3) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-5)
    grad = {k: t["logprobs"].grad[i].item() for i, k in enumerate(ORDER) if k != "P"}
    assert grad == pytest.approx({k: -ADV[k] * w[k] / 6 for k in w}, abs=1e-5)
    # Metrics: |log pi_old - log mu| over the 5 tokens with a known mu; shares over 6.
    assert m["mismatch_logprob_abs"] == pytest.approx((0.5 + 1.0 + 0.5 + 0.0 + 0.2) / 5, abs=1e-6)
    assert m["tis_capped_fraction"] == pytest.approx(1 / 6)
    assert m["behaviour_unknown_fraction"] == pytest.approx(1 / 6)
    assert m["tis_weight_mean"] == pytest.approx(sum(w.values()) / 6, abs=1e-5)
    # Cap 0 turns the correction off: the plain GRPO loss, metrics still reported.
    off, m_off = compute_loss(config=LossConfig("grpo", epsilon=0.2, tis_cap=0.0), **tis_batch(behaviour))
    assert off.item() == pytest.approx((-1.0 + 0.5) / 2, abs=1e-6)
    assert m_off["mismatch_logprob_abs"] == pytest.approx(m["mismatch_logprob_abs"])


def test_truncated_importance_weights_are_against_pi_old_on_a_later_pass():
    # A later pass (pi != pi_old: the grpo hand example's ratios) with mu != pi_old: the weight is
    # min(pi_old / mu, 2), fixed for the step, times the clipped surrogate at r = pi / pi_old.
    # A weight taken against the current pi (r * pi_old / mu) would give other numbers.
    delta = {"a": 0.5, "b": 1.0, "f": -0.5, "c": NAN, "d": 0.0, "e": 0.2}  # log(pi_old / mu)
    w = {k: 1.0 if math.isnan(v) else min(math.exp(v), 2.0) for k, v in delta.items()}
    t = batch()
    old = {k: LOGP[k] - math.log(RATIO[k]) for k in LOGP}
    t["behaviour_logprobs"] = torch.tensor([NAN if k == "P" else old[k] - delta[k] for k in ORDER])
    loss, _ = compute_loss(config=LossConfig("grpo", epsilon=0.2, tis_cap=2.0), **t)
    loss.backward()
    per_token = {k: ppo_token(RATIO[k], ADV[k], 0.8, 1.2) for k in LOGP}
    expected = sum(w[k] * per_token[k][0] for k in LOGP) / 3 / 2
    assert loss.item() == pytest.approx(expected, abs=1e-5)
    grad = {k: t["logprobs"].grad[i].item() for i, k in enumerate(ORDER) if k != "P"}
    assert grad == pytest.approx({k: w[k] * per_token[k][1] / 6 for k in LOGP}, abs=1e-5)


def test_gspo_takes_a_sequence_level_importance_weight():
    # Sample 0: log(pi_old/mu) = 0.3, 0.6, -0.3 -> mean 0.2, weight e^0.2 for all three tokens;
    # sample 1: 1.0, 1.5, 2.0 -> mean 1.5, e^1.5 = 4.48 capped at 2.
    behaviour = {
        "a": LOGP["a"] - 0.3,
        "b": LOGP["b"] - 0.6,
        "f": LOGP["f"] + 0.3,
        "c": LOGP["c"] - 1.0,
        "d": LOGP["d"] - 1.5,
        "e": LOGP["e"] - 2.0,
    }
    loss, m = compute_loss(
        config=LossConfig("gspo", epsilon=3e-4, epsilon_high=4e-4, tis_cap=2.0), **tis_batch(behaviour)
    )
    expected = (-1.0 * math.exp(0.2) + 0.5 * 2.0) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-5)
    assert m["tis_capped_fraction"] == pytest.approx(3 / 6)


def test_dual_clip_bounds_negative_advantages():
    # delta = 1.4: e (r = 1.5, A < 0) would cost -rA = 0.75; capped at 1.4 * 0.5 = 0.7, no gradient.
    loss, grad, _, m = run(LossConfig("grpo", epsilon=0.2, delta=1.4))
    expected = ((-1.19 - 1.2 - 0.5) / 3 + (0.405 + 0.4 + 0.7) / 3) / 2
    assert loss == pytest.approx(expected, abs=1e-6)
    assert grad["e"] == 0.0 and grad["c"] != 0.0
    assert m["clip_fraction"] == pytest.approx(3 / 6)  # b, d and e
    with pytest.raises(ValueError, match="delta"):
        LossConfig("grpo", epsilon=0.2, delta=1.1)
