"""Gaussian noise on the SUM of clipped unit updates, drawn once per step for the whole sum.

The noise is the privacy mechanism, so its generator is keyed like a secret:

* :class:`GaussianNoise` draws from numpy's ``PCG64DXSM`` (128-bit state, 128-bit stream
  increment) keyed through a ``SeedSequence`` whose pool holds 256 bits. Unseeded runs fill
  it from 256 bits of ``os.urandom``; that key is never written anywhere (a checkpoint of an
  unseeded run holds no generator state, and a resumed run draws a fresh key).
* torch's generators are **not** used for noise: the CPU generator keeps only the low 32 bits
  of an integer seed (``manual_seed(s)`` and ``manual_seed(s + (7 << 32))`` give the same
  stream), so anyone who sees two consecutive checkpoints could search 2^32 seeds and
  subtract the noise. The noise is drawn on the host in float32 and moved to the device;
  every device therefore gets the same ≥ 128-bit keying.
* A seeded run (the user gives an integer) derives the key from that seed: reproducible, and
  the guarantee then holds only against parties who do not know the seed (the report says so).

Two layers, so that correlated-noise mechanisms (DP-FTRL's tree aggregation, matrix
factorization) are one new class and no change to the loop:

* the *source* (:class:`GaussianNoise`): the keyed generator of i.i.d. standard normals;
* the *mechanism* (:class:`IIDGaussian`, registered in :data:`NOISE_MECHANISMS`): what noise a
  step adds to the released update, from the source and the mechanism's own state
  (``init`` / ``noise`` / ``state_dict``; jax_privacy's ``noise_addition`` transforms have the
  same shape). Its state is checkpointed with the ledger — for seeded runs only, since an
  unseeded run's generator state is its secret key. A correlated mechanism must also bring its
  own DpEvent (the accountant sees the mechanism, not the loop); i.i.d. Gaussian noise is what
  :class:`userdp.accounting.Mechanism` describes.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import torch

from userdp.engine.chacha import ChaChaNoise
from userdp.engine.flat import add_piece, check_wide, flat_views, zeros_for_noise
from userdp.errors import UserError
from userdp.registry import Registry

ENTROPY_BITS = 256
_POOL_WORDS = ENTROPY_BITS // 32
_STREAMS = 16  # fixed: the noise of a seeded run does not depend on the machine's core count
_PARALLEL_FROM = 1 << 20  # smaller draws are filled in the calling thread
_PIECE = 1 << 20  # normals per host buffer: a thread holds at most 8 MB of noise at a time
_POOL = None


def _pool():
    """A shared thread pool for large noise draws (None with a single core)."""
    global _POOL
    if _POOL is None and (os.cpu_count() or 1) > 1:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(max_workers=min(_STREAMS, os.cpu_count() or 1), thread_name_prefix="userdp-noise")
    return _POOL


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

    algorithm = ("numpy PCG64DXSM (128-bit state + 128-bit increment) via a 256-bit SeedSequence pool; "
                 f"{_STREAMS} independent child streams fill fixed blocks of each draw, in parallel threads")

    def __init__(self, key_material: int, *, seeded: bool):
        self.seeded = bool(seeded)
        root = _seed_sequence(key_material, spawn_key=(0x6E6F697365,))
        self._gen = np.random.Generator(np.random.PCG64DXSM(root))  # scalars
        # A large draw (a 124M-parameter model's noise is 124M normals: 2.4 s on one core here) is
        # split into _STREAMS fixed blocks, each filled by its own child generator (SeedSequence
        # children are independent streams of the same 256-bit key). numpy releases the GIL while
        # filling, so the blocks run in parallel; the numbers do not depend on the thread count.
        self._streams = [np.random.Generator(np.random.PCG64DXSM(c)) for c in root.spawn(_STREAMS)]

    @classmethod
    def from_os_entropy(cls) -> "GaussianNoise":
        """A generator keyed by 256 bits of ``os.urandom`` (never stored)."""
        return cls(os_entropy(), seeded=False)

    @classmethod
    def from_seed(cls, seed: int) -> "GaussianNoise":
        """A reproducible generator keyed from a user-given integer seed."""
        return cls(int(seed), seeded=True)

    @staticmethod
    def keying_text(seeded: bool) -> str:
        """How a generator is keyed, for the privacy record."""
        if seeded:
            return ("keyed from the user-given seed (reproducible: whoever holds the seed can "
                    "recompute the noise)")
        return f"keyed by {ENTROPY_BITS} bits of operating-system entropy (os.urandom), never stored"

    # ------------------------------------------------------------------ drawing
    def add_(self, tensors: Sequence[torch.Tensor], std: float) -> Sequence[torch.Tensor]:
        """Add one draw of N(0, std² I) over the concatenation of ``tensors`` to them, in place.

        Every coordinate gets noise (also coordinates whose gradient is zero). The draw streams
        through pieces of at most ``_PIECE`` normals, so no model-sized noise buffer is ever
        allocated (a 124M-parameter model's noise was a 0.5 GB buffer); the numbers do not depend
        on the piece size or the thread count. Draws are float32 (float64 where a tensor is).

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
        dtype = np.float64 if any(t.dtype == torch.float64 for t in tensors) else np.float32
        bounds = np.linspace(0, total, _STREAMS + 1).astype(np.int64)

        def fill(k: int) -> None:  # stream k fills block k of the flat draw, a piece at a time
            lo, hi = int(bounds[k]), int(bounds[k + 1])
            buf = np.empty(min(_PIECE, hi - lo), dtype=dtype)
            while lo < hi:
                out = buf[: min(_PIECE, hi - lo)]
                self._streams[k].standard_normal(out=out, dtype=dtype)
                add_piece(flats, offsets, torch.from_numpy(out).mul_(float(std)), lo)
                lo += out.size

        if total >= _PARALLEL_FROM and _pool() is not None:
            list(_pool().map(fill, range(_STREAMS)))  # disjoint ranges: no two threads touch one element
        else:
            for k in range(_STREAMS):
                fill(k)
        return tensors

    def like(self, tensors: Sequence[torch.Tensor], std: float) -> list[torch.Tensor]:
        """One draw of N(0, std² I) shaped like ``tensors`` (float32, float64 where a tensor is
        float64; on each tensor's device): :meth:`add_` on zeros."""
        return list(self.add_(zeros_for_noise(tensors), std))

    def scalar(self, std: float) -> float:
        """One draw of N(0, std²) in float64 (the adaptive-clipping count query)."""
        return float(self._gen.standard_normal()) * float(std)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The generator's state. Only ever saved for a seeded run (an unseeded run's state is
        its secret key)."""
        if not self.seeded:
            raise RuntimeError("an unseeded noise generator's state is secret and is never saved")
        return {"scalar": dict(self._gen.bit_generator.state),
                "streams": [dict(g.bit_generator.state) for g in self._streams]}

    def load_state_dict(self, state: dict) -> None:
        """Restore a state saved by :meth:`state_dict`.

        Raises:
            UserError: a state of another layout (a checkpoint of an older userdp)."""
        if not (isinstance(state, dict) and "streams" in state and len(state["streams"]) == _STREAMS):
            raise UserError("the checkpoint's noise generator state has another layout (an older userdp): "
                            "start the seeded run again")
        self._gen.bit_generator.state = state["scalar"]
        for g, st in zip(self._streams, state["streams"]):
            g.bit_generator.state = st


#: device type -> the noise source used for parameters there (others: :class:`GaussianNoise`)
DEVICE_SOURCES: dict = {"cuda": ChaChaNoise}


def source_for(device, key_material: int, *, seeded: bool):
    """The keyed noise source for parameters on ``device``: ChaCha20 computed on the device for
    CUDA (:mod:`userdp.engine.chacha`: no host draw, no copy), numpy's PCG64 in parallel host
    threads elsewhere (faster on a CPU). Both are keyed by the same ≥ 128-bit material."""
    return source_class(device)(key_material, seeded=seeded)


def source_class(device) -> type:
    """The class :func:`source_for` uses on ``device``."""
    return DEVICE_SOURCES.get(torch.device(device).type, GaussianNoise)


class IIDGaussian:
    """Independent N(0, std^2 I) noise every step: the mechanism DP-SGD and DP-FedAvg account.

    Args:
        source: the keyed generator (None on ranks that do not draw noise; only the main rank
            draws, once per step for the whole sum).
    """

    name = "iid_gaussian"

    def __init__(self, source: "GaussianNoise | None"):
        self.source = source

    def init(self, params: Sequence[torch.Tensor]) -> None:
        """Prepare for a run over ``params`` (i.i.d. noise keeps no per-parameter state)."""

    def add_noise(self, tensors: Sequence[torch.Tensor], std: float) -> None:
        """Add this step's noise to the clipped sums ``tensors``, in place (``std`` is on the scale
        of the sum; the loop adds it to rank 0's partial sum before the all-reduce, then divides
        by the denominator). The sums are float32 or float64; the noise never passes through a
        narrower type, and no model-sized noise buffer is allocated. Nothing is added where there
        is no source or ``std`` is 0."""
        if self.source is not None and std > 0:
            self.source.add_(tensors, std)

    def scalar(self, std: float) -> float:
        """One N(0, std^2) draw for a scalar query (adaptive clipping's count); 0 without a source."""
        return self.source.scalar(std) if (self.source is not None and std) else 0.0

    def state_dict(self) -> dict:
        """The mechanism's state for a checkpoint: the source's state (seeded runs only)."""
        return {"source": self.source.state_dict() if self.source is not None else None}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output."""
        if self.source is not None and state.get("source") is not None:
            self.source.load_state_dict(state["source"])


#: name -> mechanism class; ``TrainConfig.noise`` picks one
NOISE_MECHANISMS: Registry = Registry("noise", {"iid_gaussian": IIDGaussian})


def make_noise(name: str, source: "GaussianNoise | None") -> IIDGaussian:
    """The noise mechanism called ``name`` over ``source``.

    Raises:
        UserError: an unknown name (the message lists the registered ones).
    """
    return NOISE_MECHANISMS.lookup(name)(source)
