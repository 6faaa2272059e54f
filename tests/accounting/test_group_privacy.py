"""Group-privacy forms (SPEC §2) and the Theorem-1 noise split (SPEC §3.9)."""

import math

import pytest

from userdp import accounting as A
from userdp.accounting import group_privacy as GP
from userdp.accounting import split as AC
from userdp.errors import UserError


@pytest.mark.parametrize("eps,delta,k", [(0.5, 1e-8, 3), (2.0, 1e-24, 20), (0.01, 1e-6, 7)])
def test_forms_match_formulas_and_order(eps, delta, k):
    a = GP.group_delta(eps, delta, k, "a")
    b = GP.group_delta(eps, delta, k, "b")
    c = GP.group_delta(eps, delta, k, "c")
    assert a == pytest.approx(delta * math.expm1(k * eps) / math.expm1(eps), rel=1e-9)
    assert b == pytest.approx(k * math.exp((k - 1) * eps) * delta, rel=1e-9)
    assert c == pytest.approx(k * math.exp(k * eps) * delta, rel=1e-9)
    assert a <= b <= c  # (a) is the tightest
    assert GP.group_privacy(eps, delta, k)[0] == pytest.approx(k * eps)


def test_k1_is_identity_and_eps0_limit():
    assert GP.group_delta(1.0, 1e-6, 1, "a") == pytest.approx(1e-6)
    assert GP.group_delta(0.0, 1e-6, 5, "a") == pytest.approx(5e-6)


def test_default_form_is_a():
    assert GP.group_privacy(2.0, 1e-24, 20) == GP.group_privacy(2.0, 1e-24, 20, "a")
    ex = A.compose(A.uls_step_event(4.0, 0.01), 100)
    assert GP.group_privacy_epsilon(ex, 2, 1e-6).form == "a"


def test_baseline_forms_rank_and_tight_accountant_wins():
    ex = A.compose(A.uls_step_event(4.0, 0.01), 100)
    res = {f: GP.group_privacy_epsilon(ex, 4, 1e-6, form=f) for f in "abc"}
    assert res["a"].epsilon <= res["b"].epsilon <= res["c"].epsilon
    tight = A.epsilon(A.compose(A.els_step_event(4.0, 0.01, 4), 100), 1e-6, value_discretization_interval=1e-3)
    assert tight < res["a"].epsilon


def test_bad_form_and_inputs():
    with pytest.raises(UserError):
        GP.group_delta(1.0, 1e-6, 2, "d")
    with pytest.raises(UserError):
        GP.group_delta(1.0, 1e-6, 0)
    with pytest.raises(UserError):
        GP.group_privacy_epsilon(A.uls_step_event(1.0, 0.1), 2, 1e-6, form="z")


def test_theorem1_split_roundtrip_and_values():
    z_u = AC.update_noise_multiplier(1.0, 5.0)
    assert z_u == pytest.approx(1.00504, abs=5e-6)  # SPEC A1
    for z, sb in [(0.5, 3.0), (2.0, 1.1), (1.0, 0.51)]:
        zu = AC.update_noise_multiplier(z, sb)
        assert zu > z
        assert AC.effective_noise_multiplier(zu, sb) == pytest.approx(z, rel=1e-12)
    # effective is below both the update multiplier and 2*sigma_b
    assert AC.effective_noise_multiplier(3.0, 1.0) < min(3.0, 2.0)


@pytest.mark.parametrize("z,sb", [(1.0, 0.5), (2.0, 0.9), (1.0, 0.0), (0.0, 5.0), (-1.0, 5.0)])
def test_theorem1_refuses_impossible_splits(z, sb):
    with pytest.raises(UserError):
        AC.update_noise_multiplier(z, sb)
