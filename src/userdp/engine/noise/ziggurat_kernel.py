"""The compiled kernel of :mod:`userdp.engine.noise.ziggurat` (numba, ``nogil``, cached on disk):
apart, so that importing userdp does not import numba; the first draw of a process does.

Two passes over a piece's words, the same numbers as one (the tests hold it to numpy's, bit for bit):

1. every word's fast-path value, as if a normal began at it, and whether the fast path accepts it
   (:func:`_fast_values`: no branch, so the compiler vectorizes it);
2. the positions the fast path rejects, found eight at a time (:func:`_rejected`), then the normals
   in numpy's order: each run of accepted words is one block copy of their values, and a rejected
   word takes the slow path (:func:`_slow`: the wedge, the tail), which may use the words after it;
   the next run starts where it stopped.

The words are taken a block (:data:`BLOCK`) at a time, so a block's values and flags stay in the
core's cache however long the draw. A run of accepted words is copied by a loop over two views,
which numba vectorizes; its slice assignment (``out[a:b] = xs[c:d]``) went element by element through
numba's general setitem, and cost a fifth of the kernel (2.5 against 2.0 ns a normal, on words the
kernel had not seen)."""

from __future__ import annotations

import math

import numba
import numpy as np

from userdp.engine.noise.ziggurat import INV_R32, R32, F, K, W

#: the fast path's bounds as int32 (all below 2^23): a signed compare, in vector lanes
_K32 = K.astype(np.int32)
_ALL_ACCEPTED = np.uint64(0x0101010101010101)  # eight accept flags of 1, read as one word
#: words a block (a multiple of 8): its values, flags and rejects, 144 KB, stay in a core's cache
BLOCK = 1 << 14


@numba.njit(nogil=True, cache=True)
def _open_uniform(a, b, c):  # pragma: no cover - compiled
    """A uniform in (0, 1) from 85 bits of three words (27 + 26 + 32), never 0: at least 2^-86."""
    hi = np.float64((a >> np.uint32(5)) * np.uint64(67108864) + (b >> np.uint32(6)))
    return (hi + (np.float64(c) + 0.5) / 4294967296.0) / 9007199254740992.0


@numba.njit(nogil=True, cache=True, inline="always")
def _word(r):  # pragma: no cover - compiled
    """``(layer, rabs, x)`` of a word: 8 bits choose the layer, 1 bit the sign, 23 bits the position
    ``rabs``; ``x = ± rabs · w[layer]``, the fast path's value (accepted where ``rabs < k[layer]``)."""
    layer = np.int32(r & np.uint32(0xFF))
    rabs = np.int32((r >> np.uint32(9)) & np.uint32(0x7FFFFF))
    x = np.float32(rabs) * W[layer]
    return layer, rabs, (-x if (r & np.uint32(0x100)) != 0 else x)  # negation sets the sign bit: -0.0 too


@numba.njit(nogil=True, cache=True)
def _fast_values(words, xs, acc):  # pragma: no cover - compiled
    """For every word, as if a normal began at it: ``xs[p]`` its fast-path value (:func:`_word`),
    ``acc[p]`` 1 where the fast path accepts it (no branch: the loop is vectorized)."""
    k = _K32
    for p in range(words.shape[0]):
        layer, rabs, xs[p] = _word(words[p])
        acc[p] = np.uint8(rabs < k[layer])


@numba.njit(nogil=True, cache=True)
def _rejected(acc, rej):  # pragma: no cover - compiled
    """The positions where ``acc`` is 0, in order, into ``rej``; returns their count (``acc``'s
    length a multiple of 8: eight flags are read as one word, and ~98% of words are all ones)."""
    flags = acc.view(np.uint64)
    count = 0
    for q in range(flags.shape[0]):
        if flags[q] != _ALL_ACCEPTED:
            for b in range(8):
                if acc[8 * q + b] == 0:
                    rej[count] = 8 * q + b
                    count += 1
    return count


@numba.njit(nogil=True, cache=True)
def _slow(words, p, numpy_tail):  # pragma: no cover - compiled
    """``(value, next)``: the normal whose first word, at ``p``, the fast path rejected, and the word
    after the last it used; ``next`` is -1 where the words ran out. The wedge of layers 1-255 takes one
    more word; a rejected word starts over with the next word (fast path included); layer 0 takes
    the tail (two uniforms an attempt)."""
    k, f, r32, inv_r32 = _K32, F, R32, INV_R32
    nw = words.shape[0]
    scale = np.float32(1.0 / 16777216.0)
    while True:
        if p >= nw:
            return np.float32(0.0), -1
        layer, rabs, x = _word(words[p])
        p += 1
        if rabs < k[layer]:  # the fast path, for a word after a rejected one
            return x, p
        if layer == 0:  # the tail beyond r (Marsaglia's method): two uniforms an attempt
            while True:
                if numpy_tail:  # numpy's: 24-bit uniforms, so no value beyond r + 24 ln 2 / r = 8.21
                    if p + 2 > nw:
                        return np.float32(0.0), -1
                    xx = -inv_r32 * np.float32(math.log1p(-(np.float32(words[p] >> 8) * scale)))
                    yy = -np.float32(math.log1p(-(np.float32(words[p + 1] >> 8) * scale)))
                    p += 2
                    ok = yy + yy > xx * xx
                    v = r32 + xx
                else:  # 85-bit uniforms in float64 (three words each): the tail reaches 14.6
                    if p + 6 > nw:
                        return np.float32(0.0), -1
                    x64 = -math.log(_open_uniform(words[p], words[p + 1], words[p + 2])) / np.float64(r32)
                    y64 = -math.log(_open_uniform(words[p + 3], words[p + 4], words[p + 5]))
                    p += 6
                    ok = y64 + y64 > x64 * x64
                    v = np.float32(np.float64(r32) + x64)
                if ok:
                    return (-v if (rabs >> 8) & 1 else v), p
        if p >= nw:
            return np.float32(0.0), -1
        u = np.float32(words[p] >> 8) * scale
        p += 1
        if np.float64((f[layer - 1] - f[layer]) * u + f[layer]) < math.exp(-0.5 * np.float64(x) * np.float64(x)):
            return x, p


@numba.njit(nogil=True, cache=True)
def fill(words, out, numpy_tail, xs, acc, rej):  # pragma: no cover - compiled
    """:func:`userdp.engine.noise.ziggurat.fill` in its scratch: ``xs`` float32, ``acc`` uint8, ``rej``
    int32, each of :data:`BLOCK` elements (:func:`userdp.engine.noise.ziggurat.new_scratch`). The
    words are taken a block at a time, so the block's values and flags stay in the core's cache
    however long the draw."""
    nw = words.shape[0]
    n = out.shape[0]
    i = p = 0
    while i < n:
        if p >= nw:
            return -1
        base = p
        stop = min(p + BLOCK, nw)  # this block: words [base, stop)
        m = stop - base
        padded = (m + 7) // 8 * 8
        _fast_values(words[base:stop], xs[:m], acc[:m])
        acc[m:padded] = 1  # past the words: no rejects to find
        n_rej = _rejected(acc[:padded], rej)
        j = 0
        while i < n and p < stop:
            while j < n_rej and base + rej[j] < p:  # rejects among words a slow path used are no starts
                j += 1
            end = base + rej[j] if j < n_rej else stop
            take = min(end - p, n - i)  # words p .. end - 1 each begin, and are, one normal
            # a loop over two views, not ``out[a:b] = xs[c:d]``: numba's slice assignment goes through
            # its general setitem (0.55-0.8 ns a number); this loop is vectorized (0.27)
            dst, src = out[i : i + take], xs[p - base : p - base + take]
            for q in range(take):
                dst[q] = src[q]
            i += take
            p += take
            if i >= n or p >= stop:
                break
            v, p = _slow(words, p, numpy_tail)  # may read past the block: the next begins where it stops
            if p < 0:
                return -1
            out[i] = v
            i += 1
    return p
