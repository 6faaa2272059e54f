"""The compiled kernel of :mod:`userdp.engine.noise.ziggurat` (numba, ``nogil``, cached on disk):
apart, so that importing userdp does not import numba; the first draw of a process does."""

from __future__ import annotations

import math

import numba
import numpy as np

from userdp.engine.noise.ziggurat import INV_R32, R32, F, K, W


@numba.njit(nogil=True, cache=True)
def _open_uniform(a, b, c):  # pragma: no cover - compiled
    """A uniform in (0, 1) from 85 bits of three words (27 + 26 + 32), never 0: at least 2^-86."""
    hi = np.float64((a >> np.uint32(5)) * np.uint64(67108864) + (b >> np.uint32(6)))
    return (hi + (np.float64(c) + 0.5) / 4294967296.0) / 9007199254740992.0


@numba.njit(nogil=True, cache=True)
def fill(words, out, numpy_tail):  # pragma: no cover - compiled (the tables are its constants)
    k, w, f, r32, inv_r32 = K, W, F, R32, INV_R32
    p = 0
    nw = words.shape[0]
    bits = out.view(np.uint32)
    scale = np.float32(1.0 / 16777216.0)
    for i in range(out.shape[0]):
        while True:
            if p >= nw:
                return -1
            r = words[p]
            p += 1
            layer = r & 0xFF
            rabs = (r >> 9) & 0x7FFFFF
            x = np.float32(rabs) * w[layer]
            if rabs < k[layer]:  # the fast path: the sign is bit 8 of the word, set as the float's sign bit
                out[i] = x
                bits[i] = bits[i] | ((r & np.uint32(0x100)) << np.uint32(23))
                break
            if (r >> 8) & 1:
                x = -x
            if layer == 0:  # the tail beyond r (Marsaglia's method): two uniforms an attempt
                while True:
                    if numpy_tail:  # numpy's: 24-bit uniforms, so no value beyond r + 24 ln 2 / r = 8.21
                        if p + 2 > nw:
                            return -1
                        xx = -inv_r32 * np.float32(math.log1p(-(np.float32(words[p] >> 8) * scale)))
                        yy = -np.float32(math.log1p(-(np.float32(words[p + 1] >> 8) * scale)))
                        p += 2
                        ok = yy + yy > xx * xx
                        v = r32 + xx
                    else:  # 85-bit uniforms in float64 (three words each): the tail reaches 14.6
                        if p + 6 > nw:
                            return -1
                        x64 = -math.log(_open_uniform(words[p], words[p + 1], words[p + 2])) / np.float64(r32)
                        y64 = -math.log(_open_uniform(words[p + 3], words[p + 4], words[p + 5]))
                        p += 6
                        ok = y64 + y64 > x64 * x64
                        v = np.float32(np.float64(r32) + x64)
                    if ok:
                        out[i] = -v if (rabs >> 8) & 1 else v
                        break
                break
            if p >= nw:
                return -1
            u = np.float32(words[p] >> 8) * scale
            p += 1
            if np.float64((f[layer - 1] - f[layer]) * u + f[layer]) < math.exp(-0.5 * np.float64(x) * np.float64(x)):
                out[i] = x
                break
    return p
