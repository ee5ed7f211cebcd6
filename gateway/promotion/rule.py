"""The canary's decision rule: pure functions over the rewards of the two steps' sessions.

The question is one-sided twice over, with a margin `margin` (`--canary-margin`) on the reward's
scale. Let d be the candidate's mean reward minus the incumbent's, and se its standard error:

- **promote** when the candidate is non-inferior: the lower confidence bound d - z * se >= -margin;
- **reject** when the incumbent is significantly better: the upper bound d + z * se < 0;
- else **wait** (`--canary-max-wait` rejects a candidate still undecided).

The test is Welch's normal approximation (unequal variances; rewards are bounded, so the
mean is close to normal from a few tens of sessions), looked at a fixed number of times
`LOOKS`: at `min_sessions`, 2 x `min_sessions`, ... candidate sessions. Each look spends
alpha / LOOKS of each test's error (Bonferroni over the looks), so testing as rewards arrive
does not inflate the error rate: the chance of a wrong promotion (the candidate worse than the
margin) or a wrong rejection (a candidate as good as its incumbent) is at most `ALPHA` each.

Task keys: rewards of different tasks are not comparable, so d is pooled over the task keys
where both steps have sessions, d = sum_k w_k d_k with w_k proportional to n_ck n_ik / (n_ck +
n_ik) (each key weighs as the precision its two sides give a difference), and se^2 = sum_k
w_k^2 (s_c^2 / n_ck + s_i^2 / n_ik), s_c and s_i each side's within-key standard deviation.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist

ALPHA = 0.05  # each of the two one-sided tests, over all looks
LOOKS = 5  # looks at min_sessions, 2 x, ..., 5 x min_sessions candidate sessions


def z_per_look(alpha: float = ALPHA, looks: int = LOOKS) -> float:
    """The one-sided critical value each look uses (alpha spent equally over the looks)."""
    return NormalDist().inv_cdf(1 - alpha / looks)


@dataclass(frozen=True)
class Comparison:
    """The numbers behind a decision (recorded on the step row)."""

    candidate_sessions: int
    incumbent_sessions: int
    candidate_mean: float | None  # None: no session (yet)
    incumbent_mean: float | None
    difference: float  # d, pooled over task keys
    std_error: float
    z_critical: float
    margin: float
    keys: int  # task keys compared
    look: int  # 1..LOOKS; 0: before the first look

    def as_dict(self) -> dict:
        return asdict(self)


def _var(xs: list[float], mean: float) -> float:
    return sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) if len(xs) > 1 else 0.0


def _within_key_var(by_key: dict[str, list[float]]) -> float:
    """The within-key variance, pooled over keys (a key's own mean taken out)."""
    ss = df = 0.0
    for xs in by_key.values():
        m = sum(xs) / len(xs)
        ss += sum((x - m) ** 2 for x in xs)
        df += len(xs) - 1
    return ss / df if df > 0 else 0.0


def compare(
    candidate: dict[str, list[float]], incumbent: dict[str, list[float]], margin: float, min_sessions: int
) -> Comparison:
    """Pool the task keys both sides have (rewards by task key) into one difference and its error."""
    keys = sorted(set(candidate) & set(incumbent))
    cand = {k: candidate[k] for k in keys if candidate[k]}
    inc = {k: incumbent[k] for k in keys if incumbent[k]}
    keys = sorted(set(cand) & set(inc))
    n_c = sum(len(cand[k]) for k in keys)
    n_i = sum(len(inc[k]) for k in keys)
    means = (
        sum(sum(cand[k]) for k in keys) / n_c if n_c else None,
        sum(sum(inc[k]) for k in keys) / n_i if n_i else None,
    )
    # Each key's rewards less one of them: equal rewards then differ by exactly 0. Unshifted, the
    # means of 6 and of 20 rewards of 0.9 differ by a rounding error (-1e-16) with a se of the
    # same size, and an equal candidate on a converged task was rejected as significantly worse.
    ref = {k: inc[k][0] for k in keys}
    cand, inc = ({k: [x - ref[k] for x in side[k]] for k in keys} for side in (cand, inc))
    var_c, var_i = _within_key_var(cand), _within_key_var(inc)
    weights = {k: len(cand[k]) * len(inc[k]) / (len(cand[k]) + len(inc[k])) for k in keys}
    total = sum(weights.values())
    d = se2 = 0.0
    for k in keys:
        w = weights[k] / total
        d += w * (sum(cand[k]) / len(cand[k]) - sum(inc[k]) / len(inc[k]))
        se2 += w * w * (var_c / len(cand[k]) + var_i / len(inc[k]))
    look = min(LOOKS, n_c // min_sessions) if min_sessions > 0 else LOOKS
    return Comparison(
        candidate_sessions=n_c,
        incumbent_sessions=n_i,
        candidate_mean=means[0],
        incumbent_mean=means[1],
        difference=d,
        std_error=math.sqrt(se2),
        z_critical=z_per_look(),
        margin=margin,
        keys=len(keys),
        look=look,
    )


def decide(c: Comparison) -> str:
    """The verdict at this look: "promote", "reject" or "wait"."""
    if c.look == 0 or c.incumbent_sessions < 2:
        return "wait"
    lower = c.difference - c.z_critical * c.std_error
    upper = c.difference + c.z_critical * c.std_error
    if upper < 0:
        return "reject"  # the incumbent is significantly better
    if lower >= -c.margin:  # at most `margin` worse: with margin 0, an exact tie (se = 0) is not a loss
        return "promote"  # non-inferior within the margin (a candidate equal to its incumbent is promoted)
    return "wait"


def power(margin: float, sigma: float, n_candidate: int, n_incumbent: int, z: float | None = None) -> float:
    """The chance the non-inferiority test promotes a candidate exactly as good as its incumbent
    (true d = 0), with reward standard deviation `sigma` on both sides: Phi(margin / se - z)."""
    se = sigma * math.sqrt(1 / n_candidate + 1 / n_incumbent)
    return NormalDist().cdf(margin / se - (z if z is not None else z_per_look()))
