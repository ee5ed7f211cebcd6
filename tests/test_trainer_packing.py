"""Packing against a real tiny Qwen2 run sample by sample.

The reference for every packed quantity is each sample run *alone* through the model
(no mask, no position ids) with a plain full log_softmax written here, not the code's
own helpers.
"""

import math
import random
from collections import Counter

import pytest
import torch
import transformers

from trainer.losses import compute_loss
from trainer.packing import (
    attention_mask_4d,
    pack,
    padded_batch,
    padded_token_logprobs,
    token_logprobs,
)
from trainer.types import LOSS_TYPES, LossConfig, LossNorm, Sample

NAN = float("nan")
MAX_TOKENS_PER_ROW = 24
# (length, prompt length, trajectory): t0 and t3 have two samples each, of unequal lengths.
SHAPES = [
    (9, 3, "t0"),
    (5, 2, "t0"),
    (14, 4, "t1"),
    (7, 3, "t2"),
    (3, 1, "t3"),
    (11, 5, "t3"),
    (6, 2, "t4"),
    (20, 6, "t5"),
    (4, 2, "t6"),
]
ADVANTAGE = {"t0": 1.2, "t1": -0.7, "t2": 0.4, "t3": -1.1, "t4": 0.9, "t5": -0.3, "t6": 0.0}


TINY_SHAPE = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def tiny_qwen2(impl: str, seed: int = 0) -> transformers.Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(**TINY_SHAPE)
    config._attn_implementation = impl
    model = transformers.Qwen2ForCausalLM(config).float()
    assert model.config._attn_implementation == impl
    return model.eval()  # no dropout; gradients still flow


def alone_logprobs(model, token_ids) -> torch.Tensor:
    """Reference: one sample, no packing; entry t = log p(token t | tokens < t), 0 at t=0."""
    ids = torch.tensor(token_ids)[None]
    logp_TV = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    picked = logp_TV[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(1), picked])


def make_samples(model) -> list[Sample]:
    rng = random.Random(0)
    samples = []
    for n, prompt, traj in SHAPES:
        ids = [rng.randrange(97) for _ in range(n)]
        with torch.no_grad():
            lp = alone_logprobs(model, ids).tolist()
        # Old logprobs drift from the current ones (some past the clip range); t2 was
        # recorded without logprobs.
        old = [NAN if t < prompt or traj == "t2" else lp[t] + rng.gauss(0.0, 0.3) for t in range(n)]
        samples.append(
            Sample(
                token_ids=tuple(ids),
                loss_mask=tuple(t >= prompt for t in range(n)),
                old_logprobs=tuple(old),
                advantage=ADVANTAGE[traj],
                trajectory_id=traj,
                group_id="g",
            )
        )
    return samples


IMPLS = ["sdpa", "eager"]


@pytest.fixture(scope="module", params=IMPLS)
def setup(request):
    model = tiny_qwen2(request.param, seed=0)
    ref_model = tiny_qwen2(request.param, seed=1)  # stands in for the base model
    for p in ref_model.parameters():
        p.requires_grad_(False)
    return model, ref_model, make_samples(model)


# --- pure packing ---------------------------------------------------------------------


def sample(n, traj="t"):
    return Sample(tuple(range(n)), (False,) + (True,) * (n - 1), (NAN,) * n, 1.0, traj, "g")


def test_first_fit_decreasing_known_answer():
    rows = pack([sample(n) for n in (6, 5, 4, 3, 2)], max_tokens_per_row=10)
    # Longest first: 6 -> row 0; 5 -> row 1; 4 -> row 0 (full); 3, 2 -> row 1.
    assert [r.sample_indices for r in rows] == [(0, 2), (1, 3, 4)]
    assert rows[1].position_ids_T.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1]
    assert rows[1].segment_ids_T.tolist() == [1] * 5 + [3] * 3 + [4] * 2


def test_too_long_sample_is_an_error_naming_the_flag():
    with pytest.raises(ValueError, match="--max-tokens-per-row"):
        pack([sample(3), sample(11)], max_tokens_per_row=10)


def test_every_token_once_and_rows_within_the_limit():
    rng = random.Random(1)
    samples = [sample(rng.randint(2, 30), traj=f"t{i % 7}") for i in range(60)]
    rows = pack(samples, max_tokens_per_row=32)
    assert all(r.input_ids_T.numel() <= 32 for r in rows)
    seen = Counter()
    for r in rows:
        for i in r.sample_indices:
            sel = r.segment_ids_T == i
            assert r.input_ids_T[sel].tolist() == list(samples[i].token_ids)
            assert r.position_ids_T[sel].tolist() == list(range(len(samples[i].token_ids)))
            assert r.loss_mask_T[sel].tolist() == list(samples[i].loss_mask)
            seen[i] += 1
        assert sum(len(samples[i].token_ids) for i in r.sample_indices) == r.input_ids_T.numel()
    assert seen == Counter(range(60))
    # Trajectory weights count the whole batch's tokens, across rows.
    per_traj = Counter()
    for s in samples:
        per_traj[s.trajectory_id] += s.num_loss_tokens
    for r in rows:
        for i in r.sample_indices:
            got = r.trajectory_tokens_T[r.segment_ids_T == i]
            assert (got == per_traj[samples[i].trajectory_id]).all()


def test_attention_mask_is_causal_and_block_diagonal():
    mask = attention_mask_4d(torch.tensor([0, 0, 1, 1, 1, -1]))
    assert mask.shape == (1, 1, 6, 6) and mask.dtype == torch.float32
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],  # padding sees only itself
    ]
    assert mask[0, 0, 0, 1].item() == torch.finfo(torch.float32).min


# --- against the model ----------------------------------------------------------------


def test_logprobs_at_each_calls_temperature_equal_a_direct_computation(setup):
    # pi_old is the policy that sampled: a packed row whose samples (and calls within a
    # sample) were sampled at different temperatures gives, for each token, the log-softmax
    # of the logits divided by that token's temperature, computed here sample by sample.
    model, _, samples = setup
    tempered = []
    for k, s in enumerate(samples):
        n = len(s.token_ids)
        # two "calls" per sample: the first half of the completion at one temperature, the rest at another
        temps = tuple(1.0 if t == 0 else (0.5 + 0.1 * k if t < n // 2 else 1.3) for t in range(n))
        tempered.append(
            Sample(
                s.token_ids, s.loss_mask, s.old_logprobs, s.advantage, s.trajectory_id, s.group_id, temperatures=temps
            )
        )
    with torch.no_grad():
        for row in pack(tempered, MAX_TOKENS_PER_ROW):
            lp_T = token_logprobs(model, row)
            for i in row.sample_indices:
                ids = torch.tensor(tempered[i].token_ids)
                logits_TV = model(input_ids=ids[None]).logits[0].double()
                want = [0.0] + [
                    float(torch.log_softmax(logits_TV[t - 1] / tempered[i].temperatures[t], dim=-1)[ids[t]])
                    for t in range(1, len(ids))
                ]
                torch.testing.assert_close(
                    lp_T[row.segment_ids_T == i].double(), torch.tensor(want, dtype=torch.float64), atol=1e-5, rtol=0
                )
        padded = padded_batch(tempered)
        lp_BT = padded_token_logprobs(model, padded)
        row = pack(tempered, MAX_TOKENS_PER_ROW)[0]
        for i in row.sample_indices:
            n = len(tempered[i].token_ids)
            torch.testing.assert_close(
                lp_BT[i, :n], token_logprobs(model, row)[row.segment_ids_T == i], atol=1e-5, rtol=0
            )


def test_packed_logprobs_equal_each_sample_alone(setup):
    model, _, samples = setup
    rows = pack(samples, MAX_TOKENS_PER_ROW)
    assert len(rows) < len(samples)  # something was actually packed together
    with torch.no_grad():
        for row in rows:
            lp_T = token_logprobs(model, row)
            for i in row.sample_indices:
                alone = alone_logprobs(model, samples[i].token_ids)
                torch.testing.assert_close(lp_T[row.segment_ids_T == i], alone, atol=1e-5, rtol=0)
        padded = padded_batch(samples)
        lp_BT = padded_token_logprobs(model, padded)
        for b, s in enumerate(samples):
            n = len(s.token_ids)
            want = alone_logprobs(model, s.token_ids)
            torch.testing.assert_close(lp_BT[b, :n], want, atol=1e-5, rtol=0)


def _unpacked(model, ref_model, samples):
    """Reference: each sample alone through the model, concatenated into one chunk."""
    traj_tokens = Counter()
    for s in samples:
        traj_tokens[s.trajectory_id] += s.num_loss_tokens
    cols = {
        k: []
        for k in (
            "logprobs",
            "ref_logprobs",
            "old_logprobs",
            "advantages",
            "loss_mask",
            "segment_ids",
            "trajectory_tokens",
        )
    }
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        cols["logprobs"].append(alone_logprobs(model, s.token_ids))
        with torch.no_grad():
            cols["ref_logprobs"].append(alone_logprobs(ref_model, s.token_ids))
        cols["old_logprobs"].append(torch.tensor(s.old_logprobs))
        cols["advantages"].append(torch.full((n,), s.advantage))
        cols["loss_mask"].append(torch.tensor(s.loss_mask))
        cols["segment_ids"].append(torch.full((n,), i))
        cols["trajectory_tokens"].append(torch.full((n,), float(traj_tokens[s.trajectory_id])))
    # norm=None: the loss derives it from the chunk, which is the whole batch here.
    return [dict({k: torch.cat(v) for k, v in cols.items()}, norm=None)]


def _packed(model, ref_model, samples):
    """One chunk per packed row, normalised by the whole batch."""
    norm = LossNorm.from_samples(samples)
    chunks = []
    for row in pack(samples, MAX_TOKENS_PER_ROW):
        with torch.no_grad():
            ref_T = token_logprobs(ref_model, row)
        chunks.append(
            dict(
                logprobs=token_logprobs(model, row),
                ref_logprobs=ref_T,
                old_logprobs=row.old_logprobs_T,
                advantages=row.advantages_T,
                loss_mask=row.loss_mask_T,
                segment_ids=row.segment_ids_T,
                trajectory_tokens=row.trajectory_tokens_T,
                norm=norm,
            )
        )
    return chunks


def _padded(model, ref_model, samples):
    batch = padded_batch(samples)
    with torch.no_grad():
        ref_BT = padded_token_logprobs(ref_model, batch)
    return [
        dict(
            logprobs=padded_token_logprobs(model, batch),
            ref_logprobs=ref_BT,
            old_logprobs=batch.old_logprobs_BT,
            advantages=batch.advantages_BT,
            loss_mask=batch.loss_mask_BT,
            segment_ids=batch.segment_ids_BT,
            trajectory_tokens=batch.trajectory_tokens_BT,
            norm=None,
        )
    ]


@pytest.fixture(scope="module")
def forwards(setup):
    """The three layouts' forward graphs, built once and reused by every loss config
    (gradients are taken with retain_graph)."""
    model, ref_model, samples = setup
    return model, {f.__name__: f(model, ref_model, samples) for f in (_unpacked, _packed, _padded)}


def loss_and_grads(model, chunks, cfg):
    """Sum of the chunks' losses (what per-row backward() calls accumulate), its
    gradient for every parameter, and the summed metrics."""
    total, metrics = 0.0, Counter()
    for chunk in chunks:
        loss, m = compute_loss(config=cfg, **chunk)
        total = total + loss
        metrics.update(m)
    params = [p for p in model.parameters()]
    grads = torch.autograd.grad(total, params, retain_graph=True)
    names = [n for n, _ in model.named_parameters()]
    return total.item(), dict(metrics), dict(zip(names, grads, strict=False))


CONFIGS = [LossConfig(t, epsilon=0.2, max_tokens_norm=16 if t == "dr_grpo" else None) for t in LOSS_TYPES] + [
    LossConfig("grpo", epsilon=0.2, epsilon_high=0.28, beta=0.1),
    LossConfig("gspo", epsilon=3e-3, epsilon_high=4e-3, beta=0.05),
    LossConfig("dr_grpo", epsilon=0.2, max_tokens_norm=32),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.loss_type}-beta{c.beta}")
def test_packed_loss_and_gradients_equal_unpacked(forwards, cfg):
    model, chunks = forwards
    want_loss, want_metrics, want_grads = loss_and_grads(model, chunks["_unpacked"], cfg)
    assert math.isfinite(want_loss) and want_loss != 0.0
    assert any(g.abs().max() > 1e-4 for g in want_grads.values())
    assert len(chunks["_packed"]) > 1
    for layout in ("_packed", "_padded"):
        loss, metrics, grads = loss_and_grads(model, chunks[layout], cfg)
        assert loss == pytest.approx(want_loss, abs=1e-5)
        assert metrics == pytest.approx(want_metrics, abs=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(g, want_grads[name], atol=1e-5, rtol=0, msg=name)


def _windowed(kind: str, impl: str) -> transformers.PreTrainedModel:
    """A tiny model whose attention looks back 4 tokens: every layer (Mistral), or the second
    of two (Qwen2 with `use_sliding_window`: one mask per layer type)."""
    torch.manual_seed(0)
    if kind == "mistral":
        config = transformers.MistralConfig(**TINY_SHAPE, sliding_window=4)
        model_class = transformers.MistralForCausalLM
    else:
        config = transformers.Qwen2Config(**TINY_SHAPE, sliding_window=4, use_sliding_window=True, max_window_layers=1)
        assert config.layer_types == ["full_attention", "sliding_attention"]
        model_class = transformers.Qwen2ForCausalLM
    config._attn_implementation = impl
    return model_class(config).float().eval()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_packed_logprobs_keep_a_sliding_window(kind, impl):
    # A 4D mask is used as given: one without the window scored samples longer than it with
    # attention the sampler never had. The reference is each sample alone through transformers'
    # own mask (which applies the window).
    model = _windowed(kind, impl)
    rng = random.Random(0)
    samples = [
        Sample(
            tuple(rng.randrange(97) for _ in range(n)),
            tuple(t >= 2 for t in range(n)),
            (math.nan,) * n,
            1.0,
            f"t{n}",
            "g",
        )
        for n in (12, 9)
    ]
    (row,) = pack(samples, 32)
    with torch.no_grad():
        lp_T = token_logprobs(model, row)
        for i in row.sample_indices:
            alone = alone_logprobs(model, samples[i].token_ids)
            torch.testing.assert_close(lp_T[row.segment_ids_T == i], alone, atol=1e-5, rtol=0)


def test_the_base_models_dropout_is_off_so_a_score_is_the_policys(tmp_path):
    # GPT-2's config drops out 10 % in training: scored in train mode under a random mask, pi_old
    # and every ratio were noise. The reference: transformers' own model in eval mode (no dropout).
    from tests.helpers_trainer import tiny_gpt2, trainer_settings
    from trainer.backends.peft import PeftBackend

    model_dir = tiny_gpt2(tmp_path)
    backend = PeftBackend(trainer_settings(tmp_path / "state", base_model=str(model_dir)))
    row = pack([sample(12), sample(9, traj="u")], max_tokens_per_row=64)[0]
    first, second = backend.token_logprobs(row).detach(), backend.token_logprobs(row).detach()

    reference = transformers.GPT2LMHeadModel.from_pretrained(model_dir).eval()  # LoRA's B is 0 at step 0
    with torch.no_grad():
        for segment, n in ((0, 12), (1, 9)):
            ids = torch.arange(n)
            logits = reference(input_ids=ids[None]).logits[0, :-1]
            expected = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[1:, None]).squeeze(-1)
            at = (row.segment_ids_T == segment).nonzero().squeeze(-1)  # a row names its samples by batch index
            torch.testing.assert_close(first[at][1:], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(first, second)
