"""The local engine's sampler: one token per row, and its behaviour logprob.

Sampling is per request (its own `torch.Generator` from `seed`), in vLLM's order
(vllm/v1/sample/sampler.py): repetition, frequency and presence penalties on the logits,
then temperature, then min_p, then top-k, then top-p, renormalised. The logprob recorded
for each sampled token is its *behaviour* logprob: log mu(token) under exactly that
processed distribution, the one the token was drawn from (what vLLM reports with
`--logprobs-mode processed_logprobs`). The trainer's importance weights divide by it, so
it must be the sampler's, not the raw model's. Greedy rows (temperature 0; `Sampling` takes
any temperature below 1e-5 as 0, as vLLM does) report the penalised distribution at
temperature 1, as vLLM does; the token record keeps no behaviour logprobs for them. Tokens that top-k/top-p/min_p
removed have probability 0: their logprob (in `top_logprobs`) is -inf, sent as -9999.0
like vLLM.

Pure functions over tensors; the worker thread calls `sample` once per step.
"""

from __future__ import annotations

from typing import Any

from gateway.engines.local.jobs import Row, Sampling

MASKED_LOGPROB = -9999.0
"""What a token that top-k/top-p/min_p removed reports as its logprob (vLLM's stand-in for -inf)."""


def sample(logits_BV, rows: list[Row], device: Any):
    """Sample one token per row. Returns tokens [B], their behaviour logprobs [B] and, if
    any row asked for them, the top (id, logprob) pairs of every row (same distribution)."""
    import torch

    logprobs_BV = processed_logprobs(
        logits_BV,
        [row.job.sampling for row in rows],
        [row.job.prompt_ids for row in rows],
        [row.ids for row in rows],
    )
    probs_BV = logprobs_BV.exp()
    # inverse-CDF sampling, vectorised; each job draws its uniforms from its own generator,
    # so what a seed samples does not depend on the rest of the batch
    uniform_B = torch.zeros(len(rows), device=device)
    members: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        members.setdefault(id(row.job), []).append(i)
    for group in members.values():
        job = rows[group[0]].job
        if job.sampling.temperature > 0:
            uniform_B[group] = torch.rand(len(group), generator=job.generator, device=device)
    cdf_BV = probs_BV.cumsum(dim=-1)
    tokens_B = torch.searchsorted(cdf_BV, (uniform_B * cdf_BV[:, -1])[:, None], right=True).squeeze(1)
    tokens_B = tokens_B.clamp(max=probs_BV.shape[1] - 1)
    greedy = [i for i, row in enumerate(rows) if row.job.sampling.temperature == 0]
    if greedy:
        tokens_B[greedy] = logprobs_BV[greedy].argmax(dim=-1)
    chosen_B = logprobs_BV.gather(1, tokens_B[:, None]).squeeze(1)
    top = None
    want_top = max(row.job.sampling.top_logprobs for row in rows)
    if want_top:
        values_BK, indices_BK = logprobs_BV.topk(want_top, dim=-1)
        values_BK = values_BK.clamp(min=MASKED_LOGPROB)  # JSON has no -inf; vLLM sends -9999.0
        top = [
            list(zip(ids, values, strict=True))
            for ids, values in zip(indices_BK.tolist(), values_BK.tolist(), strict=True)
        ]
    return tokens_B, chosen_B, top


def processed_logprobs(logits_BV, samplings: list[Sampling], prompts: list[list[int]], outputs: list[list[int]]):
    """log mu: the log-probabilities of the distribution each row samples from, [B, V] float32.

    vLLM's order: penalties on the logits (repetition over prompt and output tokens,
    frequency and presence over output tokens), temperature, min_p, top-k, top-p; the
    kept tokens renormalised, the removed ones -inf. Temperature 0 (greedy) is taken as 1
    here, as vLLM's processed logprobs do for greedy requests.
    """
    import torch

    B, V = logits_BV.shape
    scores_BV = logits_BV.float()
    penalised = [
        i
        for i, s in enumerate(samplings)
        if s.repetition_penalty != 1.0 or (outputs[i] and (s.presence_penalty or s.frequency_penalty))
    ]
    if penalised:
        scores_BV = scores_BV.clone()
        for i in penalised:
            s = samplings[i]
            if s.repetition_penalty != 1.0:
                seen_V = torch.zeros(V, dtype=torch.bool, device=scores_BV.device)
                seen = [t for t in (*prompts[i], *outputs[i]) if t < V]
                if seen:
                    seen_V[torch.tensor(seen, device=scores_BV.device)] = True
                row_V = scores_BV[i]
                scaled_V = torch.where(row_V > 0, row_V / s.repetition_penalty, row_V * s.repetition_penalty)
                scores_BV[i] = torch.where(seen_V, scaled_V, row_V)
            if outputs[i] and (s.presence_penalty or s.frequency_penalty):
                counts_V = torch.bincount(torch.tensor(outputs[i], device=scores_BV.device), minlength=V)[:V]
                counts_V = counts_V.to(scores_BV.dtype)
                scores_BV[i] -= s.frequency_penalty * counts_V + s.presence_penalty * (counts_V > 0)
    temperature_B = torch.tensor(
        [s.temperature if s.temperature > 0 else 1.0 for s in samplings], device=scores_BV.device
    )
    logprobs_BV = torch.log_softmax(scores_BV / temperature_B[:, None], dim=-1)
    keep_BV = None
    for i, s in enumerate(samplings):
        if s.min_p <= 0 and not 0 < s.top_k < V and s.top_p >= 1.0:
            continue
        if keep_BV is None:
            keep_BV = torch.ones_like(logprobs_BV, dtype=torch.bool)
        keep_BV[i] = _kept_tokens(logprobs_BV[i], s)
    if keep_BV is not None:
        logprobs_BV = torch.log_softmax(logprobs_BV.masked_fill(~keep_BV, float("-inf")), dim=-1)
    return logprobs_BV


def _kept_tokens(logprobs_V, s: Sampling):
    """The tokens min_p, then top-k, then top-p leave in (the best one always stays)."""
    import torch

    probs_V = logprobs_V.exp()
    keep_V = torch.ones_like(probs_V, dtype=torch.bool)
    if s.min_p > 0:
        keep_V &= probs_V >= s.min_p * probs_V.max()
    if 0 < s.top_k < probs_V.shape[0]:
        kth = probs_V.masked_fill(~keep_V, -1.0).topk(s.top_k).values[-1]
        keep_V &= probs_V >= kth
    if s.top_p < 1.0:
        kept_V = probs_V.masked_fill(~keep_V, 0.0)
        kept_V = kept_V / kept_V.sum()
        sorted_V, order_V = kept_V.sort(descending=True)
        before_V = sorted_V.cumsum(0) - sorted_V  # mass of the better tokens
        in_nucleus_V = torch.zeros_like(keep_V)
        in_nucleus_V[order_V] = before_V < s.top_p
        keep_V &= in_nucleus_V
    return keep_V
