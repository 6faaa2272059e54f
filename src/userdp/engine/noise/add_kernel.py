"""The host noise's last step, compiled by numba (``nogil``, cached on disk): ``dst += z · scale`` in
float32, in one pass, apart so that importing userdp does not import numba.

Why by hand: torch adds a scaled piece in two passes (``z.mul_(std)``, then ``dst.add_(z)``), each
over the whole piece, and from the noise's own threads each of those ops may start a team of
torch's intra-op threads of its own. This loop reads ``z`` once, where the ziggurat has just
written it (in the core's cache), and stays on its thread. The numbers are torch's: the product is
rounded to float32, then the sum (two roundings, no fused multiply-add: numba contracts no
floating-point operation unless asked), and ``scale`` is the float32 torch rounds a Python float
multiplier to (tests/engine/test_noise.py holds the two to each other bit for bit)."""

from __future__ import annotations

import numba


@numba.njit(nogil=True, cache=True)
def scale_add(dst, z, scale):  # pragma: no cover - compiled
    """``dst[i] += z[i] · scale`` for every ``i`` (float32 arrays of one length; ``scale`` a float32)."""
    for i in range(z.shape[0]):
        dst[i] += z[i] * scale
