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
  i.i.d. noise, the same numbers as :class:`~userdp.engine.noise.mechanism.IIDGaussian` (it *is* that
  mechanism).
* **State and checkpoints.** The b−1 vectors are noise: anyone who holds them and two released
  models could subtract them. They are saved with a seeded run's checkpoint (as the generator's
  state is: whoever holds the seed holds them anyway), so a resume continues the same stream bit
  for bit; an unseeded run saves nothing secret, and a resumed (or re-keyed) run starts a fresh
  stream. A restart makes C block-diagonal: still b-banded, lower triangular, with column norms at
  most 1, so the accounting is unchanged (the noise of the steps around it is less cancelled).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

from userdp.engine.noise.gaussian import GaussianNoise
from userdp.engine.noise.mechanism import NOISE_MECHANISMS, IIDGaussian, NoiseState
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


@dataclasses.dataclass
class Stream:
    """BandMF's state: the past noise vectors, flat, in a ring of b − 1 slots (``head`` holds w_{t-1},
    the slot after it the oldest, w_{t-b+1}, read for the last time while w_t overwrites it), and how
    many are held (fewer than b − 1 while a stream begins). Secret: checkpointed for a seeded run only."""

    slots: list[torch.Tensor]
    head: int = -1
    held: int = 0

    def past(self, j: int) -> torch.Tensor:
        """w_{t-j}, flat (1 <= j <= held)."""
        return self.slots[(self.head - (j - 1)) % len(self.slots)]

    def next_slot(self) -> torch.Tensor:
        """The slot w_t is written into (the oldest vector's)."""
        return self.slots[(self.head + 1) % len(self.slots)]

    def advanced(self) -> Stream:
        """The stream once w_t is written: it becomes w_{t-1}."""
        return Stream(self.slots, (self.head + 1) % len(self.slots), min(self.held + 1, len(self.slots)))


class BandMF(IIDGaussian):
    """b-banded matrix-factorization noise over a keyed i.i.d. source (see the module docstring): a
    filter of the source's normals, coordinate by coordinate, whose state is a :class:`Stream`.

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

    @property
    def filtered(self) -> bool:  # type: ignore[override]
        """b = 1 is i.i.d. noise: the draw is added as it is made."""
        return self.bands > 1

    def init(self, numel: int, dtype: torch.dtype, device) -> NoiseState:
        """b − 1 zero vectors of ``numel`` numbers of the draw's ``dtype`` on the sums' ``device`` (on a
        GPU the recursion never crosses to the host); none for b = 1."""
        if self.bands == 1:
            return None
        return Stream([torch.zeros(int(numel), dtype=dtype, device=device) for _ in range(self.bands - 1)])

    def filter(self, z: torch.Tensor, lo: int, state: Stream | None) -> torch.Tensor:
        """The piece ``[lo, lo + len(z))`` of w_t from the same piece of z_t (changed in place and
        returned): ``w = (z − Σ_j c_j w_{t−j}) / c_0``, written into the ring's next slot. Pieces
        are disjoint, so the pool's threads may filter them at once."""
        if state is None:
            return z
        hi = lo + z.numel()
        c = self.coefficients
        for j in range(1, state.held + 1):
            z.add_(state.past(j)[lo:hi].to(z.device, z.dtype), alpha=-float(c[j]))
        z.div_(float(c[0]))
        state.next_slot()[lo:hi].copy_(z)
        return z

    def advance(self, state: NoiseState) -> NoiseState:
        """The step's w_t is written: it becomes w_{t-1}."""
        if state is None:
            return None
        return state.advanced()

    # ------------------------------------------------------------------ state
    def state_dict(self, state: Stream | None) -> dict:
        """The source's state and the stream's past vectors, newest first (seeded runs only: both
        are secret)."""
        past = [state.past(j).cpu().clone() for j in range(1, state.held + 1)] if state is not None else []
        return {**super().state_dict(state), "past": past}

    def load_state(self, saved: dict, state: NoiseState) -> NoiseState:
        """Restore :meth:`state_dict`'s output into ``state``: the stream continues where it was saved.

        Raises:
            UserError: a saved stream of more past vectors than b − 1, or of vectors of another length."""
        super().load_state(saved, state)
        past = [t.reshape(-1) for t in (saved.get("past") or [])]
        if len(past) > self.bands - 1:
            raise UserError(f"the checkpoint's noise stream holds {len(past)} past steps, more than bands - 1")
        if state is None:
            return None
        if any(w.numel() != state.slots[0].numel() for w in past):
            raise UserError(
                f"the checkpoint's noise stream holds vectors of another length than {state.slots[0].numel()}"
            )
        stream = Stream(state.slots)
        for w in reversed(past):  # oldest first, as the steps wrote them
            stream.next_slot().copy_(w)
            stream = stream.advanced()
        return stream

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
