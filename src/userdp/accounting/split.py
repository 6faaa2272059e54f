"""Theorem 1 of Andrew et al. (Andrew et al. 2021, Theorem 1): the noise split of adaptive quantile clipping.

One DP-FedAvg step with vector noise multiplier z_Δ and count noise σ_b (on the count of
unclipped updates, sensitivity 1/2 after centering) is, for accounting, one non-adaptive step
with effective multiplier

    z = (z_Δ^-2 + (2σ_b)^-2)^(-1/2),

and to reach an effective z one applies z_Δ = (z^-2 − (2σ_b)^-2)^(-1/2), which exists only
when 2σ_b > z. The adaptive clipping *update rule* lives in ``userdp.engine.clipping``.
"""

from __future__ import annotations

from userdp.errors import UserError
from userdp.validation import check_positive

__all__ = ["effective_noise_multiplier", "update_noise_multiplier"]


def _positive(name: str, value: float) -> float:
    return check_positive(value, name)


def effective_noise_multiplier(update_z: float, count_stddev: float) -> float:
    """z from the update multiplier z_Δ and the count-noise std σ_b: (z_Δ^-2 + (2σ_b)^-2)^-1/2."""
    z_u = _positive("update noise multiplier", update_z)
    s_b = _positive("count noise stddev", count_stddev)
    return (z_u**-2 + (2.0 * s_b) ** -2) ** -0.5


def update_noise_multiplier(effective_z: float, count_stddev: float) -> float:
    """z_Δ that gives an effective multiplier z with count noise σ_b; needs 2σ_b > z."""
    z = _positive("noise multiplier", effective_z)
    s_b = _positive("count noise stddev", count_stddev)
    if 2.0 * s_b <= z:
        raise UserError(
            f"count noise stddev {s_b:g} is too small for noise multiplier {z:g}: adaptive "
            f"clipping needs 2*count_noise_stddev > noise_multiplier (got {2 * s_b:g} <= {z:g})"
        )
    return (z**-2 - (2.0 * s_b) ** -2) ** -0.5
