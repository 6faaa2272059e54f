"""Banded matrix-factorization noise (DP-MF; Choquette-Choo et al. 2023, McKenna 2025): the step
releases the clipped sum plus ``std · (C⁻¹ Z)_t``, C a b-banded lower-triangular Toeplitz strategy
and Z i.i.d. standard normal, so the noise of successive steps is anti-correlated and largely
cancels in the running sum of updates the model is.

* **The strategy.** The banded square root of the prefix-sum workload (BSR, Kalinin & Lampert
  2024): the first b coefficients of ``(1 − x)^(−1/2)``, ``c_k = binom(2k, k) / 4^k``, scaled so
  that C's largest column norm is 1 (:func:`bsr_coefficients`; C is Toeplitz, so every column is
  a prefix of the same b numbers and the largest column norm is their 2-norm). With users sampled
  by :class:`~userdp.engine.sampling.CyclicPoisson` over the same b groups, one user's steps are b
  apart, their columns of C touch disjoint rows, and each participation moves ``C X`` by at most
  the clip norm: the run is accounted as ceil(T/b) Poisson-subsampled Gaussians at q·b
  (:meth:`userdp.accounting.Mechanism.compositions`).
* **Streaming.** ``w_t = (z_t − Σ_{j=1}^{b−1} c_j w_{t−j}) / c_0`` (back-substitution of
  ``C w = z``): the state is the last b−1 noise vectors, model-sized, flat buffers on the sums'
  device in the draw's dtype (float32, float64 for float64 sums) in a ring; with the host source
  the recursion runs inside the draw, a cache-sized piece at a time in its threads. b = 1 is
  i.i.d. noise, the same numbers as :class:`~userdp.engine.noise.gaussian.IIDGaussian` (it *is* that
  mechanism).
* **State and checkpoints.** The b−1 vectors are noise: anyone who holds them and two released
  models could subtract them. They are saved with a seeded run's checkpoint (as the generator's
  state is: whoever holds the seed holds them anyway), so a resume continues the same stream bit
  for bit; an unseeded run saves nothing secret, and a resumed (or re-keyed) run starts a fresh
  stream. A restart makes C block-diagonal: still b-banded, lower triangular, with column norms at
  most 1, so the accounting is unchanged (the noise of the steps around it is less cancelled).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from userdp.engine.noise.flat import add_piece, flat_views
from userdp.engine.noise.gaussian import NOISE_MECHANISMS, GaussianNoise, IIDGaussian, draw_dtype
from userdp.errors import UserError


def bsr_coefficients(bands: int) -> np.ndarray:
    """The b coefficients ``c_0..c_{b-1}`` of the banded square root of the prefix-sum matrix,
    scaled to 2-norm 1 (float64): ``c_k ∝ binom(2k, k) / 4^k``. One band is ``[1.0]``."""
    c = np.array([math.comb(2 * k, k) / 4.0**k for k in range(int(bands))], dtype=np.float64)
    return c / np.linalg.norm(c)


def strategy_matrix(coefficients: Sequence[float], steps: int) -> np.ndarray:
    """C over ``steps`` steps: lower-triangular Toeplitz with ``coefficients`` on its first b
    diagonals (float64; for tests and the record, not for training)."""
    c = np.asarray(coefficients, dtype=np.float64)
    out = np.zeros((int(steps), int(steps)))
    for k, v in enumerate(c[: int(steps)]):
        out += np.diag(np.full(int(steps) - k, v), -k)
    return out


def max_column_norm(coefficients: Sequence[float], steps: int) -> float:
    """The largest column norm of :func:`strategy_matrix` (the sensitivity factor of one
    participation)."""
    return float(np.linalg.norm(strategy_matrix(coefficients, steps), axis=0).max())


class BandMF(IIDGaussian):
    """b-banded matrix-factorization noise over a keyed i.i.d. source (see the module docstring).

    Args:
        source: the keyed generator of the standard normals z_t (None on ranks that draw none).
        bands: b; the run's cyclic sampler has the same b groups (the plan refuses another sampler).
    """

    name = "bandmf"
    banded = True  # the plan hands it the run's bands

    @staticmethod
    def buffers(bands: int) -> int:
        """Model-sized vectors kept across steps (the memory model counts them): b − 1."""
        return int(bands) - 1

    def __init__(self, source: GaussianNoise | None, bands: int = 1):
        super().__init__(source)
        self.bands = int(bands)
        self.coefficients = bsr_coefficients(self.bands)
        # the past noise vectors, flat, in a ring of b - 1 slots: slot `_head` holds w_{t-1}, the
        # slot after it the oldest (w_{t-b+1}, read for the last time while w_t overwrites it)
        self._slots: list[torch.Tensor] = []
        self._head = -1
        self._held = 0  # past vectors held (fewer than b - 1 while a stream begins)

    # ------------------------------------------------------------------ the stream
    @property
    def correlated(self) -> bool:
        """Whether the noise keeps state across steps (b > 1). A sharded run keeps that state on every
        rank, for the rank's own shards (:meth:`userdp.engine.distributed.distribution.Sharded.release`): rank 0
        reads :meth:`draws`, scatters each parameter's z, and every rank :meth:`combine`\ s its part."""
        return self.bands > 1

    def draws(self, numel: int, dtypes: Sequence[torch.dtype], device):
        """This step's standard normals z_t, in order, as ``(offset, piece)`` (the main rank's source)."""
        assert self.source is not None
        return self.source.pieces(numel, dtypes, device)

    def _past(self, j: int) -> torch.Tensor:
        """w_{t-j}, flat (1 <= j <= held)."""
        return self._slots[(self._head - (j - 1)) % (self.bands - 1)]

    def combine(self, z: torch.Tensor, lo: int) -> torch.Tensor:
        """The piece ``[lo, lo + len(z))`` of w_t from the same piece of z_t (changed in place and
        returned): ``w = (z − Σ_j c_j w_{t−j}) / c_0``, written into the ring's next slot. Pieces
        are disjoint, so the pool's threads may combine them at once."""
        hi = lo + z.numel()
        c = self.coefficients
        for j in range(1, self._held + 1):
            z.add_(self._past(j)[lo:hi].to(z.device, z.dtype), alpha=-float(c[j]))
        z.div_(float(c[0]))
        self._slots[(self._head + 1) % (self.bands - 1)][lo:hi].copy_(z)
        return z

    def begin(self, numel: int, dtype: torch.dtype, device="cpu") -> None:
        """The ring ready for a step over ``numel`` numbers on ``device`` (the sums' device: on a GPU the
        recursion never crosses to the host), allocated at the first step: b − 1 flat buffers of the
        draw's dtype; a ring restored from a checkpoint moves there."""
        if not self._slots:
            self._slots = [torch.zeros(numel, dtype=dtype, device=device) for _ in range(self.bands - 1)]
        if self._slots[0].numel() != numel:
            raise UserError(f"the noise stream holds vectors of {self._slots[0].numel()} numbers, not {numel}")
        if self._slots[0].device != torch.device(device):
            self._slots = [t.to(device) for t in self._slots]

    def advance(self) -> None:
        """The step's w_t is written: it becomes w_{t-1}."""
        self._head = (self._head + 1) % (self.bands - 1)
        self._held = min(self._held + 1, self.bands - 1)

    # ------------------------------------------------------------------ the mechanism
    def add_noise(self, tensors: Sequence[torch.Tensor], std: float) -> None:
        """Add ``std · w_t`` to the sums, in place (b = 1: exactly :class:`IIDGaussian`'s draw). With
        a host source the recursion runs inside the draw, a piece at a time in the pool's threads
        (no model-sized temporary); another source's draw is combined whole."""
        if self.source is None or std <= 0:
            return
        if self.bands == 1:
            super().add_noise(tensors, std)
            return
        numel = sum(t.numel() for t in tensors)
        dtype = draw_dtype(t.dtype for t in tensors)
        self.begin(numel, dtype, tensors[0].device)
        if isinstance(self.source, GaussianNoise):
            self.source.add_(tensors, std, transform=self.combine)
        else:  # a device source (ChaCha on CUDA): one draw, combined, then added
            z = self.source.like([torch.empty(numel, dtype=dtype, device=tensors[0].device)], 1.0)[0]
            flats, offsets = flat_views(tensors)
            add_piece(flats, offsets, self.combine(z, 0).mul_(float(std)), 0)
        self.advance()

    def pieces(self, numel: int, dtypes: Sequence[torch.dtype], std: float, device):
        """This step's noise in order, for a sharded step: the source's pieces of z_t, each combined
        into w_t and scaled (the main rank keeps the whole ring, on the host)."""
        if self.bands == 1:
            yield from super().pieces(numel, dtypes, std, device)
            return
        dtype = draw_dtype(dtypes)
        assert self.source is not None  # the main rank's (the only one that reads the draw)
        self.begin(int(numel), dtype)
        for lo, z in self.source.pieces(numel, dtypes, device):
            yield lo, self.combine(z, lo).mul_(float(std))
        self.advance()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The source's state and the stream's past vectors, newest first (seeded runs only: both
        are secret)."""
        past = [self._past(j).cpu().clone() for j in range(1, self._held + 1)]
        return {**super().state_dict(), "past": past}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output: the stream continues where it was saved.

        Raises:
            UserError: a saved stream of more past vectors than b − 1."""
        super().load_state_dict(state)
        past = [t.reshape(-1) for t in (state.get("past") or [])]
        if len(past) > self.bands - 1:
            raise UserError(f"the checkpoint's noise stream holds {len(past)} past steps, more than bands - 1")
        self._slots, self._head, self._held = [], -1, 0
        if past:
            self.begin(past[0].numel(), past[0].dtype)
            for w in reversed(past):  # oldest first, as the steps wrote them
                self._slots[(self._head + 1) % (self.bands - 1)].copy_(w)
                self.advance()

    def to_record(self) -> dict:
        """What the privacy record says of the noise: the strategy, its coefficients and its norm."""
        return {
            "name": self.name,
            "bands": self.bands,
            "strategy": "banded square root of the prefix-sum workload (BSR), scaled to column norm 1",
            "coefficients": [float(x) for x in self.coefficients],
            "max_column_norm": float(np.linalg.norm(self.coefficients)),
            "state": "the last bands - 1 noise vectors: saved with a seeded run's checkpoint only (never "
            "released); an unseeded run resumed, or a seeded one re-keyed, starts a fresh stream",
        }


NOISE_MECHANISMS.register(BandMF, name="bandmf")
