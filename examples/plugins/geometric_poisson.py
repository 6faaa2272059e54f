"""A new sampler in one file: Poisson sampling by geometric gaps.

The built-in ``poisson`` sampler draws one uniform per unit per step: O(N) work at any rate. At
small rates over many units (q = 1e-4 of ten million users) most of that is wasted. Drawing the
gaps between selected units from Geometric(q) gives the *same distribution* — each unit in the
cohort independently with probability q — in O(qN) work. Because the distribution is Poisson's,
the sampler declares ``accounted_as = "poisson"``: the run plan derives the step's DpEvent from
that, and the neighbour test (``userdp.engine.neighbour``) holds it to the same bound.

    userdp train config.yaml --plugin examples/plugins/geometric_poisson.py --set privacy.sampler=poisson_geometric
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from userdp.engine.sampling import SAMPLERS, register_sampler


@dataclass(frozen=True)
class GeometricPoisson:
    """Poisson(rate) membership for every unit, drawn as geometric gaps between members."""

    name = "poisson_geometric"
    mode = "poisson_geometric_gaps"
    accounted_as = "poisson"

    def sample(self, num_units: int, rate: float, step: int, rng: np.random.Generator, state: dict) -> np.ndarray:
        if rate >= 1.0:
            return np.arange(num_units)
        out, pos = [], -1
        block = max(16, int(2 * rate * num_units) + 16)
        while True:  # gaps G ~ Geometric(rate) on {1, 2, ...}: the next member is pos + G
            gaps = rng.geometric(rate, size=block)
            idx = pos + np.cumsum(gaps)
            keep = idx[idx < num_units]
            out.append(keep)
            if len(keep) < len(idx):
                return np.concatenate(out).astype(np.int64)
            pos = int(idx[-1])


if GeometricPoisson.name not in SAMPLERS:  # importing this file twice registers it once
    register_sampler(GeometricPoisson())
