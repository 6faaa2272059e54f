"""Tests of the pure heuristics: ELS median on per-user counts, the DP median, Estimate-and-Double."""

import math

import numpy as np
import pytest

from userdp.errors import UserError
from userdp.planning import (
    dp_median,
    dp_median_probabilities,
    els_group_size,
    estimate_and_double,
    log_grid,
    variance_ratio,
)

# ---------------------------------------------------------------- ELS median


def test_els_median_is_over_users_not_records():
    # 9 users with 1 record and 1 user with 1000 records: the median record belongs to the
    # heavy user (a per-record median would be 1000); the per-user median is 1.
    sizes = np.array([1] * 9 + [1000])
    choice = els_group_size(sizes)
    assert choice.group_size == 1
    assert choice.method == "median" and choice.epsilon_spent == 0.0
    assert choice.num_users == 10
    # and an even count rounds the median up to a whole group size
    assert els_group_size([2, 3, 7, 100]).group_size == 5


def test_els_median_rejects_bad_counts():
    with pytest.raises(UserError):
        els_group_size([])
    with pytest.raises(UserError):
        els_group_size([3, 0, 2])


def test_dp_median_is_accurate_with_fixed_seed():
    rng = np.random.default_rng(0)
    sizes = np.maximum(1, np.round(rng.lognormal(mean=math.log(16), sigma=1.0, size=2000))).astype(int)
    true = float(np.median(sizes))
    draws = [dp_median(sizes, 1.0, rng=np.random.default_rng(s)) for s in range(200)]
    # the log grid has ratio 2**(1/4) ~ 1.19; with n = 2000 and eps = 1 the mechanism should
    # land within one grid step of the median essentially always
    within = np.mean([abs(math.log(d / true)) <= math.log(2**0.5) for d in draws])
    assert within >= 0.97
    choice = els_group_size(sizes, dp_median_epsilon=0.5, rng=np.random.default_rng(1))
    assert choice.method == "dp_median" and choice.epsilon_spent == 0.5
    assert "add this epsilon" in choice.note


def test_dp_median_probabilities_satisfy_epsilon_dp_for_neighbours():
    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 300, size=101)
    grid = log_grid(1 << 12)
    eps = 0.7
    p = dp_median_probabilities(sizes, eps, grid)
    for k in (0, 50, 100):  # remove one user
        q = dp_median_probabilities(np.delete(sizes, k), eps, grid)
        assert np.max(np.abs(np.log(p) - np.log(q))) <= eps + 1e-9
    for extra in (1, 150, 4000):  # add one user
        q = dp_median_probabilities(np.append(sizes, extra), eps, grid)
        assert np.max(np.abs(np.log(p) - np.log(q))) <= eps + 1e-9


@pytest.mark.slow
def test_dp_median_sampling_matches_its_distribution():
    # chi-square goodness of fit of the sampler against the stated probabilities (fixed seed)
    from scipy import stats

    sizes = np.repeat([4, 8, 16, 32], [30, 20, 20, 30])
    grid = log_grid(1 << 8, points_per_doubling=1)
    eps = 0.2
    p = dp_median_probabilities(sizes, eps, grid)
    rng = np.random.default_rng(7)
    n = 20000
    draws = [dp_median(sizes, eps, upper=1 << 8, points_per_doubling=1, rng=rng) for _ in range(n)]
    observed = np.array([np.sum(np.array(draws) == g) for g in grid])
    keep = p * n >= 5
    exp = p[keep] * n
    obs = observed[keep]
    chi2 = np.sum((obs - exp) ** 2 / exp)
    assert stats.chi2.sf(chi2, keep.sum() - 1) > 1e-3


# ---------------------------------------------------------------- Estimate-and-Double


def step_sigma(m):  # monotone sigma(M): flat (full amplification) until 8, then linear
    return max(1.0, m / 8.0)


def inv_sqrt(g, L=3.0):
    return L / math.sqrt(g)


def test_estimate_and_double_doubles_as_the_objective_says():
    res = estimate_and_double(64, 10_000, step_sigma, inv_sqrt)
    assert res.cohort_size * res.group_size == 64
    assert (res.cohort_size, res.group_size) == (8, 8)
    assert [d.doubled for d in res.trace] == ["M", "M", "M", "G", "G", "G"]
    # each choice is the one that lowers sigma(M) L(G) / M more (replayed independently)
    for d in res.trace:
        m, g = d.cohort_size, d.group_size
        obj_m = step_sigma(2 * m) * inv_sqrt(g) / (2 * m)
        obj_g = step_sigma(m) * inv_sqrt(2 * g) / m
        assert d.doubled == ("M" if obj_m <= obj_g else "G")
    assert math.isclose(res.objective, step_sigma(8) * inv_sqrt(8) / 8)


def test_estimate_and_double_never_exceeds_users_and_reaches_budget():
    res = estimate_and_double(1024, 5, step_sigma, inv_sqrt)
    assert res.cohort_size <= 5 and res.cohort_size == 4
    assert res.cohort_size * res.group_size == 1024
    for budget in (1, 2, 32, 4096):
        r = estimate_and_double(budget, 100, lambda m: 1.0 + 0.01 * m, inv_sqrt, m0=1, g0=1)
        assert r.cohort_size * r.group_size == budget and r.cohort_size <= 100
        assert len(r.trace) == int(math.log2(budget))


def test_estimate_and_double_ties_go_to_m_and_caches():
    calls = {"s": 0, "l": 0}

    def sigma(m):
        calls["s"] += 1
        return 2.0  # r_M = 1/2

    def ell(g):
        calls["l"] += 1
        return 1.0 / g  # r_G = 1/2: a tie every time

    res = estimate_and_double(256, 1000, sigma, ell)
    assert (res.cohort_size, res.group_size) == (256, 1)
    assert calls["l"] <= 2  # L(1), L(2) only, cached
    assert calls["s"] <= 9


def test_estimate_and_double_rejects_bad_inputs():
    with pytest.raises(UserError):
        estimate_and_double(100, 10, step_sigma, inv_sqrt)
    with pytest.raises(UserError):
        estimate_and_double(64, 10, step_sigma, inv_sqrt, m0=16, g0=8)
    with pytest.raises(UserError):
        estimate_and_double(64, 10, step_sigma, inv_sqrt, m0=16, g0=1)


def test_variance_ratio_matches_direct_variances():
    # Var_ELS = d sigma_ELS^2 L^2 / B^2 and Var_ULS = d sigma_ULS^2 L_G^2 G^2 / B^2 (SPEC §7.1)
    d, B, L = 10, 64, 1.0
    for g, l_g, s_u, s_e in [(1, 1.0, 1.3, 1.1), (8, 1 / math.sqrt(8), 0.9, 1.05), (16, 1.0, 2.0, 1.0)]:
        var_els = d * s_e**2 * L**2 / B**2
        var_uls = d * s_u**2 * l_g**2 * g**2 / B**2
        assert math.isclose(variance_ratio(g, l_g, s_u, s_e, L), var_uls / var_els, rel_tol=1e-12)
