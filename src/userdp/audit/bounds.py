"""Empirical lower bounds on epsilon from a membership game (no model code here).

Two bounds, both at a stated confidence:

* :func:`one_run_bound` — Steinke, Nasr & Jagielski (2023), "Privacy auditing with one (1) training
  run": m canaries are each included independently with probability 1/2; after training, the
  auditor guesses "in" for the k+ highest scores and "out" for the k- lowest and abstains on the
  rest. If the mechanism is (eps, delta)-DP with respect to each canary, the number of correct
  guesses among the r = k+ + k- made is stochastically dominated by Binomial(r, e^eps/(1+e^eps)),
  up to a delta term (their Theorem 5.2). The lower bound is the largest eps that this tail rejects.
  Every (k+, k-) the auditor tries costs a share of the error probability (a union bound), so the
  guess counts are a fixed grid chosen before the scores are seen.
* :func:`clopper_pearson_bound` — the classic bound from a threshold's true- and false-positive
  rates with Clopper–Pearson intervals: valid for independent trials (canaries of separate
  training runs); within one run the trials share a model and the bound is a diagnostic only.

:func:`roc_auc` and :func:`tpr_at_fpr` summarize a membership score for reports.

References: Steinke, Nasr, Jagielski, NeurIPS 2023 (arXiv:2305.08846), Algorithm 1 and Thm 5.2;
Jagielski, Ullman, Oprea 2020 (the Clopper–Pearson audit); Kandpal et al. 2023 (user inference).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import stats

from userdp.errors import UserError

# The guesses tried, fixed before any score is seen: (f+, f-) = fractions of the canaries guessed
# "in" among the highest scores and "out" among the lowest. The union bound divides the error
# probability by their number, so the grid is short. Under (eps, delta) the delta term of the
# bound grows with the number of canaries m, not with the guesses: at delta ~ 1/N few guesses
# prove nothing, so both entries guess many (half the canaries, then all of them).
GUESS_GRID = ((0.25, 0.25), (0.5, 0.5))


def _accuracy(eps: float) -> float:
    """Accuracy of eps-DP randomized response, e^eps / (1 + e^eps)."""
    return 1.0 / (1.0 + math.exp(-eps))


def p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """Probability of at least ``v`` correct guesses out of ``r`` under (eps, delta)-DP.

    Steinke et al. (2023), Theorem 5.2 (their code, Figure 6): with q = e^eps/(1+e^eps) and
    B ~ Binomial(r, q),  P[W >= v] <= P[B >= v] + 2 m delta max_{1<=i<=v} P[v-i <= B < v] / i.

    Args:
        m: canaries in the game (each included with probability 1/2, guessed or not).
        r: guesses made (0 <= r <= m).
        v: correct guesses (0 <= v <= r).
        eps, delta: the null hypothesis, (eps, delta)-DP with respect to each canary.

    Returns:
        The p-value, in [0, 1].

    Raises:
        UserError: counts or parameters out of range.
    """
    if not (0 <= v <= r <= m):
        raise UserError(f"one-run audit: need 0 <= correct ({v}) <= guesses ({r}) <= canaries ({m})")
    if eps < 0 or not (0 <= delta <= 1):
        raise UserError(f"one-run audit: need eps >= 0 and 0 <= delta <= 1 (got {eps}, {delta})")
    q = _accuracy(eps)
    tail = float(stats.binom.sf(v - 1, r, q))  # P[B >= v]
    alpha = 0.0
    if v > 0 and delta > 0:
        below = stats.binom.pmf(np.arange(v - 1, -1, -1), r, q)  # P[B = v-1], P[B = v-2], ...
        alpha = float(np.max(np.cumsum(below) / np.arange(1, v + 1)))
    return min(1.0, tail + 2.0 * m * delta * alpha)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, beta: float, eps_max: float = 50.0) -> float:
    """The largest eps that ``v`` correct of ``r`` guesses rejects at level ``beta`` (0 if none).

    p_value is non-decreasing in eps, so bisection finds the boundary; the result is within
    1e-6 below it (the conservative side).
    """
    if not (0 < beta < 1):
        raise UserError(f"one-run audit: the error probability must be in (0, 1), got {beta}")
    if r == 0 or p_value(m, r, v, 0.0, delta) > beta:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) <= beta:
        lo, hi = hi, 2 * hi
        if hi > eps_max:
            return eps_max
    while hi - lo > 1e-6:
        mid = 0.5 * (lo + hi)
        if p_value(m, r, v, mid, delta) <= beta:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(frozen=True)
class Guess:
    """One way of guessing: ``k_plus`` "in" guesses on the highest scores, ``k_minus`` "out" on
    the lowest; ``correct`` of the ``k_plus + k_minus`` were right."""

    k_plus: int
    k_minus: int
    correct: int
    epsilon: float  # the bound this guess alone gives at the union-bound level


@dataclass(frozen=True)
class OneRunBound:
    """The one-run audit's result (see :func:`one_run_bound`)."""

    epsilon_lower_bound: float
    confidence: float
    delta: float
    canaries: int
    included: int
    guesses: int
    correct: int
    k_plus: int
    k_minus: int
    tried: list = field(default_factory=list)  # every Guess, for the record


def guess_grid(m: int, grid: Sequence[tuple[float, float]] = GUESS_GRID) -> list[tuple[int, int]]:
    """The fixed (k+, k-) pairs tried for ``m`` canaries (duplicates removed, order kept)."""
    out = []
    for fp, fm in grid:
        kp = max(1, min(m, math.ceil(fp * m)))
        km = min(m - kp, math.ceil(fm * m))
        if (kp, km) not in out:
            out.append((kp, km))
    return out


def largest_bound(
    m: int, *, delta: float, confidence: float = 0.95, grid: Sequence[tuple[float, float]] = GUESS_GRID
) -> float:
    """The audit's power: the largest bound :func:`one_run_bound` could report with ``m``
    canaries — every guess of the best grid point correct. An audited ε of 0 then reads as "this
    design could have shown at most this much", not as evidence that the accounting is tight."""
    pairs = guess_grid(m, grid)
    beta = (1.0 - confidence) / len(pairs)
    return max(epsilon_lower_bound(m, kp + km, kp + km, delta, beta) for kp, km in pairs)


def one_run_bound(
    scores: Sequence[float],
    included: Sequence[bool],
    *,
    delta: float,
    confidence: float = 0.95,
    grid: Sequence[tuple[float, float]] = GUESS_GRID,
) -> OneRunBound:
    """Steinke et al.'s one-run epsilon lower bound from canary scores (higher = "more likely in").

    Args:
        scores: one membership score per canary.
        included: whether each canary was in the training data (drawn independently with p = 1/2
            before training; the guarantee of the bound rests on that draw).
        delta: the delta of the (eps, delta) claim being tested.
        confidence: 1 - beta; the bound holds with at least this probability over the inclusion
            draw and the training randomness.
        grid: the (in, out) guess fractions tried; fixed in advance.

    Returns:
        :class:`OneRunBound`: the largest bound over the grid, each guess tested at
        beta / len(grid) (a union bound, so the maximum is valid at ``confidence``).

    Raises:
        UserError: mismatched lengths, fewer than 2 canaries, non-finite scores, bad confidence.
    """
    s = np.asarray(scores, dtype=np.float64)
    inc = np.asarray(included, dtype=bool)
    if s.shape != inc.shape or s.ndim != 1:
        raise UserError(f"one-run audit: {s.size} scores but {inc.size} inclusion flags")
    m = int(s.size)
    if m < 2:
        raise UserError(f"one-run audit: needs at least 2 canaries, got {m}")
    if not np.isfinite(s).all():
        raise UserError(f"one-run audit: {int((~np.isfinite(s)).sum())} canary scores are not finite")
    if not (0 < confidence < 1):
        raise UserError(f"audit confidence must be in (0, 1), got {confidence}")
    pairs = guess_grid(m, grid)
    beta = (1.0 - confidence) / len(pairs)
    # ties broken at random-free but label-blind: stable sort on the score, then by index
    order = np.argsort(-s, kind="stable")
    ranked = inc[order]
    tried = []
    for kp, km in pairs:
        v = int(ranked[:kp].sum()) + (int((~ranked[m - km :]).sum()) if km else 0)
        eps = epsilon_lower_bound(m, kp + km, v, delta, beta)
        tried.append(Guess(kp, km, v, eps))
    best = max(tried, key=lambda g: (g.epsilon, g.correct))
    return OneRunBound(
        best.epsilon,
        confidence,
        delta,
        m,
        int(inc.sum()),
        best.k_plus + best.k_minus,
        best.correct,
        best.k_plus,
        best.k_minus,
        tried,
    )


def clopper_pearson(k: int, n: int, confidence: float) -> tuple[float, float]:
    """Two-sided Clopper–Pearson interval for a binomial proportion k/n."""
    if n <= 0:
        return 0.0, 1.0
    a = 1.0 - confidence
    lo = 0.0 if k == 0 else float(stats.beta.ppf(a / 2, k, n - k + 1))
    hi = 1.0 if k == n else float(stats.beta.ppf(1 - a / 2, k + 1, n - k))
    return lo, hi


def clopper_pearson_bound(
    scores: Sequence[float],
    included: Sequence[bool],
    *,
    delta: float,
    confidence: float = 0.95,
    threshold: float | None = None,
) -> dict:
    """The classic audit: guess "in" above ``threshold`` (default: the median score); with
    Clopper–Pearson intervals on TPR and FPR (each at 1 - (1-confidence)/2, so both hold
    jointly), eps >= max(log((TPR_lo - delta)/FPR_hi), log((TNR_lo - delta)/FNR_hi)).

    Valid when the (score, membership) trials are independent — canaries of separate runs.

    Returns:
        dict with ``epsilon_lower_bound``, ``threshold``, the rates and their intervals.
    """
    s = np.asarray(scores, dtype=np.float64)
    inc = np.asarray(included, dtype=bool)
    if s.shape != inc.shape:
        raise UserError(f"Clopper-Pearson audit: {s.size} scores but {inc.size} inclusion flags")
    t = float(np.median(s)) if threshold is None else float(threshold)
    guess = s > t
    tp, fn = int((guess & inc).sum()), int((~guess & inc).sum())
    fp, tn = int((guess & ~inc).sum()), int((~guess & ~inc).sum())
    c = 1.0 - (1.0 - confidence) / 2
    tpr_lo, _ = clopper_pearson(tp, tp + fn, c)
    _, fpr_hi = clopper_pearson(fp, fp + tn, c)
    tnr_lo, _ = clopper_pearson(tn, fp + tn, c)
    _, fnr_hi = clopper_pearson(fn, tp + fn, c)

    def ratio(num, den):
        return math.log(num / den) if num > 0 and den > 0 else 0.0

    eps = max(0.0, ratio(tpr_lo - delta, fpr_hi), ratio(tnr_lo - delta, fnr_hi))
    return {
        "epsilon_lower_bound": eps,
        "confidence": confidence,
        "threshold": t,
        "tp": tp,
        "fn": fn,
        "fp": fp,
        "tn": tn,
        "tpr_lower": tpr_lo,
        "fpr_upper": fpr_hi,
    }


def roc_auc(scores_pos: Sequence[float], scores_neg: Sequence[float]) -> float:
    """Area under the ROC curve of ``scores_pos`` (members) against ``scores_neg`` (Mann–Whitney,
    ties counted one half); nan when either side is empty."""
    p = np.asarray(scores_pos, dtype=np.float64)
    n = np.asarray(scores_neg, dtype=np.float64)
    if p.size == 0 or n.size == 0:
        return float("nan")
    ranks = stats.rankdata(np.concatenate([p, n]))
    return float((ranks[: p.size].sum() - p.size * (p.size + 1) / 2) / (p.size * n.size))


def tpr_at_fpr(scores_pos: Sequence[float], scores_neg: Sequence[float], fpr: float = 0.01) -> float:
    """True-positive rate at the threshold that flags at most ``fpr`` of the negatives."""
    p = np.asarray(scores_pos, dtype=np.float64)
    n = np.sort(np.asarray(scores_neg, dtype=np.float64))
    if p.size == 0 or n.size == 0:
        return float("nan")
    allowed = math.floor(fpr * n.size)  # negatives that may score above the threshold
    t = n[n.size - allowed - 1]
    return float((p > t).mean())
