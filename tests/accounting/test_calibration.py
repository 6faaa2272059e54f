"""Calibration: never below the true sigma, at most 1% above; Conjecture 1; max_steps."""

import math

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant

from userdp import accounting as A
from userdp.errors import UserError


@pytest.mark.slow
def test_uls_calibration_matches_dp_accounting_and_is_pessimistic():
    q, T, eps, delta = 0.01, 100, 0.3, 1e-5
    make = lambda z: A.uls_step_event(z, q)  # noqa: E731
    ours = A.calibrate_noise_multiplier(make, T, eps, delta)
    ref = dp_accounting.calibrate_dp_mechanism(
        pld_privacy_accountant.PLDAccountant,
        lambda z: A.compose(make(z), T),
        eps,
        delta,
        bracket_interval=dp_accounting.ExplicitBracketInterval(0.97 * ours, ours),
        tol=1e-4 * ours,
    )
    assert ref <= ours <= 1.01 * ref
    assert A.epsilon(A.compose(make(ours), T), delta) <= eps  # at dp_accounting's default PLD


def test_els_calibration_is_within_one_percent_above_fine_pld():
    q, G, T, eps, delta = 0.02, 16, 100, 0.12, 1e-6  # sigma ~ 98: cheap PLD
    make = lambda z: A.els_step_event(z, q, G)  # noqa: E731
    sigma = A.calibrate_noise_multiplier(make, T, eps, delta)
    fine = lambda z: A.epsilon(A.compose(make(z), T), delta)  # noqa: E731  (1e-4, pessimistic)
    assert fine(sigma) <= eps  # never below the (fine) true sigma
    assert fine(sigma / 1.01) > eps  # and less than 1% above it


def test_rdp_calibration():
    q, T, eps, delta = 0.05, 200, 2.0, 1e-8
    make = lambda z: A.uls_step_event(z, q)  # noqa: E731
    sigma = A.calibrate_noise_multiplier(make, T, eps, delta, "rdp")
    rdp = lambda z: A.epsilon(A.compose(make(z), T), delta, "rdp")  # noqa: E731
    assert rdp(sigma) <= eps < rdp(sigma / 1.005)


@pytest.mark.slow
def test_fixed_cohort_calibration_reproduces_andrew_z():
    # SPEC A5 SHAKESPEARE: T=1200, m=510 of 1e6, z=0.510 gives eps 4.982 ~ (5, n^-1.1)
    n = 10**6
    make = lambda z: A.fixed_cohort_step_event(z, n, 510)  # noqa: E731
    orders = list(range(2, 65))  # integer orders: dp_accounting's WOR RDP is slow at fractional ones
    sigma = A.calibrate_noise_multiplier(make, 1200, 5.0, n**-1.1, A.Calibration("rdp", orders=orders))
    assert A.epsilon(A.compose(make(sigma), 1200), n**-1.1, "rdp", orders=orders) <= 5.0
    assert 0.500 < sigma <= 0.510 * 1.01


@pytest.mark.parametrize("G", [4, 16])
def test_conjecture1_els_sigma_at_most_G_times_uls(G):
    q, T, eps, delta = 0.01, 1000, 0.5, 1e-6
    s_uls = A.calibrate_noise_multiplier(lambda z: A.uls_step_event(z, q), T, eps, delta)
    s_els = A.calibrate_noise_multiplier(lambda z: A.els_step_event(z, q, G), T, eps, delta)
    assert s_uls < s_els <= G * s_uls


def test_unreachable_epsilon_is_a_user_error():
    with pytest.raises(UserError, match="not reachable"):
        A.calibrate_noise_multiplier(lambda z: A.uls_step_event(z, 1.0), 10, 1e-9, 1e-6)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(epsilon=0.0, delta=1e-6, steps=10),
        dict(epsilon=-1, delta=1e-6, steps=10),
        dict(epsilon=1.0, delta=0.0, steps=10),
        dict(epsilon=1.0, delta=1.0, steps=10),
        dict(epsilon=1.0, delta=1e-6, steps=0),
        dict(epsilon=math.inf, delta=1e-6, steps=1),
    ],
)
def test_calibration_bad_input(kwargs):
    with pytest.raises(UserError):
        A.calibrate_noise_multiplier(lambda z: A.uls_step_event(z, 0.1), **kwargs)


def test_calibration_cache_makes_repeat_cheap():
    make = lambda z: A.uls_step_event(z, 0.02)  # noqa: E731
    a = A.calibrate_noise_multiplier(make, 300, 1.5, 1e-6)
    calls = []
    from userdp.accounting import pld as P  # the PLD backend's module

    orig = P.pld_distribution
    try:
        P.pld_distribution = lambda ev, iv: calls.append(1) or orig(ev, iv)
        b = A.calibrate_noise_multiplier(make, 300, 1.5, 1e-6)
    finally:
        P.pld_distribution = orig
    assert a == b and calls  # same answer, served from the LRU cache of composed PLDs
    assert all(key in A.PLD_CACHE for key in [(repr(A.compose(make(a), 300)), 1e-3)])


def test_large_T_calibration_stays_within_one_percent():
    # the pessimism of a coarse PLD grid grows with T; calibration must refine its grid
    q, T, eps, delta = 0.01, 100_000, 3.0, 1e-6
    make = lambda z: A.uls_step_event(z, q)  # noqa: E731
    sigma = A.calibrate_noise_multiplier(make, T, eps, delta)
    fine = lambda z: A.epsilon(A.compose(make(z), T), delta)  # noqa: E731
    assert fine(sigma) <= eps < fine(sigma / 1.01)


@pytest.mark.heavy(
    counterpart="tests/accounting/test_calibration.py::test_els_calibration_reaches_below_the_old_pld_guard"
)
@pytest.mark.slow
def test_els_calibration_converges_where_epsilon_falls_off_a_cliff():
    """ELS with G = 11 at p = 0.0016 over 6 steps: epsilon drops from 4 to 0.1 between sigma 1.09
    and 1.33, and the secant's nearest points lay on one side, so it crept down by 0.13% a step and
    gave up ("no noise multiplier up to 10000") — found by benchmarks/bench_tradeoffs.py on blogs."""
    p, G, T, eps, delta = 0.0016, 11, 6, 1.0, 8.8e-4
    make = lambda z: A.els_step_event(z, p, G)  # noqa: E731
    sigma = A.calibrate_noise_multiplier(make, T, eps, delta)
    fine = lambda z: A.epsilon(A.compose(make(z), T), delta)  # noqa: E731
    assert fine(sigma) <= eps < fine(sigma / 1.01)


@pytest.mark.slow
def test_els_calibration_reaches_below_the_old_pld_guard():
    """blogs, ELS at G = 11, 8 records a step (p = 8/43,578), 80 steps, epsilon = 1: the PLD
    accountant refused sigma / G < 0.1 and RDP answered there (epsilon 10.8 at sigma 1.0 where the
    PLD says 4.1), so calibration stopped at sigma 1.101, which spends epsilon 0.06. The PLD now
    answers mixtures down to sigma / G = 0.05: sigma is about 0.58 and spends the epsilon asked for."""
    p, G, T, eps, delta = 8 / 43578, 11, 80, 1.0, 7.84e-5
    make = lambda z: A.els_step_event(z, p, G)  # noqa: E731
    sigma = A.calibrate_noise_multiplier(make, T, eps, delta)
    spent, backend = A.epsilon_and_accountant(A.compose(make(sigma), T), delta)
    assert backend == "pld" and 0.9 * eps < spent <= eps
    assert sigma < 0.7  # was 1.101
    assert A.epsilon(A.compose(make(sigma / 1.01), T), delta) > eps  # and the smallest such sigma, to 1%
