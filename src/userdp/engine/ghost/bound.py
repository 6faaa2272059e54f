"""What bounds a unit's contribution: per parameter its norm estimate and the proven upper bound on
what the unit adds to the clipped sum (:class:`Bound`, :func:`bounded_norms`; docs/guarantee.md,
"Ghost norms: the bound")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from userdp.engine.ghost.factors import coefficients, spreads
from userdp.engine.rounding import gamma

#: the clip factor is taken from a proven upper bound on what a unit adds, not from its estimated
#: norm (docs/guarantee.md, "Ghost norms: the bound"): the Gram-form norm plus the bound on its
#: rounding error, plus the bound on the rounding of the unit's own terms in the clipped sum.
#: BOUND = False takes the factor from the estimate alone (the pre-0.4 behaviour: a unit whose
#: per-token terms cancel could then add up to 3x C); only tests set it, to show that.
BOUND = True


@dataclass
class Bound:
    """One parameter's per-unit norm estimate and what bounds a unit's contribution (float64 ``[m]``):
    ``value`` the computed squared norm, ``err`` the bound on its rounding error (None: exact to
    2^-53), ``magnitude`` ``Σ_uses Σ_t |x_t||y_t|`` of its factored uses, ``length`` the longest
    contraction its clipped sum takes (m·T), ``u`` the unit roundoff, ``size`` the norm of its
    materialized part (None: none), ``operand`` the relative rounding of its clipped sum's operand
    entries (:data:`~userdp.engine.contraction.ROUNDED_OPERAND_U` for the rounded tensor-core operand, else 0:
    exact) and
    ``spread`` what that rounding is a share of: the terms of the uses whose operand is rounded, their
    :func:`~userdp.engine.ghost.grams.spread` summed (:func:`spreads`; needed when ``operand`` is not 0)."""

    value: torch.Tensor
    err: torch.Tensor | None
    magnitude: torch.Tensor | None
    length: int
    u: float
    size: torch.Tensor | None
    operand: float = 0.0
    spread: list | None = None


def bounded_norms(parts: list, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(estimate, upper)``, float64 ``[m, L]``: per unit and parameter the estimated norm and a
    proven upper bound on the norm of what the unit adds to the clipped sum at factor 1:
    ``sqrt(value + err)`` bounds the exact norm of the unit's gradient (built from the stored
    factors), and ``(gamma_K + 2u)(1 + r) · magnitude + r · spread + (gamma_m + u) · size`` bounds the
    rounding of the unit's own terms in the sum (a K-term contraction perturbs each term by at most
    gamma_K, and a rounded operand's terms are at most 1 + r times the exact ones; an operand entry
    rounded to bf16 moves by at most r = 2^-8 of itself, which moves the unit's sum by at most
    r · spread, :func:`~userdp.engine.ghost.grams.spread`).
    All parameters at once: a few kernels per chunk, not a few per parameter."""
    value = torch.stack([b.value for b in parts], dim=1).clamp(min=0)
    est = value.sqrt()
    if not BOUND:  # the estimate alone (tests only: shows what the bound closes)
        return est, est * (1.0 + 256 * 2.0**-23)
    zero = torch.zeros_like(parts[0].value)
    err = torch.stack([zero if b.err is None else b.err for b in parts], dim=1)
    mag = torch.stack([zero if b.magnitude is None else b.magnitude for b in parts], dim=1)
    size = torch.stack([zero if b.size is None else b.size for b in parts], dim=1)
    c_sum = coefficients(
        tuple((gamma(b.length, b.u) + 2.0 * b.u) * (1.0 + b.operand) if b.length else 0.0 for b in parts), value.device
    )
    c_dense = coefficients(tuple(gamma(m, b.u) + b.u for b in parts), value.device)
    # 2^-40: the float64 square root and sums; the rest is what the float32 arithmetic may move
    upper = (value + err).sqrt() * (1.0 + 2.0**-40) + mag * c_sum + size * c_dense
    if any(b.operand for b in parts):
        spread = spreads([b.spread if b.operand else [] for b in parts], m).t()
        upper = upper + spread * coefficients(tuple(b.operand for b in parts), value.device)
    return est, upper
