"""Calibration: the smallest noise multiplier whose T-step composition meets (epsilon, delta),
never below the truth."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from dp_accounting import dp_event as dpe
from scipy import stats
from scipy.special import logsumexp

from userdp.accounting.accountants import get_accountant
from userdp.accounting.events import check_delta, check_target_epsilon, compose_after
from userdp.accounting.pld import PLD_INTERVAL
from userdp.errors import UserError
from userdp.validation import check_callable, check_int

#: Largest noise multiplier calibration will consider.
SIGMA_MAX = 1e4


@dataclass(frozen=True)
class Calibration:
    """How :func:`calibrate_noise_multiplier` searches: the accountant (``"pld"`` or ``"rdp"``),
    the relative width ``rtol`` at which it stops, the largest noise multiplier it considers, PLD's
    value discretization ``interval`` and RDP's ``orders`` (None: the accountant's own)."""

    accountant: str = "pld"
    rtol: float = 0.004
    sigma_max: float = SIGMA_MAX
    interval: float = 1e-3
    orders: Sequence[float] | None = None


def _gdp_delta(eps: float, mu: float) -> float:
    """δ(ε) of μ-GDP (Dong, Roth, Su): Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)."""
    return float(stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2))


def _step_mixture(ev: dpe.DpEvent) -> tuple[np.ndarray, np.ndarray, float] | None:
    """(sensitivities, probabilities, σ) of a Poisson-Gaussian / MoG / WOR-Gaussian step."""
    if isinstance(ev, dpe.MixtureOfGaussiansDpEvent):
        return (np.asarray(ev.sensitivities, float), np.asarray(ev.sampling_probs, float), float(ev.standard_deviation))
    if isinstance(ev, dpe.PoissonSampledDpEvent) and isinstance(ev.event, dpe.GaussianDpEvent):
        q = float(ev.sampling_probability)
        return np.array([0.0, 1.0]), np.array([1 - q, q]), float(ev.event.noise_multiplier)
    if isinstance(ev, dpe.SampledWithoutReplacementDpEvent) and isinstance(ev.event, dpe.GaussianDpEvent):
        q = ev.sample_size / ev.source_dataset_size  # replace-one: sensitivity 2
        return np.array([0.0, 2.0]), np.array([1 - q, q]), float(ev.event.noise_multiplier)
    if isinstance(ev, dpe.GaussianDpEvent):
        return np.array([1.0]), np.array([1.0]), float(ev.noise_multiplier)
    return None


def _initial_guess(make_step_event: Callable[[float], dpe.DpEvent], steps: int, eps: float, dlt: float) -> float | None:
    """A cheap estimate of the answer from the central limit theorem of composition.

    T steps of a mixture P = Σ w_k N(s_k, σ²) against Q = N(0, σ²) are close to μ-GDP with
    μ² = T·χ²(P‖Q), χ² = Σ_{k,k'} w_k w_k' e^{s_k s_k'/σ²} − 1. Only used to place the
    search (microseconds); never trusted for the answer.
    """
    try:
        mix = _step_mixture(make_step_event(1.0))
    except UserError:
        return None
    if mix is None:
        return None
    sens, w, sigma1 = mix
    keep = w > 0
    sens, log_w = sens[keep], np.log(w[keep])
    outer = np.add.outer(log_w, log_w)
    prod = np.outer(sens, sens)

    def chi2(s: float) -> float:
        with np.errstate(over="ignore"):  # inf at tiny sigma is the right answer for the search
            return float(np.expm1(logsumexp(outer + prod / s**2)))

    lo, hi = 1e-3, 1e3  # μ bracket
    if _gdp_delta(eps, hi) < dlt:
        return None
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if _gdp_delta(eps, mid) > dlt:
            hi = mid
        else:
            lo = mid
    target_chi2 = lo**2 / steps
    lo_s, hi_s = 1e-2, SIGMA_MAX
    if chi2(hi_s) > target_chi2:
        return None
    for _ in range(60):
        mid = math.sqrt(lo_s * hi_s)
        if chi2(mid) > target_chi2:
            lo_s = mid
        else:
            hi_s = mid
    return hi_s / sigma1  # the factory maps z to an event std of z * sigma1


def calibrate_noise_multiplier(
    make_step_event: Callable[[float], dpe.DpEvent],
    steps: int,
    epsilon: float,
    delta: float,
    how: Calibration | str = "pld",
    *,
    prior: Sequence[dpe.DpEvent] = (),
) -> float:
    """Smallest noise multiplier whose T-step composition is (ε, δ)-DP, never below the truth.

    ``how``: the accountant's name, or a :class:`Calibration` (accountant and search settings).
    ``prior``: events released before the steps about the same people (a DP median that planned
    the run): the steps are calibrated so that the prior events and the T steps together, composed
    by ``dp_accounting.DpEventBuilder``, are (ε, δ)-DP.

    Returns σ such that an upper bound on ε(σ) meets the target (PLD with pessimistic
    discretization at ``how.interval``, default 1e-3, or RDP): so σ ≥ the true σ. It stops when
    some σ' < σ with σ/σ' ≤ 1 + ``how.rtol`` fails the same evaluation. With 1e-3 discretization
    the answer is within about 0.3% of what a 1e-4 PLD gives (the pessimism of the coarser grid);
    see benchmarks/bench_accounting.py.

    Speed: PLD evaluations at small σ are the slow ones, so the search never steps far below
    a σ it has seen: it starts from a central-limit (μ-GDP) estimate and runs a safeguarded
    secant on log ε against log σ, aiming just either side of the root.
    """
    how = Calibration(how) if isinstance(how, str) else how
    eps = check_target_epsilon(epsilon)
    dlt = check_delta(delta)
    t = check_int(steps, "steps")
    check_callable(make_step_event, "make_step_event")
    acc = get_accountant(how.accountant)
    prior, spent = tuple(prior), 0.0
    if prior:  # what the prior events alone spend: nothing left for training is refused in one line
        spent = acc.epsilon(compose_after(prior, None, 0), dlt, interval=how.interval, orders=how.orders)[0]
        if not spent < eps:
            raise UserError(
                f"the events released before training already spend epsilon = {spent:.4g} of the "
                f"{eps:g} at delta = {dlt:g}: nothing is left for training; raise epsilon or spend "
                "less before training (e.g. a smaller planning.dp_median_epsilon)"
            )

    def eps_at(s: float, interval: float) -> float:
        return acc.epsilon(compose_after(prior, make_step_event(s), t), dlt, interval=interval, orders=how.orders)[0]

    # the steps' share, roughly (basic composition with the prior): only where the search starts
    guess = _initial_guess(make_step_event, t, eps - spent, dlt)
    unreachable = (
        f"epsilon={eps:g} at delta={dlt:g} is not reachable with any noise multiplier "
        f"up to {how.sigma_max:g} in {t} steps"
    )
    try:
        return _calibrate(eps_at, guess, eps, t, how, unreachable)
    except RuntimeError:
        after = " after the events released before training" if prior else ""
        raise UserError(
            f"no noise multiplier up to {how.sigma_max:g} meets epsilon = {eps:g} at delta = {dlt:g} "
            f"over {t} steps{after}; raise epsilon or delta, or take fewer steps"
        ) from None


def _calibrate(
    eps_at: Callable[[float, float], float], guess: float | None, eps: float, t: int, how: Calibration, unreachable: str
) -> float:
    """The search of :func:`calibrate_noise_multiplier` over ``eps_at(σ, interval)``."""
    log_target = math.log(eps)
    discretized = get_accountant(how.accountant).discretized

    def f_of(e: float) -> float:
        if e <= 0:
            return -50.0
        if not math.isfinite(e):
            return 50.0
        return math.log(e) - log_target

    s0 = min(max(guess if guess else 1.0, 1e-3), how.sigma_max)
    # Pessimism of a Δ grid after T steps, measured here: ε(Δ) − ε ≈ 0.7·T·Δ² near ε ≈ 3
    # (0.0065 at T = 1e4, Δ = 1e-3; 0.07 at T = 1e5). Start on a grid that keeps it ≲ 0.3%;
    # the 3Δ check below catches mechanisms where the constant is larger.
    interval = how.interval
    if discretized:
        predicted = math.sqrt(0.003 * eps / (0.7 * t))
        interval = min(interval, max(PLD_INTERVAL, PLD_INTERVAL * math.floor(predicted / PLD_INTERVAL)))
    hi, lo, slope = _secant_search(lambda s: f_of(eps_at(s, interval)), s0, [], how, unreachable)
    if not discretized or interval <= PLD_INTERVAL:
        return hi
    # The discretization's pessimism grows with T (about as Δ²): estimate it at the answer
    # from a 3Δ evaluation, and if σ could be too far above the 1e-4 answer, search again on
    # a finer grid (down to 1e-4) from the current bracket.
    e1 = eps_at(hi, interval)
    e3 = eps_at(hi, 3 * interval)  # a 3Δ grid costs a third of a Δ one
    excess = max(e3 - e1, 0.0) / 8.0  # ε(Δ) - ε(0) ≈ (ε(3Δ) - ε(Δ)) / 8 when error ∝ Δ²
    sigma_excess = excess / max(e1, 1e-12) / max(abs(slope), 0.05)
    if sigma_excess + how.rtol <= 0.008:
        return hi
    fine = max(PLD_INTERVAL, interval * math.sqrt(0.001 / sigma_excess))
    fine = PLD_INTERVAL * math.ceil(fine / PLD_INTERVAL - 1e-9)
    pts = [(hi, f_of(eps_at(hi, fine)))]
    start = hi * math.exp(-min(sigma_excess, 0.2))
    hi2, _, _ = _secant_search(lambda s: f_of(eps_at(s, fine)), start, pts, how, unreachable)
    return hi2


def _secant_search(
    f: Callable[[float], float], s: float, pts: list, how: Calibration, unreachable: str
) -> tuple[float, float | None, float]:
    """Safeguarded secant on (log σ, f = log ε − log ε_target) for a decreasing ε(σ).

    Returns (hi, lo, slope): hi passes (f ≤ 0), lo fails or None, hi ≤ lo·(1 + rtol). Never
    steps more than ×1.5 below a passing σ (small σ are the expensive evaluations).
    """
    pts, rtol, sigma_max = list(pts), how.rtol, how.sigma_max
    evaluate = True
    widths: list[float] = []  # log(hi / lo) after each evaluation inside a bracket
    for _ in range(60):
        if evaluate:
            pts.append((s, f(s)))
        evaluate = True
        passes = [p for p in pts if p[1] <= 0]
        fails = [p for p in pts if p[1] > 0]
        hi = min(p[0] for p in passes) if passes else None
        lo = max(p[0] for p in fails) if fails else None
        near = sorted(pts, key=lambda p: abs(p[1]))[:2]
        slope = -1.0
        if len(near) == 2 and near[0][0] != near[1][0] and abs(near[0][1]) < 50 and abs(near[1][1]) < 50:
            sl = (near[0][1] - near[1][1]) / (math.log(near[0][0]) - math.log(near[1][0]))
            if -20.0 < sl < -0.05:
                slope = sl
        if hi is not None and lo is not None and hi <= lo * (1 + rtol):
            return float(hi), float(lo), slope
        if hi is None and lo is not None and lo >= sigma_max:
            raise UserError(unreachable)
        r = math.exp(math.log(near[0][0]) - max(min(near[0][1], 5.0), -5.0) / slope)
        step = rtol / 3
        if hi is None:  # no passing σ yet: aim just above the root, but grow at most 3x
            assert lo is not None  # every point either passes or fails
            s = min(max(r * (1 + step), lo * (1 + step)), lo * 3, sigma_max)
        elif lo is None:  # no failing σ yet: aim just below, never far below a σ seen
            s = max(min(r * (1 - step), hi / (1 + step)), hi / 1.5)
            if s < 1e-3:
                return float(hi), None, slope
        else:
            widths.append(math.log(hi / lo))
            r = min(max(r, lo), hi)
            s = r * (1 + step) if hi / r > r / lo else r * (1 - step)
            if not (lo * (1 + 1e-9) < s < hi * (1 - 1e-9)) or hi / s < 1 + rtol / 10 or s / lo < 1 + rtol / 10:
                s = math.sqrt(lo * hi)
            elif len(widths) >= 3 and widths[-1] > 0.5 * widths[-3]:
                # the secant has not halved the bracket in two steps (a steep ε(σ), e.g. ELS with a
                # large G at a tiny rate, where the nearest points lie on one side): bisect, so the
                # bracket at least halves every three evaluations
                s = math.sqrt(lo * hi)
    raise RuntimeError("calibration did not converge")  # pragma: no cover
