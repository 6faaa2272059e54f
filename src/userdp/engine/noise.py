"""Gaussian noise on the SUM of clipped unit updates, drawn once per step for the whole sum.

The generator is seeded from the operating system's entropy unless the caller gives a seed;
a seeded run is reproducible and the privacy record says so (anyone holding the seed can
recompute the noise, so the guarantee then holds only against those who do not).
"""

from __future__ import annotations

import secrets
from typing import Optional, Sequence

import torch


def make_generator(seed: Optional[int], device: torch.device | str = "cpu") -> torch.Generator:
    """A torch.Generator seeded with ``seed``, or with 63 bits from os entropy when None."""
    g = torch.Generator(device=device)
    g.manual_seed(int(seed) if seed is not None else secrets.randbits(63))
    return g


def gaussian_like(tensors: Sequence[torch.Tensor], std: float, generator: torch.Generator) -> list[torch.Tensor]:
    """One draw of N(0, std^2 I) over the concatenation of ``tensors``, split back per tensor.

    Every coordinate gets noise (also coordinates whose gradient is zero: SPEC §3.10).
    """
    if not tensors:
        return []
    total = sum(t.numel() for t in tensors)
    ref = tensors[0]
    z = torch.randn(total, generator=generator, dtype=ref.dtype, device=generator.device)
    z = z.to(ref.device) * std
    out, i = [], 0
    for t in tensors:
        out.append(z[i : i + t.numel()].view_as(t))
        i += t.numel()
    return out


def gaussian_scalar(std: float, generator: torch.Generator) -> float:
    """One draw of N(0, std^2) (the adaptive-clipping count query)."""
    return float(torch.randn((), generator=generator, dtype=torch.float64, device=generator.device).cpu()) * std
