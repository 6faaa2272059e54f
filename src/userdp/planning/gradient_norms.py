"""L(G): the median norm of users' mean gradients at the pretrained model (Charles et al. 2024, App. F)."""

from __future__ import annotations

import time

import numpy as np

from userdp import progress
from userdp.engine.algorithms import ULS
from userdp.engine.per_unit import PerUnit
from userdp.errors import UserError


class GradientNormEstimator:
    """``L(G)`` = median over a fixed sample of users of ||mean gradient over up to G of the
    user's records|| at the model's current (pretrained) parameters.

    Uses the engine's vectorized per-unit code (:class:`userdp.engine.per_unit.PerUnit`:
    functional_call + grad + vmap over users, in chunks) — no Python loop over users' gradients.
    The users are sampled once (uniformly without replacement, ``num_users`` of them, default
    128); each L(G) draws up to G records per user afresh via ``data.draw_records``. Calls are
    cached by G. This is a NON-PRIVATE touch of the data.
    """

    def __init__(self, model, data, loss_fn, *, num_users: int = 128, chunk_size: int = 16,
                 rng: np.random.Generator | None = None, log=None):

        if num_users < 1:
            raise UserError(f"the number of users sampled for L(G) must be >= 1, got {num_users}")
        self.rng = rng if rng is not None else np.random.default_rng()
        n = int(data.num_users)
        self.users = np.sort(self.rng.choice(n, size=min(num_users, n), replace=False))
        self.model, self.data, self.loss_fn = model, data, loss_fn
        self.chunk_size = int(chunk_size)
        self._per_unit = PerUnit(model, loss_fn, ULS(group_size=1, sampling_rate=1.0))
        self._cache: dict[int, float] = {}
        self.norms: dict[int, np.ndarray] = {}
        self.log = log  # optional progress: one line per group size evaluated

    def user_norms(self, group_size: int) -> np.ndarray:

        out = []
        with progress.bar(len(self.users), f"planning: L(G = {int(group_size)})", "user") as shown:
            for lo in range(0, len(self.users), self.chunk_size):
                users = self.users[lo: lo + self.chunk_size]
                batch, mask = self.data.draw_records(users, int(group_size), self.rng)
                updates, _ = self._per_unit(batch, mask)
                sq = sum(u.reshape(u.shape[0], -1).double().pow(2).sum(1) for u in updates)
                out.append(sq.sqrt().detach().cpu().numpy())
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
                self.log(f"  L(G = {g}): median gradient norm {self._cache[g]:.4g} over {len(self.users)} sampled "
                         f"users ({time.perf_counter() - t0:.1f} s)")
        return self._cache[g]
