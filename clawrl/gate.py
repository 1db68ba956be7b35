"""The promotion gate's decision: is a candidate policy not worse than the serving champion?

Both versions answer the same evaluation prompts with the same seeds; each prompt's score is the
mean over its samples. The gate looks at the per-prompt differences d_i = candidate_i - champion_i
(a paired comparison: the prompt-to-prompt spread, which is most of the variance, cancels):

    d̄ = mean(d_i),  s = stddev(d_i) (n - 1 in the denominator),  se = s / √n
    t = d̄ / se,  p = P(T_{n-1} <= t)          one-sided paired t-test of H0: δ >= 0 against δ < 0
    interval = d̄ ± t_{n-1, 1 - α/2} · se      two-sided (1 - α) interval of δ

The rule (conservative: every clause can only refuse):

1. no prompts -> refuse (no evidence is not evidence of "not worse");
2. d̄ < -tolerance -> refuse: worse than the champion by more than the tolerance;
3. p < α -> refuse: significantly worse than the champion, even within the tolerance;
4. with ``floor`` (the best mean any promoted version scored on these prompts and seeds):
   candidate mean < floor - tolerance -> refuse, so that promotions cannot drift down by one
   tolerance after another;
   with ``guards`` (groups of the prompts that must not get worse, ``[gate] guard``): on each, the
   candidate's group mean below the initial weights' by more than ``guard_tolerance`` -> refuse,
   whatever the other groups gained. The initial model is the fixed reference: a lucky champion does
   not raise the bar that later candidates must clear on a small group;
5. with ``min_gain`` set: d̄ <= min_gain -> refuse: not better than the champion by more than
   ``min_gain`` (0: any gain; a tie keeps the champion). Off (None), the gate promotes whatever is not
   worse; on, serving changes only for a measured gain, so versions that merely hold the champion's
   score cannot each move it a little lower on prompts the gate does not see;
6. else promote.

The only test made is the one for "worse": a reason's p is that test's ("one-sided p 0.987 for
'worse'": no sign of a drop), and a promotion under ``min_gain`` says "not worse, and ahead of the
champion by more than min_gain", the mean difference's lead, which the interval may well span.

With every difference equal (s = 0) the test is exact: p = 0 when d̄ < 0, else 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

PROMOTE = "promote"
REFUSE = "refuse"
NO_GAIN = "not better than the champion by more than min_gain"  # how a refusal for want of a gain begins


@dataclass(frozen=True)
class Guard:
    """One guarded group of evaluation prompts: the candidate's and the initial weights' mean over it."""

    group: str
    candidate: float
    base: float


def guard_refusal(guards: Sequence[Guard], tolerance: float) -> str | None:
    """Why the first guard a candidate fails refuses it, or None when it passes them all."""
    for g in guards:
        if g.candidate < g.base - tolerance:
            return (f"below the initial model on guarded group {g.group!r}: {g.candidate:.3f} vs {g.base:.3f} "
                    f"(guard_tolerance {tolerance:g})")
    return None


@dataclass(frozen=True)
class GateDecision:
    """The decision and its evidence; ``reason`` says it in words."""

    decision: str  # PROMOTE | REFUSE
    reason: str
    n: int  # prompts compared
    candidate_mean: float
    champion_mean: float
    mean_diff: float  # d̄ = candidate_mean - champion_mean
    ci_low: float  # (1 - alpha) interval of the mean difference
    ci_high: float
    p_value: float  # one-sided: the chance of a d̄ this low if the candidate were not worse
    tolerance: float
    alpha: float
    floor: float | None = None

    @property
    def promoted(self) -> bool:
        return self.decision == PROMOTE

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def paired_t(diffs: Sequence[float], alpha: float) -> tuple[float, float, float, float]:
    """(mean, p of H0 δ >= 0 vs δ < 0, interval low, interval high) of paired differences (n >= 1)."""
    from scipy import stats

    n = len(diffs)
    mean = math.fsum(diffs) / n
    sd = math.sqrt(math.fsum((d - mean) ** 2 for d in diffs) / (n - 1)) if n > 1 else 0.0
    if sd == 0.0:  # all differences equal: no spread, the sign decides
        return mean, (0.0 if mean < 0 else 1.0), mean, mean
    se = sd / math.sqrt(n)
    p = float(stats.t.cdf(mean / se, df=n - 1))
    half = float(stats.t.ppf(1 - alpha / 2, df=n - 1)) * se
    return mean, p, mean - half, mean + half


def decide_promotion(candidate: Sequence[float], champion: Sequence[float], *, tolerance: float, alpha: float,
                     floor: float | None = None, min_gain: float | None = None, guards: Sequence[Guard] = (),
                     guard_tolerance: float = 0.0) -> GateDecision:
    """The gate's decision on per-prompt scores (same prompts, same order, same seeds); the rule is
    in the module docstring. Raises ValueError on lists of different lengths or a bad setting."""
    if len(candidate) != len(champion):
        raise ValueError(f"candidate and champion scores must pair up: {len(candidate)} vs {len(champion)} prompts")
    if tolerance < 0 or guard_tolerance < 0 or not 0 < alpha < 1:
        raise ValueError(f"tolerance and guard_tolerance must be >= 0 and alpha in (0, 1), got {tolerance}, "
                         f"{guard_tolerance} and {alpha}")
    n = len(candidate)
    if n == 0:
        return GateDecision(REFUSE, "no evaluation prompts: nothing shows the candidate is not worse", 0,
                            math.nan, math.nan, math.nan, math.nan, math.nan, math.nan, tolerance, alpha, floor)
    cand, champ = math.fsum(candidate) / n, math.fsum(champion) / n
    mean, p, low, high = paired_t([a - b for a, b in zip(candidate, champion)], alpha)
    evidence = (f"candidate {cand:.3f} vs champion {champ:.3f} on {n} prompts, difference {mean:+.3f} "
                f"({1 - alpha:.0%} interval {low:+.3f} .. {high:+.3f}, one-sided p {p:.3g} for 'worse')")
    if mean < -tolerance:
        decision, why = REFUSE, f"worse by more than the tolerance {tolerance:g}"
    elif p < alpha:
        decision, why = REFUSE, f"significantly worse (p < alpha {alpha:g})"
    elif floor is not None and cand < floor - tolerance:
        decision, why = REFUSE, f"below the best promoted score {floor:.3f} by more than the tolerance {tolerance:g}"
    elif (guarded := guard_refusal(guards, guard_tolerance)) is not None:
        decision, why = REFUSE, guarded
    elif min_gain is not None and mean <= min_gain:
        decision, why = REFUSE, f"{NO_GAIN} {min_gain:g}"
    elif min_gain is not None:
        # the test made is "worse": the gain is the mean difference's, not shown significant
        decision, why = PROMOTE, f"not worse, and ahead of the champion by more than min_gain {min_gain:g}"
    else:
        decision, why = PROMOTE, f"not worse beyond the tolerance {tolerance:g}"
    return GateDecision(decision, f"{why}: {evidence}", n, cand, champ, mean, low, high, p, tolerance, alpha, floor)


@dataclass(frozen=True)
class LiveCheck:
    """The live check's verdict on the champion against the previous champion, and its evidence."""

    rollback: bool
    reason: str
    n_champion: int
    n_previous: int
    champion_mean: float
    previous_mean: float
    mean_diff: float  # champion_mean - previous_mean
    ci_low: float  # (1 - alpha) Welch interval of the difference
    ci_high: float
    p_value: float  # one-sided: the chance of a drop this large if the champion were not worse

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decide_live_rollback(champion: Sequence[float], previous: Sequence[float], *, tolerance: float, alpha: float,
                         min_n: int) -> LiveCheck:
    """Roll back when the champion's judged live scores are below the previous champion's by more than
    ``tolerance`` AND significantly so: Welch's one-sided t-test (unpaired: live turns differ from
    version to version), p < ``alpha``. Both need ``min_n`` scores, else nothing is decided.

        d = m_c - m_p,  se² = v_c/n_c + v_p/n_p,  df = se⁴ / ((v_c/n_c)²/(n_c-1) + (v_p/n_p)²/(n_p-1))
    """
    from scipy import stats

    n_c, n_p = len(champion), len(previous)
    if n_c < min_n or n_p < min_n:
        nan = math.nan
        return LiveCheck(False, f"not enough judged live turns to compare ({n_c} and {n_p}; {min_n} needed each)",
                         n_c, n_p, nan, nan, nan, nan, nan, nan)
    m_c, m_p = math.fsum(champion) / n_c, math.fsum(previous) / n_p
    a = math.fsum((x - m_c) ** 2 for x in champion) / (n_c - 1) / n_c  # v_c / n_c
    b = math.fsum((x - m_p) ** 2 for x in previous) / (n_p - 1) / n_p
    d, se = m_c - m_p, math.sqrt(a + b)
    if se == 0.0:
        p, low, high = (0.0 if d < 0 else 1.0), d, d
    else:
        df = se**4 / (a * a / (n_c - 1) + b * b / (n_p - 1))
        p = float(stats.t.cdf(d / se, df))
        half = float(stats.t.ppf(1 - alpha / 2, df)) * se
        low, high = d - half, d + half
    evidence = (f"live judged score {m_c:+.3f} (n={n_c}) vs {m_p:+.3f} (n={n_p}) on the previous champion, "
                f"difference {d:+.3f} ({1 - alpha:.0%} interval {low:+.3f} .. {high:+.3f}, one-sided p {p:.3g} for "
                "'dropped')")
    rollback = d < -tolerance and p < alpha
    why = (f"dropped by more than {tolerance:g}, significantly (p < {alpha:g})" if rollback
           else "no significant drop beyond the tolerance")
    return LiveCheck(rollback, f"{why}: {evidence}", n_c, n_p, m_c, m_p, d, low, high, p)
