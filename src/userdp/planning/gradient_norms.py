"""L(G): the median norm of users' mean gradients at the pretrained model (Charles et al. 2024, App. F)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from userdp import progress
from userdp.engine.algorithms import ULS
from userdp.engine.clipping import FlatClip, StepClipping
from userdp.engine.per_unit import make_per_unit
from userdp.errors import UserError

#: a clip norm no gradient reaches: the strategy's norms are what is read, its sums are not used
_NO_CLIP = FlatClip(1e30)
#: the norms unclipped, in float32
_UNCLIPPED = StepClipping(_NO_CLIP, _NO_CLIP.initial_state(), torch.float32)


def _drop(j: int, x) -> None:
    """The planner reads norms only: each parameter's sum is dropped as soon as it is formed (no
    model-sized buffer of sums)."""


@dataclass(frozen=True)
class NormSample:
    """The users L(G) is estimated on: ``users`` of them drawn at random (``seed``; None: OS
    entropy), run ``chunk_size`` at a time through the per-unit strategy."""

    users: int = 128
    chunk_size: int = 16
    seed: int | None = None


class GradientNormEstimator:
    """``L(G)`` = median over a fixed sample of users of ||mean gradient over up to G of the
    user's records|| at the model's current (pretrained) parameters.

    Uses the per-unit strategy training would (``per_unit: auto``): the ghost strategy's norms from
    each layer's activations and output gradients (no per-user gradient is materialized, and each
    parameter's sum is dropped once formed: a chunk costs a training chunk's activations, not
    ``chunk`` copies of the model), else vmap over users
    (:class:`userdp.engine.per_unit.PerUnit`) for a model ghost cannot serve.
    The users are sampled once (uniformly without replacement, ``num_users`` of them, default
    128); each L(G) draws up to G records per user afresh via ``data.draw_records``. Calls are
    cached by G. This is a NON-PRIVATE touch of the data.
    """

    def __init__(
        self,
        model,
        data,
        loss_fn,
        sample: NormSample | None = None,
        *,
        rng: np.random.Generator | None = None,
        log=None,
    ):
        sample = sample or NormSample()
        num_users, chunk_size = sample.users, sample.chunk_size
        if num_users < 1:
            raise UserError(f"the number of users sampled for L(G) must be >= 1, got {num_users}")
        self.rng = rng if rng is not None else np.random.default_rng(sample.seed)
        n = int(data.num_users)
        self.users = np.sort(self.rng.choice(n, size=min(num_users, n), replace=False))
        self.model, self.data, self.loss_fn = model, data, loss_fn
        self.chunk_size = int(chunk_size)
        self._per_unit = make_per_unit("auto", model, loss_fn, ULS(group_size=1, sampling_rate=1.0))
        self._cache: dict[int, float] = {}
        self.norms: dict[int, np.ndarray] = {}
        self.log = log  # optional progress: one line per group size evaluated

    def user_norms(self, group_size: int) -> np.ndarray:

        out = []
        with progress.bar(len(self.users), f"planning: L(G = {int(group_size)})", "user") as shown:
            for lo in range(0, len(self.users), self.chunk_size):
                users = self.users[lo : lo + self.chunk_size]
                batch, mask = self.data.draw_records(users, int(group_size), self.rng)
                ones = torch.ones(mask.shape[0], dtype=torch.float32, device=mask.device)
                _, norms, _, bad = self._per_unit.clipped_sum(batch, mask, ones, _UNCLIPPED, sink=_drop)
                # a non-finite user's norm is NaN (the strategy reports 0 for it): never a small norm
                out.append(torch.where(bad, float("nan"), norms.double()).detach().cpu().numpy())
                shown.update(len(users))
        return np.concatenate(out)

    def __call__(self, group_size: int) -> float:
        g = int(group_size)
        if g not in self._cache:
            t0 = time.perf_counter()
            norms = self.user_norms(g)
            self.norms[g] = norms
            self._cache[g] = float(np.median(norms))
            if self.log is not None:
                self.log(
                    f"  L(G = {g}): median gradient norm {self._cache[g]:.4g} over {len(self.users)} sampled "
                    f"users ({time.perf_counter() - t0:.1f} s)"
                )
        return self._cache[g]
