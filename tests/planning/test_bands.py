"""`userdp plan`'s choice of bands for banded matrix-factorization noise (userdp.planning.bands): the
prefix-sum noise figure is ‖A C⁻¹‖_F² / T as the dense matrices give it, and the chosen b is the
one of least noise at the σ its own accounting needs."""

import numpy as np
import pytest

from userdp import accounting
from userdp.engine.noise.bandmf import bsr_coefficients, strategy_matrix
from userdp.planning import choose_bands, prefix_noise


@pytest.mark.parametrize("bands,steps", [(1, 12), (3, 20), (8, 30), (30, 30)])
def test_the_prefix_noise_is_the_dense_frobenius_norm(bands, steps):
    c = bsr_coefficients(bands)
    A = np.tril(np.ones((steps, steps)))
    dense = np.linalg.norm(A @ np.linalg.inv(strategy_matrix(c, steps)), "fro") ** 2 / steps
    assert prefix_noise(c, steps) == pytest.approx(dense, rel=1e-10)
    if bands == 1:
        assert prefix_noise(c, steps) == pytest.approx((steps + 1) / 2)


def test_the_choice_is_the_least_noise_at_each_bands_own_sigma():
    q, steps, eps, delta = 16 / 5400, 80, 3.0, 1e-6
    got = choose_bands(q, steps, eps, delta)
    rows = {r["bands"]: r for r in got["rows"]}
    assert rows[1]["relative"] == 1.0 and got["bands"] == min(rows, key=lambda b: rows[b]["prefix_noise"])
    for b, r in rows.items():  # each row's sigma meets the target under its own cyclic accounting
        mech = accounting.Mechanism("uls_cyclic", r["noise_multiplier"], steps, sampling_rate=q, bands=b)
        assert mech.epsilon(delta) <= eps + 1e-9
        assert r["prefix_noise"] == pytest.approx(r["noise_multiplier"] ** 2 * prefix_noise(bsr_coefficients(b), steps))
    assert got["bands"] > 1 and "less prefix-sum noise" in got["why"]


def test_many_participations_keep_independent_noise_and_no_group_is_sampled_past_one():
    got = choose_bands(0.2, 500, 3.0, 1e-6)
    assert got["bands"] == 1 and "independent noise" in got["why"]
    assert max(r["bands"] for r in got["rows"]) * 0.2 <= 1.0  # q·b > 1 is never tried
