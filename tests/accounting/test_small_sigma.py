"""Small-σ ELS: the vectorized mixture PLD equals dp_accounting's; calibration stays sound. The
vectorized Poisson-subsampled Gaussian PLD (ULS, every step of which is one) equals dp_accounting's."""

import logging

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as PLD

from userdp import accounting as A


def _dense(pmf):
    d = pmf.to_dense_pmf()
    return d._lower_loss, np.asarray(d._probs), d._infinity_mass


def test_vectorized_mixture_pld_equals_dp_accounting():
    # small sigma, wide loss range: the case dp_accounting's recursive inverse is slow on
    sens, probs = A.binomial_sensitivity(4, 0.05)
    ref = PLD.from_mixture_gaussian_mechanism(1.65, sens, probs, value_discretization_interval=1e-2)
    ours = A.mixture_gaussian_pld(1.65, sens, probs, 1e-2)
    for a, b in [(ref._pmf_remove, ours._pmf_remove), (ref._pmf_add, ours._pmf_add)]:
        la, pa, ia = _dense(a)
        lb, pb, ib = _dense(b)
        assert la == lb and ia == ib and np.array_equal(pa, pb)  # bit for bit
    assert ours.get_epsilon_for_delta(1e-5) == ref.get_epsilon_for_delta(1e-5)


@pytest.mark.parametrize(
    "sigma,q,interval",
    [
        (1.0, 0.05, 1e-4),  # the default job's shape
        (0.6, 0.01, 1e-4),  # small sigma: a wide loss grid
        (1.2, 1.0, 1e-4),  # no subsampling: one symmetric PLD
        (0.3, 0.001, 1e-3),  # tiny q
        (20.0, 0.9, 1e-4),  # large sigma, q near 1
        (0.8, 0.2, 1e-2),  # coarse grid (calibration's)
    ],
)
def test_vectorized_gaussian_pld_equals_dp_accounting(sigma, q, interval):
    ref = PLD.from_gaussian_mechanism(standard_deviation=sigma, value_discretization_interval=interval, sampling_prob=q)
    ours = A.gaussian_pld(sigma, q, interval)
    for a, b in [(ref._pmf_remove, ours._pmf_remove), (ref._pmf_add, ours._pmf_add)]:
        la, pa, ia = _dense(a)
        lb, pb, ib = _dense(b)
        assert la == lb and ia == ib and np.array_equal(pa, pb)  # bit for bit
    assert ours.get_epsilon_for_delta(1e-6) == ref.get_epsilon_for_delta(1e-6)


def test_the_vectorized_gaussian_inverse_matches_dp_accounting_pointwise():
    # the endpoints (isclose to ±log(1-q)), ε = 0, the region where δ = 1 - e^ε, and beyond
    from dp_accounting.pld import privacy_loss_mechanism as PLM

    from userdp.accounting.pld import _VectorizedGaussianPrivacyLoss

    q = 0.3
    eps = np.concatenate(
        [
            np.linspace(-3, 3, 601),
            [0.0, -np.log(1 - q), np.log(1 - q), -np.log(1 - q) * (1 - 1e-12), np.log(1 - q) * (1 + 1e-12)],
        ]
    )
    for adj in (PLM.AdjacencyType.ADD, PLM.AdjacencyType.REMOVE):
        kw = dict(sensitivity=1, sampling_prob=q, adjacency_type=adj)
        ref = PLM.GaussianPrivacyLoss(0.9, **kw).get_delta_for_epsilon(eps)
        ours = _VectorizedGaussianPrivacyLoss(0.9, **kw).get_delta_for_epsilon(eps)
        assert np.array_equal(ref, ours), adj


@pytest.mark.slow
def test_small_sigma_els_calibration_is_sound_and_tight():
    # ELS with few steps (training.algorithm=els, short runs): sigma ~ 1.65. This took
    # ~50-60 s before the vectorized mixture PLD; the properties, not the time, are asserted.
    p, G, T, eps, delta = 0.05, 4, 50, 5.0, 1e-5
    make = lambda z: A.els_step_event(z, p, G)  # noqa: E731
    sigma = A.calibrate_noise_multiplier(make, T, eps, delta)
    fine = lambda z: A.epsilon(A.compose(make(z), T), delta)  # noqa: E731  (1e-4, pessimistic)
    assert fine(sigma) <= eps  # never below the true sigma
    assert fine(sigma / 1.01) > eps  # at most 1% above it
    # the evaluation the calibration relied on (pessimistic 1e-3 PLD) also meets the target
    assert A.epsilon(A.compose(make(sigma), T), delta, value_discretization_interval=1e-3) <= eps


def test_rdp_at_small_sigma_does_not_flood_the_log(caplog):
    with caplog.at_level(logging.WARNING):
        sigma = A.calibrate_noise_multiplier(lambda z: A.uls_step_event(z, 0.05), 50, 5.0, 1e-5, "rdp")
    assert not [r for r in caplog.records if "failed to converge" in r.getMessage()]
    rdp = lambda z: A.epsilon(A.compose(A.uls_step_event(z, 0.05), 50), 1e-5, "rdp")  # noqa: E731
    assert rdp(sigma) <= 5.0 < rdp(sigma / 1.005)
    assert logging.getLogger("absl").filters == []  # the filter is scoped to our RDP calls


@pytest.mark.parametrize(
    "steps",
    [
        1,
        2,
        9,
        100,
        pytest.param(
            3000,
            marks=pytest.mark.heavy(
                counterpart="tests/accounting/test_small_sigma.py::test_the_fast_self_composition_equals_dp_accounting[100]"
            ),
        ),
    ],
)
def test_the_fast_self_composition_equals_dp_accounting(steps):
    """pld.self_compose (one numpy expression for the 40 Chernoff bounds) gives dp_accounting's
    self_compose bit for bit: the ULS step and an ELS mixture, at the ledger's and the report's grids."""
    from userdp.accounting import pld as P

    sens, probs = A.binomial_sensitivity(4, 0.05)
    for base in (
        A.gaussian_pld(1.043, 0.0234, 1e-3),
        A.gaussian_pld(0.7, 0.3, 1e-4),
        A.mixture_gaussian_pld(1.65, sens, probs, 1e-3),
    ):
        ref, ours = base.self_compose(steps), P.self_compose(base, steps)
        for a, b in [(ref._pmf_remove, ours._pmf_remove), (ref._pmf_add, ours._pmf_add)]:
            la, pa, ia = _dense(a)
            lb, pb, ib = _dense(b)
            assert la == lb and ia == ib and np.array_equal(pa, pb)
        assert ours.get_epsilon_for_delta(1e-6) == ref.get_epsilon_for_delta(1e-6)


def test_the_fast_chernoff_bounds_equal_dp_accounting_on_random_pmfs():
    from dp_accounting.pld import common

    from userdp.accounting import pld as P

    rng = np.random.default_rng(7)
    for n in (1, 2, 50, 3000):
        for steps in (1, 5, 400):
            p = rng.random(n) * np.where(rng.random(n) < 0.3, 1e-40, 1.0)
            p /= p.sum()
            for tail in (0.0, 1e-15, 1e-6):
                assert P._self_convolve_bounds(p, steps, tail) == common.compute_self_convolve_bounds(p, steps, tail)
