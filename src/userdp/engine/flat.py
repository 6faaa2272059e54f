"""Where noise lands: flat views over a list of tensors, and a streamed draw added piece by piece.

Both Gaussian sources (``noise.GaussianNoise`` on the host, ``chacha.ChaChaNoise`` on the device)
add one flat draw over the concatenation of a model's gradient tensors without materialising a
model-sized noise buffer (but for the host source's draw made ahead on a CPU,
``GaussianNoise.prefetch``); these helpers are what they share.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch


def check_wide(tensors: Sequence[torch.Tensor]) -> None:
    """Noise is added in float32 or wider, never below (a privacy rule: a bf16 sum would round
    the noise's low-order bits away).

    Raises:
        ValueError: a tensor narrower than float32."""
    for t in tensors:
        if t.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"noise is added to float32 or float64 tensors only, not {t.dtype}")


def flat_views(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Flat views of contiguous ``tensors`` and the offsets of each in their concatenation."""
    offsets = [0]
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("noise is added in place to contiguous tensors only")
        offsets.append(offsets[-1] + t.numel())
    return [t.view(-1) for t in tensors], offsets


def add_piece(flats: Sequence[torch.Tensor], offsets: Sequence[int], z: torch.Tensor, lo: int) -> None:
    """Add ``z``, the piece ``[lo, lo + len(z))`` of one flat draw over the concatenation of
    ``flats``, into the tensors it covers (converted to each one's device and dtype: float32 or
    float64). The draws stream through such pieces, so no model-sized noise buffer exists."""
    hi, start = lo + z.numel(), lo
    j = bisect.bisect_right(offsets, lo) - 1
    while lo < hi:
        end = min(hi, offsets[j + 1])
        seg = flats[j][lo - offsets[j] : end - offsets[j]]
        seg.add_(z[lo - start : end - start].to(seg.device, dtype=seg.dtype))
        lo, j = end, j + 1


def zeros_for_noise(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Zeros shaped like ``tensors`` on their devices, in float32 (float64 for a float64 tensor)."""
    return [torch.zeros(t.shape, device=t.device, dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)
            for t in tensors]
