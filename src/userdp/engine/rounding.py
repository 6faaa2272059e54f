"""Floating-point rounding bounds for the quantities the guarantee rests on.

A clip factor is only as good as the norm it divides by. Norms and clipped sums are computed in
float32 (float64 for a float64 model; bf16 operands with float32 accumulation on tensor cores), so
each comes with a rounding error; these helpers give the classical worst-case bounds (Higham,
*Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1: an n-term sum or dot product in
any order is off by at most gamma_n times the sum of the magnitudes of its terms) and round a
factor down, never up, when it is narrowed. Written here because no maintained library exposes
them as tensors' bounds; used by :mod:`userdp.engine.ghost` and :mod:`userdp.engine.per_unit`.
"""

from __future__ import annotations

import torch

from userdp.errors import UserError


def unit_roundoff(dtype: torch.dtype, tensor_cores: bool) -> float:
    """The unit roundoff of a contraction's accumulation: 2^-24 (IEEE float32, round to nearest),
    2^-53 (float64), and 2^-23 on tensor cores, whose float32 accumulation may truncate."""
    if dtype == torch.float64:
        return 2.0**-53
    return 2.0**-23 if tensor_cores else 2.0**-24


def gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of an n-term sum or dot product
    in any order of summation (round to nearest; truncation is covered by the doubled u)."""
    nu = n * u
    if nu >= 0.5:
        raise UserError(
            f"a {n}-term contraction is too long for a float rounding bound at u = {u:g}: "
            "lower training.chunk_size (or the sequence length)"
        )
    return nu / (1.0 - nu)


def root_slack(n: int, u: float) -> float:
    """The factor a root of an n-term sum of squares may be low by (gamma_n, the root, the division)."""
    return root_slack_of(gamma(n, u))


def root_slack_of(g: float) -> float:
    """:func:`root_slack` for a sum whose relative rounding is at most ``g``."""
    return ((1.0 + 2.0**-20) / (1.0 - g)) ** 0.5


def round_down_to(c: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``c`` (float64, >= 0) in ``dtype``, never rounded up: a clip factor rounded up would let a
    unit past C by half an ulp."""
    if c.dtype == dtype:
        return c
    out = c.to(dtype)
    return torch.where(out.to(c.dtype) > c, torch.nextafter(out, torch.zeros_like(out)), out)
