"""Where noise lands: flat views over a list of tensors, and a streamed draw added piece by piece.

Both Gaussian sources (``noise.GaussianNoise`` on the host, ``chacha.ChaChaNoise`` on the device)
add one flat draw over the concatenation of a model's gradient tensors without materialising a
model-sized noise buffer (but for the host source's draw made ahead on a CPU,
``GaussianNoise.prefetch``); these helpers are what they share.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from importlib import import_module

import numpy as np
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
    for seg, a, b in _segments(flats, offsets, lo, z.numel()):
        seg.add_(z[a:b].to(seg.device, dtype=seg.dtype))


def add_scaled(flats: Sequence[torch.Tensor], offsets: Sequence[int], z: np.ndarray, std: float, lo: int) -> None:
    """:func:`add_piece` of ``torch.from_numpy(z).mul_(std)``, the same numbers, without changing ``z``:
    where ``z`` and a tensor it covers are float32 and on the host, one compiled pass over the two
    (:func:`userdp.engine.noise.add_kernel.scale_add`: the product rounded to float32, then the sum,
    as torch rounds them); elsewhere (a float64 draw, a tensor on a device) torch's ops."""
    scale = np.float32(std)  # what torch multiplies a float32 tensor by, for a Python float
    for seg, a, b in _segments(flats, offsets, lo, z.size):
        if z.dtype == np.float32 and seg.dtype == torch.float32 and seg.device.type == "cpu":
            _add_kernel().scale_add(seg.detach().numpy(), z[a:b], scale)
        else:
            seg.add_(torch.from_numpy(z[a:b]).mul(float(std)).to(seg.device, dtype=seg.dtype))


def _segments(flats: Sequence[torch.Tensor], offsets: Sequence[int], lo: int, n: int):
    """Where the piece ``[lo, lo + n)`` of a flat draw lands: ``(segment, a, b)`` for each tensor it
    covers, the segment a view of that tensor and ``[a, b)`` the piece's own positions there."""
    hi, start = lo + n, lo
    j = bisect.bisect_right(offsets, lo) - 1
    while lo < hi:
        end = min(hi, offsets[j + 1])
        yield flats[j][lo - offsets[j] : end - offsets[j]], lo - start, end - start
        lo, j = end, j + 1


_ADD_KERNEL = None


def _add_kernel():
    """:mod:`userdp.engine.noise.add_kernel` (numba), imported on the first host draw (once: a draw
    calls it a piece at a time, from its threads)."""
    global _ADD_KERNEL
    if _ADD_KERNEL is None:
        _ADD_KERNEL = import_module("userdp.engine.noise.add_kernel")
    return _ADD_KERNEL


def zeros_for_noise(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Zeros shaped like ``tensors`` on their devices, in float32 (float64 for a float64 tensor)."""
    return [
        torch.zeros(t.shape, device=t.device, dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)
        for t in tensors
    ]


class DrawCursor:
    """Reads one flat draw given as ``(offset, piece)`` in increasing order (a source's ``pieces``)
    ``n`` numbers at a time: :meth:`take` returns the next ``n`` as one tensor, each number rounded
    to ``dtype`` as :func:`add_piece` rounds it before adding. What a distribution that scatters
    the draw reads, one parameter at a time, so that no model-sized noise buffer exists."""

    def __init__(self, pieces):
        self._pieces = iter(pieces)
        self._z: torch.Tensor | None = None
        self._at = 0  # position in self._z
        self._pos = 0  # position in the draw

    def take(self, n: int, dtype: torch.dtype, device) -> torch.Tensor:
        out = torch.empty(n, dtype=dtype, device=device)
        filled = 0
        while filled < n:
            if self._z is None or self._at >= self._z.numel():
                lo, self._z = next(self._pieces)
                if lo != self._pos:
                    raise RuntimeError(f"a draw's pieces out of order: {lo} after {self._pos}")
                self._at = 0
            k = min(n - filled, self._z.numel() - self._at)
            out[filled : filled + k] = self._z[self._at : self._at + k]  # the same rounding as z.to(dtype)
            filled, self._at, self._pos = filled + k, self._at + k, self._pos + k
        return out

    def finish(self) -> None:
        """The draw read to its end (its generator then stands where a whole draw leaves it).

        Raises:
            RuntimeError: numbers left over (the reader took fewer than the draw holds)."""
        left = (self._z.numel() - self._at) if self._z is not None else 0
        if left or next(self._pieces, None) is not None:
            raise RuntimeError("a draw was not read to its end")
