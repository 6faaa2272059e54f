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
  ``C w = z``): the state is the last b−1 noise vectors, model-sized, held in the sums' dtype
  (float32 or wider) on the sums' device. b = 1 is i.i.d. noise, the same numbers as
  :class:`~userdp.engine.noise.IIDGaussian` (it *is* that mechanism).
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

from userdp.engine.noise import NOISE_MECHANISMS, GaussianNoise, IIDGaussian
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

    def __init__(self, source: GaussianNoise | None, bands: int = 1):
        super().__init__(source)
        self.bands = int(bands)
        self.coefficients = bsr_coefficients(self.bands)
        self._past: list[list[torch.Tensor]] = []  # w_{t-1}, w_{t-2}, ... (at most b - 1)

    def _next(self, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """This step's w_t, shaped like ``like``; pushed onto the stream's state (the main rank's:
        the only one with a source)."""
        assert self.source is not None
        w = self.source.like(like, 1.0)  # z_t: float32 (float64 where a sum is), on each sum's device
        c = self.coefficients
        for j, past in enumerate(self._past, 1):
            torch._foreach_add_(w, _laid_out(past, w), alpha=-float(c[j]))
        torch._foreach_div_(w, float(c[0]))
        self._past = ([w] + self._past)[: self.bands - 1]
        return w

    def add_noise(self, tensors: Sequence[torch.Tensor], std: float) -> None:
        """Add ``std · w_t`` to the sums, in place (b = 1: exactly :class:`IIDGaussian`'s draw)."""
        if self.source is None or std <= 0:
            return
        if self.bands == 1:
            super().add_noise(tensors, std)
            return
        w = self._next(tensors)
        torch._foreach_add_(list(tensors), w, alpha=float(std))

    def pieces(self, numel: int, dtypes: Sequence[torch.dtype], std: float, device):
        """This step's noise in order, for a sharded step: one piece, the whole ``std · w_t`` (held
        on the main rank's host; its b−1 past vectors are whole there too)."""
        if self.bands == 1:
            yield from super().pieces(numel, dtypes, std, device)
            return
        dtype = torch.float64 if any(d == torch.float64 for d in dtypes) else torch.float32
        (w,) = self._next([torch.empty(int(numel), dtype=dtype)])
        yield 0, w.mul(float(std))

    def state_dict(self) -> dict:
        """The source's state and the stream's past vectors (seeded runs only: both are secret)."""
        return {**super().state_dict(), "past": [[t.detach().cpu().clone() for t in w] for w in self._past]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output: the stream continues where it was saved.

        Raises:
            UserError: a saved stream of another band count."""
        super().load_state_dict(state)
        past = state.get("past") or []
        if len(past) > self.bands - 1:
            raise UserError(f"the checkpoint's noise stream holds {len(past)} past steps, more than bands - 1")
        self._past = [[t.clone() for t in w] for w in past]

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


def _laid_out(past: list[torch.Tensor], like: list[torch.Tensor]) -> list[torch.Tensor]:
    """A past noise vector laid out as ``like`` (on its devices and dtypes): the same numbers in the
    same flat order, whether it was saved one tensor per parameter (a replicated run) or as one flat
    vector (a sharded run's), since a resume may change the sharding."""
    if [tuple(t.shape) for t in past] != [tuple(t.shape) for t in like]:
        flat = torch.cat([t.reshape(-1) for t in past])
        if flat.numel() != sum(t.numel() for t in like):
            raise UserError("the checkpoint's noise stream is for another model (its size differs)")
        past = [p.view(t.shape) for p, t in zip(flat.split([t.numel() for t in like]), like, strict=True)]
    return [p.to(device=t.device, dtype=t.dtype) for p, t in zip(past, like, strict=True)]


NOISE_MECHANISMS.register(BandMF, name="bandmf")
