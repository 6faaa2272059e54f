"""How many bands of matrix-factorization noise a ULS run should use (docs/plan.md): the b whose
noise, at the noise multiplier its own accounting needs, puts the least noise into the model.

SGD's model after t steps is the start minus the learning rate times the prefix sum of the released
updates, so the noise a run leaves in its models is the noise of the prefix sums: with strategy C
and multiplier σ_b it is ``σ_b² · ‖A C⁻¹‖_F² / T`` per coordinate on average over the T models
(A the all-ones lower-triangular prefix-sum matrix; Choquette-Choo et al. 2023 choose b the same
way). C⁻¹ is lower-triangular Toeplitz, so ``A C⁻¹`` is too, with coefficients the running sums of
C⁻¹'s: the figure costs O(T·b), not a T×T matrix. σ_b is calibrated to (ε, δ) under cyclic Poisson
sampling over b groups at the same expected cohort (ceil(T/b) compositions at q·b); b = 1 is ULS
with independent noise. Larger b correlates more noise away but pays for it in amplification, so
the choice depends on how many times a user takes part (T·q) and on ε.

The figure is a model of the noise, not of the loss: docs/results.md measures the held-out loss
(the head-to-head), where the two can disagree.
"""

from __future__ import annotations

import numpy as np

from userdp import accounting
from userdp.engine.noise.bandmf import bsr_coefficients
from userdp.errors import UserError

#: the band counts tried (each calibrated once: about a second with the PLD accountant)
CANDIDATES = (1, 2, 4, 8, 16, 32, 64)


def prefix_noise(coefficients, steps: int) -> float:
    """``‖A C⁻¹‖_F² / T`` for the b-banded Toeplitz C with ``coefficients`` over ``steps`` steps: the
    mean squared noise of the prefix sums per coordinate at σ = 1 ((T + 1) / 2 for C = I)."""
    c = np.asarray(coefficients, dtype=np.float64)
    t = int(steps)
    d = np.zeros(t)  # C⁻¹'s coefficients: the inverse series of c
    d[0] = 1.0 / c[0]
    for k in range(1, t):
        j = np.arange(1, min(k, len(c) - 1) + 1)
        d[k] = -float(np.dot(c[j], d[k - j])) / c[0] if len(j) else 0.0
    e = np.cumsum(d)  # A C⁻¹'s coefficients
    return float(np.dot(np.arange(t, 0, -1), e**2) / t)


def choose_bands(
    sampling_rate: float, steps: int, epsilon: float, delta: float, accountant: str = "pld", candidates=CANDIDATES
) -> dict:
    """The band count b of least prefix-sum noise for ULS at ``sampling_rate`` over ``steps`` steps at
    (``epsilon``, ``delta``), among ``candidates`` with q·b <= 1 and b <= T.

    Returns:
        ``{"bands": b, "rows": [{"bands", "noise_multiplier", "prefix_noise", "relative"}...],
        "why": ...}`` (``relative``: the row's noise over independent noise's, b = 1).

    Raises:
        UserError: the target cannot be met even at b = 1 (calibration's message)."""
    rows = []
    for b in candidates:
        if b > steps or sampling_rate * b > 1.0:
            continue
        mech = accounting.Mechanism("uls_cyclic", 1.0, steps, sampling_rate=sampling_rate, bands=b)
        try:
            sigma = mech.calibrated(epsilon, delta, accountant).noise_multiplier
        except UserError:
            if b == 1:
                raise
            continue
        rows.append(
            {"bands": b, "noise_multiplier": sigma, "prefix_noise": sigma**2 * prefix_noise(bsr_coefficients(b), steps)}
        )
    base = rows[0]["prefix_noise"]
    for r in rows:
        r["relative"] = r["prefix_noise"] / base
    best = min(rows, key=lambda r: r["prefix_noise"])
    participations = steps * sampling_rate
    why = (
        f"b = {best['bands']}: {1 - best['relative']:.0%} less prefix-sum noise than independent noise "
        f"(sigma {best['noise_multiplier']:.3g} against {rows[0]['noise_multiplier']:.3g}; a user takes part "
        f"{participations:.3g} times on average)"
        if best["bands"] > 1
        else f"b = 1 (independent noise): at {participations:.3g} participations a user on average, the "
        "amplification cyclic groups give up costs more noise than the bands cancel"
    )
    return {"bands": best["bands"], "rows": rows, "why": why}
