"""Dropping a mixture's improbable largest sensitivities (accounting.pld.truncate_mixture_tails):
what is dropped, and that δ(ε) ≤ δ'(ε − η) + S holds against exact one-step divergences."""

import math

import numpy as np
import pytest
from dp_accounting import dp_event as dpe
from scipy import stats

from userdp import accounting as A
from userdp.accounting import pld as P


def test_drops_the_largest_sensitivities_within_the_budget_and_renormalizes():
    ev = A.els_step_event(1.0, 0.1, 6)  # pmf of K: .531 .354 .098 .0146 1.2e-3 5.4e-5 1e-6
    cut, S, eta = P.truncate_mixture_tails(dpe.SelfComposedDpEvent(ev, 10), 10 * 2e-3)
    step = cut.event
    assert cut.count == 10
    assert list(step.sensitivities) == [0, 1, 2, 3]  # K = 4, 5, 6 (mass 1.27e-3 <= 2e-3) dropped; K = 3 is not
    tau = stats.binom.sf(3, 6, 0.1)
    assert pytest.approx(10 * tau, rel=1e-9) == S
    assert eta == pytest.approx(-10 * math.log1p(-tau), rel=1e-9)
    assert math.isclose(sum(step.sampling_probs), 1.0, rel_tol=1e-12)
    np.testing.assert_allclose(step.sampling_probs, stats.binom.pmf(range(4), 6, 0.1) / (1 - tau), rtol=1e-12)
    assert step.standard_deviation == 1.0


def test_nothing_dropped_passes_the_event_through():
    ev = dpe.SelfComposedDpEvent(A.els_step_event(1.0, 0.1, 6), 10)
    assert P.truncate_mixture_tails(ev, 0.0) == (ev, 0.0, 0.0)
    assert P.truncate_mixture_tails(ev, 1e-300)[0] is ev
    gauss = dpe.SelfComposedDpEvent(dpe.PoissonSampledDpEvent(0.1, dpe.GaussianDpEvent(1.0)), 10)
    assert P.truncate_mixture_tails(gauss, 0.5) == (gauss, 0.0, 0.0)
    # one component always stays, even with a budget above 1
    lone, S, _ = P.truncate_mixture_tails(dpe.MixtureOfGaussiansDpEvent(1.0, [0, 1], [0.5, 0.5]), 2.0)
    assert list(lone.sensitivities) == [0] and S == 0.5


def test_the_budget_is_shared_over_every_mixture_step_of_a_composition():
    a = A.els_step_event(1.0, 0.1, 6)
    b = A.els_step_event(2.0, 0.1, 6)
    ev = dpe.ComposedDpEvent([dpe.SelfComposedDpEvent(a, 30), dpe.GaussianDpEvent(3.0), dpe.SelfComposedDpEvent(b, 10)])
    budget = 40 * 2e-3  # 40 mixture steps, 2e-3 each
    cut, S, _ = P.truncate_mixture_tails(ev, budget)
    assert cut.events[1] == dpe.GaussianDpEvent(3.0)
    assert [list(e.event.sensitivities) for e in (cut.events[0], cut.events[2])] == [[0, 1, 2, 3]] * 2
    assert pytest.approx(40 * stats.binom.sf(3, 6, 0.1), rel=1e-9) == S
    assert budget >= S


def _hockey_stick(p, q, eps, x):
    """∫ max(0, p − e^ε q) dx on the grid x (the exact δ(ε) of one step for the pair (p, q))."""
    return float(np.trapezoid(np.maximum(0.0, p - math.exp(eps) * q), x))


def _mixture_density(x, sens, probs, sigma):
    return sum(w * stats.norm.pdf(x, s, sigma) for s, w in zip(sens, probs, strict=True))


@pytest.mark.parametrize("budget", [5e-3, 0.05])
def test_truncated_bound_holds_against_exact_one_step_divergences(budget):
    """One ELS step with a heavy tail (G = 5, p = 0.3): for both orders of the pair, the real
    δ(ε) is at most δ'(ε − η) + S, where δ' is the truncated mixture's; and the S term is needed
    (without it the bound fails somewhere), so this test can fail."""
    sigma, G, p = 1.0, 5, 0.3
    ev = A.els_step_event(sigma, p, G)
    cut, S, eta = P.truncate_mixture_tails(ev, budget)
    assert 0 < S <= budget and len(cut.sensitivities) < G + 1
    x = np.linspace(-15.0, 25.0, 400_001)
    full = _mixture_density(x, ev.sensitivities, ev.sampling_probs, sigma)
    trunc = _mixture_density(x, cut.sensitivities, cut.sampling_probs, sigma)
    gauss = stats.norm.pdf(x, 0.0, sigma)
    needed = False
    for eps in np.linspace(0.05, 6.0, 40):
        for real, bound_pair in (((full, gauss), (trunc, gauss)), ((gauss, full), (gauss, trunc))):
            d_real = _hockey_stick(*real, eps, x)
            d_cut = _hockey_stick(*bound_pair, eps - eta, x)
            assert d_real <= d_cut + S + 1e-9
            needed |= d_real > d_cut + 1e-9
    assert needed


@pytest.mark.heavy(
    counterpart="tests/accounting/test_calibration.py::test_els_calibration_reaches_below_the_old_pld_guard"
)
@pytest.mark.slow
def test_els_calibration_goes_below_the_old_guard():
    """Blogs ELS at B = 8, ε = 8 (G = 11, p = 8 / 43,578, T = 80) sat on σ = 0.05·G = 0.55, below
    which RDP answered and overshot. With K ≥ 5 dropped (mass ~1e-17) the PLD answers down to
    σ ≈ 0.34 and the calibrated run spends its ε."""
    q, delta, T = 8 / 43578, 5000**-1.1, 80
    sigma = A.calibrate_noise_multiplier(lambda z: A.els_step_event(z, q, 11), T, 8.0, delta)
    assert sigma < 0.45
    eps, backend = A.epsilon_and_accountant(A.compose(A.els_step_event(sigma, q, 11), T), delta)
    assert backend == "pld"
    assert 7.8 <= eps <= 8.0
    # δ at that ε (δ is found by the same truncation, in two passes) meets the target
    assert A.delta(A.compose(A.els_step_event(sigma, q, 11), T), eps) <= delta * (1 + 1e-6)
