"""How far any guard that holds a policy near its base can take SHOUT on smollm2.

A KL penalty to the base (`--beta`, `--reward-kl`) aims at the KL-regularised optimum
pi*(y) = pi_ref(y) exp(r(y)/beta) / Z: the base's own replies, reweighted by their reward. Other
divergences give other weights, but every such guard ends at the base reweighted by some
function of the reward. So the base's own samples say what any of them can reach:

- **exp tilt, beta**: pi* for each beta, estimated by self-normalised importance sampling from
  the base (ESS: the effective number of samples behind the row);
- **base, caps >= x**: what the base writes when it does write capitals (a hard threshold);
- **pass 1 seed**: how often 32 replies drawn from that policy (the demo's final val set) meet
  the aim, capitals, English and distinct words together: the chance that a run ending exactly
  there passes on one seed; **pass 3 seeds**, its cube, the issue's seeds 0-2;
- **best at caps 0.7**: the most English that any reweighting by a non-decreasing function of
  the reward reaches while its capitals share is 0.7, the issue's bar (every guard above is such
  a reweighting: none favours a reply for a lower reward);
- **base^A tilt, beta**: pi_ref^A exp(r/beta), the optimum of `--reward-kl` with
  `--reward-kl-sharpen A` (a KL to the base sharpened to pi_ref^A), with beta chosen so that its
  capitals share is 0.7, then 0.8. It also weighs each reply by the base's own likelihood (the
  log-probability of its sampled tokens, recorded as it is sampled), so the bound above does not
  hold for it.

Samples: smollm2 at temperature 1 with no top-k or top-p (as the demo samples), SHOUT's system
message and 8 prompts, `--max-tokens` (the task's 6) tokens, `--samples` per prompt; the template
is the one the demo renders with. Capitals = SHOUT's reward; English = the share of words (3+
letters) in Debian's wamerican list (`gateway.demo.words`, what the demo reports).

    python bench/shout_frontier.py                    # 512 samples per prompt (~6 min on 2 cores)
    python bench/shout_frontier.py --max-tokens 12
    python bench/shout_frontier.py --system "You are a loud agent. ..."   # another system message

Results: the table on stdout, JSON in bench/out/shout_frontier-{N}tok-seed{S}.json (with the
replies: a rerun with the same flags reads them instead of sampling again).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # bench/vllm.py would shadow vllm

from gateway.demo import shout  # noqa: E402
from gateway.demo.words import DICTIONARY, WORD, _load  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
AIM_CAPS, AIM_ENGLISH = 0.7, 0.6
VAL_REPLIES = 32  # the demo's final evaluation: 4 groups of 8
BETAS = (1.0, 0.5, 0.3, 0.25, 0.2, 0.17, 0.15, 0.1, 0.05)
SHARPENINGS = (1.0, 1.1, 1.2, 1.3, 1.5)  # alpha in pi_ref^alpha exp(r/beta), at capitals 0.7 and 0.8


def sample_base(samples: int, max_tokens: int, system: str, seed: int) -> tuple[list[str], list[float]]:
    """`samples` replies to each SHOUT prompt from the base model, full distribution at T=1, and
    each reply's log-probability under the base (its sampled tokens', up to and with the end of
    turn: the log pi_ref(y) a KL penalty weighs)."""
    import torch
    from transformers import AutoModelForCausalLM

    from gateway.models.registry import resolve_base_model
    from gateway.models.templates import load_tokenizer
    from gateway.settings import SMOLLM2_MODEL_ID

    model_dir = resolve_base_model(SMOLLM2_MODEL_ID, ROOT / "bench" / "out")
    tokenizer = load_tokenizer(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": p}] for p in shout.PROMPTS]
    prompts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    per_batch = 8
    batch = tokenizer(prompts * per_batch, return_tensors="pt", padding=True)
    replies: list[str] = []
    logprobs: list[float] = []
    for round_ in range(math.ceil(samples / per_batch)):
        torch.manual_seed(seed * 100_000 + round_)
        with torch.no_grad():
            out = model.generate(
                **batch,
                max_new_tokens=max_tokens,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=tokenizer.pad_token_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens = out.sequences[:, batch["input_ids"].shape[1] :]
        replies += tokenizer.batch_decode(tokens, skip_special_tokens=True)
        token_logprobs = torch.stack(out.logits, dim=1).float().log_softmax(-1).gather(-1, tokens[..., None])[..., 0]
        ended = (tokens == tokenizer.eos_token_id).long().cumsum(-1)
        # a reply's tokens are those before its end of turn, and the end of turn itself
        in_reply = (ended == 0) | ((ended == 1) & (tokens == tokenizer.eos_token_id))
        logprobs += (token_logprobs * in_reply).sum(-1).tolist()
        print(f"\rsampled {len(replies)}/{samples * len(prompts)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return replies, logprobs


def reply_counts(replies: list[str], dictionary: frozenset[str]) -> list[tuple[float, int, int]]:
    """(capitals share, words, English words) of each reply."""
    counts = []
    for reply in replies:
        words = [w.lower() for w in WORD.findall(reply or "")]
        counts.append((shout.reward(reply), len(words), sum(w in dictionary for w in words)))
    return counts


def val_pass_rate(replies: list[str], counts, weights: list[float], dictionary, draws: int = 2000) -> float:
    """How often a val set of `VAL_REPLIES` replies drawn from the reweighted policy meets the
    aim (capitals, English, and at least half of the English words distinct), as the demo's
    final evaluation measures a run: the chance that a run which ends exactly at this policy
    passes on one seed."""
    rng = random.Random(0)
    passed = 0
    for _ in range(draws):
        picked = rng.choices(range(len(counts)), weights=weights, k=VAL_REPLIES)
        caps = sum(counts[i][0] for i in picked) / VAL_REPLIES
        words = sum(counts[i][1] for i in picked)
        found = [w for i in picked for w in (x.lower() for x in WORD.findall(replies[i] or "")) if w in dictionary]
        if words and caps >= AIM_CAPS and len(found) / words >= AIM_ENGLISH and len(set(found)) >= len(found) / 2:
            passed += 1
    return passed / draws


def weighted(counts: list[tuple[float, int, int]], weights: list[float]) -> dict:
    """Capitals and English share of the policy that reweights the samples by `weights`."""
    total = sum(weights)
    words = sum(w * c[1] for w, c in zip(weights, counts, strict=True))
    return {
        "caps": sum(w * c[0] for w, c in zip(weights, counts, strict=True)) / total,
        "english": sum(w * c[2] for w, c in zip(weights, counts, strict=True)) / words if words else None,
        "ess": total * total / sum(w * w for w in weights),
    }


def best_english_at(
    counts: list[tuple[float, int, int]], caps: float, step: float = 0.05, min_samples: int = 50
) -> dict:
    """The most English that any reweighting of the base by a non-decreasing function of the
    reward reaches at a capitals share of `caps`. Such a weighting is a mixture of the base
    conditioned on r >= t for thresholds t, so the optimum of this linear-fractional program
    is one threshold's policy or a mix of two that averages exactly `caps` (thresholds every
    `step`, each kept with `min_samples` or more)."""
    parts = []  # (threshold, mean caps, mean words, mean English words, samples)
    for i in range(int(1 / step) + 1):
        kept = [c for c in counts if c[0] >= i * step - 1e-9]
        if len(kept) >= min_samples:
            n = len(kept)
            parts.append(
                (
                    round(i * step, 2),
                    sum(c[0] for c in kept) / n,
                    sum(c[1] for c in kept) / n,
                    sum(c[2] for c in kept) / n,
                    n,
                )
            )
    best: dict = {"english": None, "thresholds": None}
    for i, a in enumerate(parts):
        for b in parts[i:]:
            lo, hi = sorted((a, b), key=lambda part: part[1])
            if hi[1] < caps:
                continue
            # mass p on hi and 1 - p on lo so that the mix's capitals share is `caps`
            p = 1.0 if lo[1] >= caps or hi[1] == lo[1] else (caps - lo[1]) / (hi[1] - lo[1])
            words = p * hi[2] + (1 - p) * lo[2]
            if words and (best["english"] is None or (p * hi[3] + (1 - p) * lo[3]) / words > best["english"]):
                best = {
                    "english": (p * hi[3] + (1 - p) * lo[3]) / words,
                    "thresholds": [lo[0], hi[0]],
                    "mass_on_higher": p,
                }
    return best


def mix_weights(counts, thresholds: list[float], mass_on_higher: float) -> list[float]:
    """The weights of `best_english_at`'s policy: the base given r >= the lower threshold, with
    `mass_on_higher` moved to the base given r >= the higher one."""
    low, high = ([c[0] >= t - 1e-9 for c in counts] for t in thresholds)
    n_low, n_high = sum(low), sum(high)
    return [
        (1 - mass_on_higher) * lo / n_low + mass_on_higher * hi / n_high + 1e-15
        for lo, hi in zip(low, high, strict=True)
    ]


def sharpened_tilt(counts, logprobs: list[float], alpha: float, beta: float) -> list[float]:
    """Weights on the base's samples for pi(y) ~ pi_ref(y)^alpha exp(r(y)/beta): the optimum of
    reward - beta KL(pi || pi_ref) + (alpha - 1) beta E[log pi_ref] (a bonus for replies the
    base finds likely, or equally an entropy penalty). Unlike the guards above it reweights by
    the base's likelihood as well as the reward, so the bound on them does not hold for it."""
    logs = [(alpha - 1) * lp + c[0] / beta for c, lp in zip(counts, logprobs, strict=True)]
    top = max(logs)
    return [math.exp(x - top) + 1e-300 for x in logs]


def beta_at_caps(counts, logprobs: list[float], alpha: float, caps: float) -> float | None:
    """The beta at which `sharpened_tilt(alpha, beta)` has capitals share `caps` (bisection on
    log beta: the share falls as beta grows); None where no beta in [0.01, 10] reaches it."""
    lo, hi = math.log(0.01), math.log(10.0)
    if weighted(counts, sharpened_tilt(counts, logprobs, alpha, math.exp(lo)))["caps"] < caps:
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        if weighted(counts, sharpened_tilt(counts, logprobs, alpha, math.exp(mid)))["caps"] >= caps:
            lo = mid
        else:
            hi = mid
    return math.exp(lo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=512, help="replies per prompt (8 prompts)")
    parser.add_argument("--max-tokens", type=int, default=shout.OPTIONS["max_tokens"])
    parser.add_argument("--system", default=shout.SYSTEM, help="the system message (default: SHOUT's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resample", action="store_true", help="sample again though bench/out holds these replies")
    args = parser.parse_args()
    dictionary = _load(DICTIONARY)
    if dictionary is None:
        sys.exit(f"no word list at {DICTIONARY}: apt-get install wamerican")
    out = ROOT / "bench" / "out" / f"shout_frontier-{args.max_tokens}tok-seed{args.seed}.json"
    setup = {"max_tokens": args.max_tokens, "system": args.system, "samples": args.samples, "seed": args.seed}
    earlier = json.loads(out.read_text()) if out.is_file() else {}
    if not args.resample and earlier.get("setup") == setup and "logprobs" in earlier:
        replies, logprobs = earlier["replies"], earlier["logprobs"]
    else:
        import torch

        torch.set_num_threads(2)
        replies, logprobs = sample_base(args.samples, args.max_tokens, args.system, args.seed)
    counts = reply_counts(replies, dictionary)
    policies = {"base": [1.0] * len(counts)}
    for beta in BETAS:
        policies[f"exp tilt, beta {beta}"] = [math.exp((c[0] - 1) / beta) for c in counts]
    for caps in (AIM_CAPS, 0.8):
        for alpha in SHARPENINGS:
            beta = beta_at_caps(counts, logprobs, alpha, caps)
            if beta is not None:
                policies[f"base^{alpha:g} tilt, beta {beta:.3f}"] = sharpened_tilt(counts, logprobs, alpha, beta)
    for threshold in (0.5, 0.6, 0.7):
        policies[f"base, caps >= {threshold}"] = [1.0 if c[0] >= threshold else 1e-12 for c in counts]
    best = best_english_at(counts, AIM_CAPS)
    if best["thresholds"] is not None:
        policies["best mix at caps 0.7"] = mix_weights(counts, best["thresholds"], best["mass_on_higher"])
    rows = [
        {"policy": name, **weighted(counts, weights), "val_pass": val_pass_rate(replies, counts, weights, dictionary)}
        for name, weights in policies.items()
    ]
    print(
        f"\n{len(replies)} base replies of {args.max_tokens} tokens; "
        f"the aim: caps >= {AIM_CAPS}, English >= {AIM_ENGLISH}\n"
    )
    print(f"{'policy':>24} {'caps':>6} {'english':>8} {'ESS':>7} {'pass 1 seed':>12} {'pass 3 seeds':>13}")
    for row in rows:
        english = "-" if row["english"] is None else f"{row['english']:.2f}"
        print(
            f"{row['policy']:>24} {row['caps']:6.2f} {english:>8} {row['ess']:7.0f}"
            f" {row['val_pass']:12.2f} {row['val_pass'] ** 3:13.3f}"
        )
    english = "none" if best["english"] is None else f"{best['english']:.2f}"
    likeliest = max(rows, key=lambda row: row["val_pass"])
    print(
        f"\nbest English at caps {AIM_CAPS} over every reweighting non-decreasing in reward: {english} "
        f"(thresholds {best['thresholds']}); the likeliest policy above to pass, {likeliest['policy']!r}, "
        f"passes one seed's val with probability {likeliest['val_pass']:.2f}, "
        f"three seeds {likeliest['val_pass'] ** 3:.3f}"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"setup": setup, "rows": rows, "best_at_aim": best, "replies": replies, "logprobs": logprobs}, indent=1
        )
    )


if __name__ == "__main__":
    main()
