"""One parameter's clipped, weighted sum from its materialized part and its factored uses."""

from __future__ import annotations

import torch

from userdp.engine.ghost.factors import Factored


def weighted_sum(
    dense: torch.Tensor | None, factored: list[Factored], c: torch.Tensor, p: torch.Tensor
) -> torch.Tensor:
    """``Σ_u c_u · (unit u's gradient of p)`` from its materialized part and its factored uses."""
    wide = c.float() if c.dtype == torch.bfloat16 else c  # a bf16 factor (tensor cores) is exact in float32
    # the first term is the sum's buffer (each term is a fresh tensor): no zeros + add per parameter
    s = torch.tensordot(wide, dense, dims=1).reshape(p.shape).to(wide.dtype) if dense is not None else None
    for x in factored:
        part = x.weighted_sum(c).reshape(p.shape)
        s = part.to(wide.dtype) if s is None else s.add_(part)
    assert s is not None, "a parameter's sum needs a materialized part or a use"
    return s
