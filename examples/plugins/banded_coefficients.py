"""A new noise mechanism with state across steps, in one file: banded matrix-factorization noise
with coefficients you bring (e.g. optimized for your workload by jax_privacy's banded
optimizers), instead of the built-in BandMF's banded square root.

The step releases the clipped sum plus ``std · (C⁻¹ Z)_t``, C the b-banded lower-triangular
Toeplitz matrix with your b coefficients on its diagonals, scaled here to column norm 1. Any such C
is accounted as the built-in BandMF is (users in b cyclic groups, each sampled b steps apart; one
participation moves ``C X`` by at most the clip norm: ``banded = True`` asks the plan for the cyclic
sampler and that accounting). The state is the last b − 1 noise vectors over the coordinates this
rank noises, newest first; the mechanism is written coordinate by coordinate (``filter`` and
``advance``), so it runs under every distribution, sharded included, with no other change.

    USERDP_BANDED_COEFFICIENTS=1,0.6,0.3 userdp train config.yaml \\
        --plugin examples/plugins/banded_coefficients.py --set privacy.noise=banded_coefficients \\
        --set privacy.sampler=cyclic_poisson --set privacy.bands=3
"""

from __future__ import annotations

import os

import numpy as np
import torch

from userdp.engine.noise.mechanism import NOISE_MECHANISMS, IIDGaussian
from userdp.errors import UserError

ENV = "USERDP_BANDED_COEFFICIENTS"


def coefficients(bands: int) -> np.ndarray:
    """The b coefficients of :data:`ENV`, scaled to 2-norm 1 (C's largest column norm).

    Raises:
        UserError: not b finite numbers, a first coefficient of 0, or all zeros."""
    text = os.environ.get(ENV, "")
    try:
        c = np.array([float(x) for x in text.split(",")], dtype=np.float64)
    except ValueError:
        raise UserError(f"{ENV}={text!r}: not a comma-separated list of numbers") from None
    if c.size != int(bands) or not np.all(np.isfinite(c)) or c[0] == 0:
        raise UserError(f"{ENV}={text!r}: need privacy.bands = {bands} finite numbers, the first not 0")
    return c / np.linalg.norm(c)


class BandedCoefficients(IIDGaussian):
    """b-banded Toeplitz noise of the user's coefficients (see the module docstring)."""

    name = "banded_coefficients"
    banded = True  # built with the run's bands, sampled cyclically, accounted as BandMF
    filtered = True

    @staticmethod
    def buffers(bands: int) -> int:
        return int(bands) - 1  # model-sized vectors kept across steps (the memory model counts them)

    def __init__(self, source, bands: int = 1):
        super().__init__(source)
        self.c = coefficients(bands)

    def init(self, numel: int, dtype: torch.dtype, device) -> dict:
        """No past vector yet; ``next`` is w_t, written a piece at a time by :meth:`filter`."""
        return {"past": [], "next": torch.empty(int(numel), dtype=dtype, device=device)}

    def filter(self, z: torch.Tensor, lo: int, state: dict) -> torch.Tensor:
        """``w = (z − Σ_j c_j w_{t−j}) / c_0`` on ``[lo, lo + len(z))``; disjoint pieces, any thread."""
        hi = lo + z.numel()
        for cj, w in zip(self.c[1:], state["past"], strict=False):
            z.add_(w[lo:hi].to(z.device, z.dtype), alpha=-float(cj))
        z.div_(float(self.c[0]))
        state["next"][lo:hi].copy_(z)
        return z

    def advance(self, state: dict) -> dict:
        """w_t joins the past (newest first; the oldest beyond b − 1 is reused for w_{t+1})."""
        past = [state["next"], *state["past"]]
        spare = past.pop() if len(past) > len(self.c) - 1 else torch.empty_like(state["next"])
        return {"past": past, "next": spare}

    def state_dict(self, state: dict) -> dict:
        """The source's state and the past vectors, newest first (a seeded run's checkpoint only)."""
        return {**super().state_dict(state), "past": [w.cpu().clone() for w in state["past"]]}

    def load_state(self, saved: dict, state: dict) -> dict:
        super().load_state(saved, state)
        past = [w.reshape(-1) for w in saved.get("past") or []]
        if len(past) > len(self.c) - 1 or any(w.numel() != state["next"].numel() for w in past):
            raise UserError("the checkpoint's noise stream does not fit this run's bands and model")
        return {"past": [w.to(state["next"]) for w in past], "next": state["next"]}

    def to_record(self) -> dict:
        return {"name": self.name, "bands": len(self.c), "coefficients": [float(x) for x in self.c]}


if BandedCoefficients.name not in NOISE_MECHANISMS:  # importing this file twice registers it once
    NOISE_MECHANISMS.register(BandedCoefficients, name=BandedCoefficients.name)
