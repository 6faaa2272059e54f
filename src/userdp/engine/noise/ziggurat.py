"""Standard normals from a keyed stream of 32-bit words: numpy's float32 ziggurat, compiled by numba.

Why by hand: numpy's ``Generator.standard_normal`` is the ziggurat of Marsaglia and Tsang (2000)
over its own bit generators only (9.7-13 ns a normal a thread on the CI's CPU: at 124M parameters,
the largest part of a small CPU step's cost beyond the non-private step's). No maintained library
draws numpy's normals from the words of a cipher the CPU accelerates (AES-256 in counter mode,
through OpenSSL: about 0.9 ns for the 4 bytes of a normal). This module is numpy's float32 algorithm,
step for step, compiled by numba (``nogil``: the source's threads fill their blocks at once), with its
tables computed here by Marsaglia and Tsang's recursion (256 layers, ``r = 3.6541528853610088``,
``v = 0.00492867323399``) and the same arithmetic in the same precision:

* **the fast path**, for every word: 8 bits choose a layer, 1 bit the sign, 23 bits the position;
  ``x = rabs · w[layer]`` is accepted where ``rabs < k[layer]`` (99.3% of words);
* **the wedge** of layers 1-255, one more word: accepted where ``(f[i-1] − f[i]) u + f[i] <
  exp(−x²/2)``; a rejected word starts over with the next word;
* **the tail** beyond ``r`` for layer 0 (Marsaglia's exponential method), two uniforms an attempt,
  repeated until accepted. Here alone this kernel departs from numpy, on purpose: numpy's uniforms
  have 24 bits, so its float32 normals never exceed ``r + 24 ln 2 / r = 8.21`` (:data:`NUMPY_MAX`);
  a Gaussian mechanism whose noise stops there is not the one accounted (the mass it drops, 2.3e-16 a
  normal, would add steps × d × 2.3e-16 × (1 + e^ε) to δ: 7e-4 at d = 10⁶, 1,000 steps, ε = 8). This
  kernel draws the tail's uniforms from 85 bits (three words each, in float64), so it reaches
  :data:`TAIL_MAX` = 14.57, beyond which a normal has mass 2Φ(−14.57) ≈ 4e-48: below 1e-30 · (1 + e^ε)
  for any run of up to 10¹⁸ normals, far under float64's resolution of any δ a run states.

Words are consumed one normal at a time, in numpy's order, so a draw's numbers do not depend on how it
is split into pieces; with numpy's tail (``numpy_tail=True``) and over PCG64DXSM's words :func:`fill`
gives ``Generator.standard_normal(dtype=float32)`` bit for bit (tests/engine/test_ziggurat.py). The
kernel takes two passes over a block of words (:mod:`~userdp.engine.noise.ziggurat_kernel`): every
word's fast-path value without a branch (vectorized), then the normals in order, a run of accepted
words a copy and a rejected word the slow path; the same numbers as one pass that branches on every
word. On words it has not seen, 2.0-2.5 ns a normal against numpy's 10.5-12.4 (one thread,
interleaved in one process, this 2-core AMD EPYC: ``python benchmarks/bench_noise.py``); the same
words again and again flatter it by 20-40% (a branch predictor learns where a block's rejects are).
"""

from __future__ import annotations

import math
from importlib import import_module

import numpy as np

LAYERS = 256
R = 3.6541528853610088  # where the tail begins
_V = 0.00492867323399  # the area of each layer
_BITS = 23  # bits of a word's position in its layer


def _tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(k as uint32, w as float32, f as float32) of the 256-layer ziggurat (Marsaglia and Tsang's
    recursion in float64, then rounded as numpy's float tables are)."""
    m1 = float(1 << _BITS)
    dn = tn = R
    q = _V / math.exp(-0.5 * dn * dn)
    k, w, f = np.zeros(LAYERS), np.zeros(LAYERS), np.zeros(LAYERS)
    k[0], w[0], w[-1] = (dn / q) * m1, q / m1, dn / m1
    f[0], f[-1] = 1.0, math.exp(-0.5 * dn * dn)
    for i in range(LAYERS - 2, 0, -1):
        dn = math.sqrt(-2.0 * math.log(_V / dn + math.exp(-0.5 * dn * dn)))
        k[i + 1] = (dn / tn) * m1
        tn = dn
        f[i] = math.exp(-0.5 * dn * dn)
        w[i] = dn / m1
    return np.floor(k).astype(np.uint32), w.astype(np.float32), f.astype(np.float32)


K, W, F = _tables()
R32, INV_R32 = np.float32(R), np.float32(1.0 / R)
#: the largest normal numpy's float32 tail can give: r + 24 ln 2 / r (its uniforms have 24 bits)
NUMPY_MAX = R + 24 * math.log(2) / R
#: the largest this tail can give: r + sqrt(2 · 86 ln 2) (an attempt at x is accepted with probability
#: exp(-x²/2), and the acceptance uniform is at least 2^-86); beyond it, 2 Φ(-14.57) ≈ 4e-48 a normal
TAIL_MAX = R + math.sqrt(2 * 86 * math.log(2))


_KERNEL = None


def _kernel():
    """The compiled kernel's module: numba, imported on the first draw (once: a draw calls
    :func:`fill` once a piece, and holds the GIL while it looks a module up)."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = import_module("userdp.engine.noise.ziggurat_kernel")
    return _KERNEL


def new_scratch() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What :func:`fill` works in (``scratch=``): a block's values, accept flags and reject positions
    (:data:`~userdp.engine.noise.ziggurat_kernel.BLOCK` words), kept by a stream and reused."""
    block = _kernel().BLOCK
    return np.empty(block, np.float32), np.empty(block, np.uint8), np.empty(block, np.int32)


def fill(words: np.ndarray, out: np.ndarray, numpy_tail: bool = False, scratch=None) -> int:
    """``out`` (float32, contiguous) filled with standard normals from uint32 ``words``, one normal at a
    time in numpy's order; returns the words used, or -1 where ``words`` ran out first (then ``out``
    holds nothing of use: call again from the same position with more words). ``numpy_tail``: draw
    the tail as numpy does (24-bit uniforms: nothing beyond :data:`NUMPY_MAX`; for the test that this
    is numpy's algorithm) instead of from 85-bit uniforms (see the module docstring). ``scratch``:
    from :func:`new_scratch`, kept by the caller across calls (None: new for this call)."""
    return int(_kernel().fill(words, out, bool(numpy_tail), *(new_scratch() if scratch is None else scratch)))
