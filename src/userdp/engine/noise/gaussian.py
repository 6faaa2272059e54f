"""Gaussian noise on the SUM of clipped unit updates, drawn once per step for the whole sum.

The noise is the privacy mechanism, so its generator is keyed like a secret:

* :class:`GaussianNoise` draws numpy's float32 ziggurat from AES-256 in counter mode
  (:mod:`~userdp.engine.noise.aes`, :mod:`~userdp.engine.noise.ziggurat`), keyed through a
  ``SeedSequence`` whose pool holds 256 bits. Unseeded runs fill
  it from 256 bits of ``os.urandom``; that key is never written anywhere (a checkpoint of an
  unseeded run holds no generator state, and a resumed run draws a fresh key).
* torch's generators are **not** used for noise: the CPU generator keeps only the low 32 bits
  of an integer seed (``manual_seed(s)`` and ``manual_seed(s + (7 << 32))`` give the same
  stream), so anyone who sees two consecutive checkpoints could search 2^32 seeds and
  subtract the noise. The noise is drawn on the host in float32 and moved to the device;
  every device therefore gets the same ≥ 128-bit keying.
* A seeded run (the user gives an integer) derives the key from that seed: reproducible, and
  the guarantee then holds only against parties who do not know the seed (the report says so).
* A draw is filled on the threads torch may use (:func:`noise_threads`), so a thread limit holds
  for the noise too; where asked (:data:`PREFETCH`), a CPU step's draw is begun as the step
  begins and made beside its computation (:meth:`GaussianNoise.prefetch`): the same numbers,
  added once or dropped, never saved.

This module is the *source*: the keyed generator of i.i.d. standard normals. What a step adds
from it (i.i.d. noise, or noise correlated across steps) is the *mechanism*, a stateful transform
of the sum (:mod:`userdp.engine.noise.mechanism`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from userdp.engine.host import free_host_bytes
from userdp.engine.noise import aes, ziggurat
from userdp.engine.noise.chacha import ChaChaNoise
from userdp.engine.noise.flat import add_piece, add_scaled, check_wide, flat_views, zeros_for_noise
from userdp.errors import UserError

ENTROPY_BITS = 256
_POOL_WORDS = ENTROPY_BITS // 32
_STREAMS = 16  # fixed: the noise of a seeded run does not depend on the machine's core count
_PARALLEL_FROM = 1 << 20  # smaller draws are filled in the calling thread
_PIECE = 1 << 20  # normals per host buffer: a thread holds at most 8 MB of noise at a time
_POOL = None
_POOL_THREADS = 0
#: draw a step's noise ahead, in a thread of its own, while the step's sums are computed
#: (:meth:`GaussianNoise.prefetch`): "off" (the default) draws when the sums are ready, on the threads torch
#: may use; "on" draws ahead: one thread more than torch's, worth it only where a core is otherwise idle
#: (a run given fewer torch threads than the machine's cores, on a host it has to itself). The
#: environment's ``USERDP_NOISE_PREFETCH=on|off`` sets it for a process; tests set it directly.
PREFETCH = os.environ.get("USERDP_NOISE_PREFETCH", "off")
_AHEAD = None


def noise_threads() -> int:
    """The threads a draw is filled on: torch's own limit (``torch.set_num_threads``, which follows
    ``OMP_NUM_THREADS``), at most one per stream. A user who limits torch's threads on a shared host
    limits the noise's too."""
    return max(1, min(_STREAMS, torch.get_num_threads()))


def _pool():
    """A thread pool for large noise draws, of :func:`noise_threads` threads (None for one thread);
    rebuilt when torch's thread limit changes."""
    global _POOL, _POOL_THREADS
    threads = noise_threads()
    if threads != _POOL_THREADS:
        if _POOL is not None:
            _POOL.shutdown(wait=True)
        _POOL = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="userdp-noise") if threads > 1 else None
        _POOL_THREADS = threads
    return _POOL


def _ahead_pool():
    """One thread for draws made ahead (:meth:`GaussianNoise.prefetch`, where :data:`PREFETCH` is "on"):
    it draws beside the step's computation, which keeps its own threads; what it has not begun when
    the sums are ready is drawn by the shared pool."""
    global _AHEAD
    if _AHEAD is None:
        _AHEAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="userdp-noise-ahead")
    return _AHEAD


def os_entropy(bits: int = ENTROPY_BITS) -> int:
    """``bits`` bits of operating-system entropy (``os.urandom``) as a non-negative int."""
    return int.from_bytes(os.urandom(bits // 8), "little")


def _seed_sequence(material: int, *, spawn_key: tuple = ()) -> np.random.SeedSequence:
    return np.random.SeedSequence(int(material), spawn_key=spawn_key, pool_size=_POOL_WORDS)


class GaussianNoise:
    """i.i.d. N(0, std²) noise from a ≥ 128-bit keyed generator, always computed in float32+.

    Args:
        key_material: an integer key (≥ 128 bits of entropy for a private run). Use
            :meth:`from_os_entropy` or :meth:`from_seed` rather than calling this directly.
        seeded: whether the key came from a user-given seed (then the noise is reproducible
            by whoever holds the seed, and the state may be checkpointed).
    """

    algorithm = (
        f"{aes.ALGORITHM}; keys from a 256-bit SeedSequence pool; {_STREAMS} child streams (each its own "
        "AES key) fill fixed blocks of each draw, in parallel threads; scalars: numpy PCG64DXSM"
    )

    #: the largest |z| a draw of each dtype can give (its sampler's support): float32, the ziggurat's
    #: 85-bit tail; float64, numpy's float64 ziggurat, whose tail uniforms have 53 bits (an attempt at x
    #: is accepted with probability exp(-x²/2) >= 2^-53). tests/guarantee/test_noise_tails.py holds each
    #: to what δ carries
    max_normal = {"float32": ziggurat.TAIL_MAX, "float64": ziggurat.R + math.sqrt(2 * 53 * math.log(2))}

    def __init__(self, key_material: int, *, seeded: bool):
        self.seeded = bool(seeded)
        root = _seed_sequence(key_material, spawn_key=(0x6E6F697365,))
        self._gen = np.random.Generator(np.random.PCG64DXSM(root))  # scalars
        # A large draw (a 124M-parameter model's noise is 124M normals) is split into _STREAMS fixed
        # blocks, each filled by its own child stream (SeedSequence children of the same 256-bit key
        # give each an AES key of its own: engine/noise/aes.py). The cipher and the ziggurat release the
        # GIL while filling, so the blocks run in parallel; the numbers do not depend on the thread count.
        self._streams = [aes.CipherStream(c) for c in root.spawn(_STREAMS)]
        self._pending: _Pending | None = None

    @classmethod
    def from_os_entropy(cls) -> GaussianNoise:
        """A generator keyed by 256 bits of ``os.urandom`` (never stored)."""
        return cls(os_entropy(), seeded=False)

    @classmethod
    def from_seed(cls, seed: int) -> GaussianNoise:
        """A reproducible generator keyed from a user-given integer seed."""
        return cls(int(seed), seeded=True)

    @staticmethod
    def keying_text(seeded: bool) -> str:
        """How a generator is keyed, for the privacy record."""
        if seeded:
            return "keyed from the user-given seed (reproducible: whoever holds the seed can recompute the noise)"
        return f"keyed by {ENTROPY_BITS} bits of operating-system entropy (os.urandom), never stored"

    # ------------------------------------------------------------------ drawing
    def add_(self, tensors: Sequence[torch.Tensor], std: float, transform=None) -> Sequence[torch.Tensor]:
        """Add one draw of N(0, std² I) over the concatenation of ``tensors`` to them, in place.

        Every coordinate gets noise (also coordinates whose gradient is zero). The draw streams
        through pieces of at most ``_PIECE`` normals, so no model-sized noise buffer is allocated
        (a 124M-parameter model's noise is a 0.5 GB buffer) unless :meth:`prefetch` drew these
        normals ahead; the numbers do not depend on the piece size, the thread count or whether
        they were drawn ahead. Draws are float32 (float64 where a tensor is).

        ``transform(z, lo) -> tensor``: a correlated mechanism's map from the standard normals of
        ``[lo, lo + len(z))`` (a host float tensor it may change in place) to the noise of those
        coordinates before ``std`` scales it (:class:`userdp.engine.noise.bandmf.BandMF`); called once per
        piece, from the pool's threads, on disjoint pieces. None: the normals themselves.

        Returns:
            ``tensors``.

        Raises:
            ValueError: a tensor narrower than float32, or not contiguous.
        """
        if not tensors:
            return tensors
        check_wide(tensors)
        flats, offsets = flat_views(tensors)
        total = offsets[-1]
        dtype = _draw_dtype(t.dtype for t in tensors)
        bounds = _blocks(total)
        pending = self._take_pending(total, dtype)
        if pending is not None:  # this draw's normals were drawn while the sums were computed

            def scaled(k: int) -> None:  # the same arithmetic as below: the piece times std, added in place
                lo, hi = int(bounds[k]), int(bounds[k + 1])
                _add(flats, offsets, pending.buf[lo:hi], lo, std, transform)

            _for_each(scaled, range(_STREAMS))
            return tensors

        def fill(k: int) -> None:  # stream k fills block k of the flat draw, a piece at a time
            lo, hi = int(bounds[k]), int(bounds[k + 1])
            buf = np.empty(min(_PIECE, hi - lo), dtype=dtype)
            while lo < hi:
                out = buf[: min(_PIECE, hi - lo)]
                self._streams[k].standard_normal(out=out, dtype=dtype)
                _add(flats, offsets, out, lo, std, transform)
                lo += out.size

        _for_each(fill, range(_STREAMS), parallel=total >= _PARALLEL_FROM)
        return tensors

    def like(self, tensors: Sequence[torch.Tensor], std: float) -> list[torch.Tensor]:
        """One draw of N(0, std² I) shaped like ``tensors`` (float32, float64 where a tensor is
        float64; on each tensor's device): :meth:`add_` on zeros."""
        return list(self.add_(zeros_for_noise(tensors), std))

    def pieces(self, total: int, dtypes: Sequence[torch.dtype], device=None):
        """The standard normals :meth:`add_` would draw over ``total`` numbers of ``dtypes``, as
        ``(offset, piece)`` in increasing order (host tensors of at most ``_PIECE``, unscaled): the
        same numbers from the same streams, read in order instead of in parallel, for a distribution
        that scatters the draw (:class:`userdp.engine.noise.flat.DrawCursor`). Read it to the end: the
        streams then stand where :meth:`add_` leaves them. ``device`` is not used (host draws)."""
        dtype = _draw_dtype(dtypes)
        pending = self._take_pending(int(total), dtype)
        if pending is not None:  # drawn ahead: those numbers, in order
            yield 0, torch.from_numpy(pending.buf)
            return
        bounds = _blocks(int(total))
        for k in range(_STREAMS):
            lo, hi = int(bounds[k]), int(bounds[k + 1])
            while lo < hi:
                out = np.empty(min(_PIECE, hi - lo), dtype=dtype)
                self._streams[k].standard_normal(out=out, dtype=dtype)
                yield lo, torch.from_numpy(out)
                lo += out.size

    # ------------------------------------------------------------------ drawing ahead
    def prefetch(self, numel: int, dtypes: Sequence[torch.dtype]) -> bool:
        """Begin drawing the next :meth:`add_`'s standard normals in a background thread, so the draw
        overlaps the computation of the sums it is for (numpy releases the GIL while it fills).

        ``numel`` and ``dtypes`` describe the tensors the next :meth:`add_` receives; that call uses
        these normals (the same numbers, scaled and added by the same arithmetic, as drawing then) if
        it matches them, and otherwise drops them and draws anew. Normals drawn ahead are either
        added by one :meth:`add_` or dropped: never kept past it, never saved, never used twice; a
        prefetch replaces one still pending, and :meth:`state_dict` drops one (the saved state is past
        it). Costs one buffer of ``numel`` normals until they are added. Returns whether a draw was
        begun (:func:`draws_ahead`)."""
        self._drop_pending()
        dtype = _draw_dtype(dtypes)
        if numel <= 0 or not draws_ahead(numel, np.dtype(dtype).itemsize):
            return False
        buf = np.empty(int(numel), dtype=dtype)
        bounds = _blocks(int(numel))
        blocks = [(self._streams[k], buf[int(bounds[k]) : int(bounds[k + 1])], dtype) for k in range(_STREAMS)]
        ahead = _ahead_pool()
        self._pending = _Pending(int(numel), dtype, buf, blocks, [ahead.submit(_fill, *b) for b in blocks])
        return True

    def _take_pending(self, numel: int, dtype) -> _Pending | None:
        """The pending draw if it is for ``numel`` normals of ``dtype`` (waited for), else None (a
        pending draw of another layout is dropped: the streams are past it, so it is never reused)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        pending.wait()
        return pending if (pending.numel == numel and pending.dtype == dtype) else None

    def _drop_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()  # the threads are done with the streams before anything else draws from them

    def scalar(self, std: float) -> float:
        """One draw of N(0, std²) in float64 (the adaptive-clipping count query)."""
        return float(self._gen.standard_normal()) * float(std)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The generator's state. Only ever saved for a seeded run (an unseeded run's state is
        its secret key)."""
        if not self.seeded:
            raise RuntimeError("an unseeded noise generator's state is secret and is never saved")
        self._drop_pending()  # drawn ahead but not added (a step that added no noise): the state is past it
        return {
            "scalar": dict(self._gen.bit_generator.state),
            "streams": [g.state for g in self._streams],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a state saved by :meth:`state_dict`.

        Raises:
            UserError: a state of another layout (a checkpoint of an older userdp)."""
        if not (isinstance(state, dict) and "streams" in state and len(state["streams"]) == _STREAMS):
            raise UserError(
                "the checkpoint's noise generator state has another layout (an older userdp): "
                "start the seeded run again"
            )
        self._drop_pending()  # drawn from the state being replaced
        self._gen.bit_generator.state = state["scalar"]
        for g, st in zip(self._streams, state["streams"], strict=True):
            g.state = st


def _add(flats, offsets, z: np.ndarray, lo: int, std: float, transform) -> None:
    """A piece of standard normals ``z`` at offset ``lo`` of the draw, times ``std``, added where it
    lands: ``z`` itself (one compiled pass where it can: :func:`~userdp.engine.noise.flat.add_scaled`),
    or a correlated mechanism's ``transform(z, lo)`` (which may change ``z``), likewise where it is a
    host tensor."""
    if transform is None:
        add_scaled(flats, offsets, z, std, lo)
        return
    w = transform(torch.from_numpy(z), lo)
    if w.device.type == "cpu":
        add_scaled(flats, offsets, w.contiguous().numpy(), std, lo)
    else:
        add_piece(flats, offsets, w.mul_(float(std)), lo)


def draws_ahead(numel: int, itemsize: int = 4) -> bool:
    """Whether :meth:`GaussianNoise.prefetch` draws a step's ``numel`` normals ahead: where
    :data:`PREFETCH` is "on", or "auto" with a draw large enough to be split, a core that torch's
    threads leave idle (``torch.get_num_threads()`` below the cores this process may run on) and free
    memory for four times the buffer (``numel * itemsize`` bytes; the memory model counts it)."""
    if PREFETCH not in ("on", "off", "auto"):
        raise UserError(f"USERDP_NOISE_PREFETCH must be on, off or auto (got {PREFETCH!r})")
    if PREFETCH != "auto":
        return PREFETCH == "on"
    if numel < _PARALLEL_FROM or torch.get_num_threads() >= _usable_cores():
        return False
    free = free_host_bytes()
    return free is not None and free >= 4 * numel * itemsize


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def draw_dtype(dtypes) -> torch.dtype:
    """The dtype a draw is made in: float64 where any of the tensors is float64, else float32."""
    return torch.float64 if any(d == torch.float64 for d in dtypes) else torch.float32


def _draw_dtype(dtypes) -> type:
    """:func:`draw_dtype` as numpy's (the host generator draws in it)."""
    return np.float64 if draw_dtype(dtypes) == torch.float64 else np.float32


def _blocks(total: int) -> np.ndarray:
    """The bounds of the :data:`_STREAMS` fixed blocks of a draw of ``total`` normals."""
    return np.linspace(0, total, _STREAMS + 1).astype(np.int64)


def _fill(gen: aes.CipherStream, out: np.ndarray, dtype) -> None:
    """``out`` filled with standard normals from ``gen``, a piece at a time as :meth:`GaussianNoise.add_`
    draws them (the same numbers: a stream's draws do not depend on how they are split)."""
    for lo in range(0, out.size, _PIECE):
        gen.standard_normal(out=out[lo : lo + _PIECE], dtype=dtype)


def _for_each(fn, items, parallel: bool = True) -> None:
    """``fn(item)`` for every item, in the shared pool's threads where there is a pool and
    ``parallel``, else in this one. The items are disjoint blocks of a draw (no two touch one element,
    and each block's numbers come from its own stream, so the thread count changes no number)."""
    pool = _pool() if parallel else None
    if pool is None:
        for item in items:
            fn(item)
    else:
        list(pool.map(fn, items))


class _Pending:
    """A draw begun by :meth:`GaussianNoise.prefetch`: ``numel`` normals of ``dtype`` filling ``buf``,
    block k by stream k (``blocks``), each block one task of the ahead thread (``futures``)."""

    def __init__(self, numel: int, dtype, buf: np.ndarray, blocks: list, futures: list):
        self.numel, self.dtype, self.buf, self._blocks, self._futures = numel, dtype, buf, blocks, futures

    def wait(self) -> None:
        """Until every block is filled: the blocks the ahead thread has not begun are cancelled there
        and filled by the shared pool (each block by its own stream, so the numbers are the same)."""
        _for_each(lambda b: _fill(*b), [b for b, f in zip(self._blocks, self._futures, strict=True) if f.cancel()])
        for f in self._futures:
            if not f.cancelled():
                f.result()  # re-raises what the ahead thread raised


#: device type -> the noise source used for parameters there (others: :class:`GaussianNoise`)
DEVICE_SOURCES: dict = {"cuda": ChaChaNoise}


def source_for(device, key_material: int, *, seeded: bool):
    """The keyed noise source for parameters on ``device``: ChaCha20 computed on the device for
    CUDA (:mod:`userdp.engine.noise.chacha`: no host draw, no copy), numpy's PCG64 in parallel host
    threads elsewhere (faster on a CPU). Both are keyed by the same ≥ 128-bit material."""
    return source_class(device)(key_material, seeded=seeded)


def source_class(device) -> type:
    """The class :func:`source_for` uses on ``device``."""
    return DEVICE_SOURCES.get(torch.device(device).type, GaussianNoise)
