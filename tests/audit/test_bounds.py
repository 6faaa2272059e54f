"""The audit's lower bounds against direct computations, and their validity and power in
simulation (Steinke, Nasr & Jagielski 2023; Clopper–Pearson)."""

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from userdp.audit import bounds as B
from userdp.errors import UserError


def _alpha_brute(r, v, q):
    best = 0.0
    for i in range(1, v + 1):
        mass = sum(stats.binom.pmf(j, r, q) for j in range(v - i, v))
        best = max(best, mass / i)
    return best


@pytest.mark.parametrize(
    "m,r,v,eps,delta",
    [(100, 50, 40, 1.0, 0.0), (100, 50, 40, 1.0, 1e-3), (400, 200, 195, 2.5, 3.5e-4), (10, 10, 3, 0.2, 0.01)],
)
@pytest.mark.slow
def test_p_value_is_the_theorem_computed_directly(m, r, v, eps, delta):
    q = math.exp(eps) / (1 + math.exp(eps))
    tail = sum(stats.binom.pmf(j, r, q) for j in range(v, r + 1))
    want = min(1.0, tail + 2 * m * delta * _alpha_brute(r, v, q))
    assert B.p_value(m, r, v, eps, delta) == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_lower_bound_sits_on_the_rejection_boundary():
    m, r, v, delta, beta = 400, 200, 190, 1e-4, 0.0125
    eps = B.epsilon_lower_bound(m, r, v, delta, beta)
    assert eps > 1.0
    assert B.p_value(m, r, v, eps, delta) <= beta
    assert B.p_value(m, r, v, eps + 1e-3, delta) > beta


def test_lower_bound_grows_with_correct_guesses_and_shrinks_with_delta():
    a = [B.epsilon_lower_bound(200, 100, v, 0.0, 0.05) for v in (60, 70, 80, 90, 100)]
    assert all(x < y for x, y in itertools.pairwise(a))
    assert B.epsilon_lower_bound(200, 100, 50, 0.0, 0.05) == 0.0  # chance accuracy proves nothing
    d = [B.epsilon_lower_bound(400, 200, 195, delta, 0.05) for delta in (0.0, 1e-4, 1e-3)]
    assert d[0] > d[1] > d[2]


def test_perfect_guesses_bound_is_the_binomial_limit_at_delta_zero():
    # all r correct, delta 0: q^r = beta exactly at the bound
    r, beta = 100, 0.05
    eps = B.epsilon_lower_bound(r, r, r, 0.0, beta)
    q = beta ** (1 / r)
    assert eps == pytest.approx(math.log(q / (1 - q)), abs=1e-5)


def test_bad_counts_are_refused():
    with pytest.raises(UserError):
        B.p_value(10, 11, 5, 1.0, 0.0)
    with pytest.raises(UserError):
        B.one_run_bound([1.0, 2.0], [True], delta=0.0)
    with pytest.raises(UserError):
        B.one_run_bound([1.0, float("nan")], [True, False], delta=0.0)


def _randomized_response_scores(rng, m, eps):
    """Scores of an eps-DP mechanism per canary: the membership bit, flipped w.p. 1/(1+e^eps),
    plus a tie-breaking jitter (guessing from such scores is the optimal attack on eps-DP RR)."""
    inc = rng.random(m) < 0.5
    keep = rng.random(m) < math.exp(eps) / (1 + math.exp(eps))
    bit = np.where(keep, inc, ~inc)
    return bit + 0.01 * rng.random(m), inc


@pytest.mark.slow
def test_the_bound_is_valid_for_an_eps_dp_mechanism():
    """Against a mechanism that is exactly eps-DP per canary, the 95% bound may exceed eps in at
    most 5% of audits: 300 audits, and 5% + 4 standard errors of slack (fixed seed)."""
    rng = np.random.default_rng(20261123)
    eps, n = 1.0, 300
    over = sum(
        B.one_run_bound(*_randomized_response_scores(rng, 200, eps), delta=0.0).epsilon_lower_bound > eps
        for _ in range(n)
    )
    assert over <= n * 0.05 + 4 * math.sqrt(n * 0.05 * 0.95)


def test_the_bound_has_power_against_a_leaky_mechanism():
    """At eps = 4 (RR accuracy 98%) with 400 canaries the bound finds well above 1 in most audits."""
    rng = np.random.default_rng(7)
    found = [
        B.one_run_bound(*_randomized_response_scores(rng, 400, 4.0), delta=0.0).epsilon_lower_bound for _ in range(20)
    ]
    assert np.median(found) > 2.0
    assert max(found) < 4.0 + 0.5  # and never far beyond the truth


def test_grid_is_fixed_and_short():
    assert B.guess_grid(400) == [(100, 100), (200, 200)]
    assert B.guess_grid(2) == [(1, 1)]
    assert B.guess_grid(400, ((0.1, 0.0),)) == [(40, 0)]


def test_clopper_pearson_matches_scipy_exact_interval():
    for k, n in [(0, 10), (3, 10), (10, 10), (47, 100)]:
        lo, hi = B.clopper_pearson(k, n, 0.9)
        ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.9, method="exact")
        assert lo == pytest.approx(ci.low, abs=1e-9) and hi == pytest.approx(ci.high, abs=1e-9)


def test_clopper_pearson_bound_reads_the_confusion_matrix():
    scores = np.array([5, 4, 3, 2, 1, 0] * 50, dtype=float)
    inc = np.array([1, 1, 1, 0, 0, 0] * 50, dtype=bool)
    r = B.clopper_pearson_bound(scores, inc, delta=0.0, confidence=0.95)
    assert (r["tp"], r["fn"], r["fp"], r["tn"]) == (150, 0, 0, 150)
    lo, _ = B.clopper_pearson(150, 150, 0.975)
    _, hi = B.clopper_pearson(0, 150, 0.975)
    assert r["epsilon_lower_bound"] == pytest.approx(math.log(lo / hi))
    noise = B.clopper_pearson_bound(np.random.default_rng(0).random(300), inc, delta=0.0)
    assert noise["epsilon_lower_bound"] < 0.5


def test_auc_and_tpr_at_fpr_against_brute_force():
    rng = np.random.default_rng(3)
    pos, neg = rng.normal(1, 1, 60), rng.normal(0, 1, 80)
    pos[:5] = neg[:5]  # ties count one half
    brute = np.mean([(p > n) + 0.5 * (p == n) for p in pos for n in neg])
    assert B.roc_auc(pos, neg) == pytest.approx(brute)
    neg = np.arange(100.0)
    pos = np.array([98.5, 99.5, 50.0, 120.0])
    assert B.tpr_at_fpr(pos, neg, 0.01) == pytest.approx(0.75)  # threshold 98 (one negative above): 98.5, 99.5, 120
    assert math.isnan(B.roc_auc([], [1.0]))


def test_the_audit_states_its_power_the_largest_bound_it_could_report():
    """Issue 28 (4): with m canaries the largest reportable bound is the perfect guess's; a real
    audit never exceeds it; more canaries can show more; the statement says it."""
    from userdp.audit import bounds as B
    from userdp.audit.session import statement

    rng = np.random.default_rng(0)
    powers = [B.largest_bound(m, delta=1e-5, confidence=0.95) for m in (50, 200, 1000)]
    assert powers[0] < powers[1] < powers[2]
    m = 200
    inc = rng.random(m) < 0.5
    perfect = B.one_run_bound(inc.astype(float), inc, delta=1e-5)  # a score that separates them exactly
    # perfect separation reaches most of it (the grid's largest guesses can exceed the ~m/2 included)
    assert 0.5 * powers[1] < perfect.epsilon_lower_bound <= powers[1] + 1e-12
    for _ in range(5):
        noisy = B.one_run_bound(inc + rng.normal(0, 1.0, m), inc, delta=1e-5)
        assert noisy.epsilon_lower_bound <= powers[1] + 1e-12
    assert "could have shown at most ε = " in statement(3.0, 0.0, 0.95, powers[1])
