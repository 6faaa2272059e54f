"""Which units take part in a step (docs/accounting.md). Poisson by default, exactly.

* :class:`Poisson` — every unit independently with probability ``rate``; the cohort size is
  Binomial(num_units, rate) and varies from step to step. This is what the accountant assumes.
* :class:`FixedSize` — ``round(rate * num_units)`` units uniformly without replacement each
  step (accounted as sampling without replacement, replace-one adjacency, RDP only).
* :class:`Shuffle` — fixed batches of one shuffled pass per epoch, as most papers *did*;
  there is no proven amplification. The record then says the epsilon assumes Poisson and also
  gives the no-amplification guarantee.

Variable cohort sizes keep vectorization by padding each chunk of units to one of a few bucket
sizes (:func:`bucket_size`): the padding units carry mask 0 and contribute nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from userdp.registry import Registry


@dataclass(frozen=True)
class Poisson:
    mode = "poisson"

    def sample(self, num_units: int, rate: float, step: int, rng: np.random.Generator, state: dict) -> np.ndarray:
        return np.flatnonzero(rng.random(num_units) < rate)


@dataclass(frozen=True)
class FixedSize:
    mode = "fixed_size_wor"

    def sample(self, num_units, rate, step, rng, state):
        m = max(1, int(round(rate * num_units)))
        return np.sort(rng.choice(num_units, size=m, replace=False))


@dataclass(frozen=True)
class Shuffle:
    """Fixed batches of ``round(rate*num_units)`` units from a fresh permutation each epoch."""

    mode = "shuffle_fixed_batches"

    def sample(self, num_units, rate, step, rng, state):
        m = max(1, int(round(rate * num_units)))
        per_epoch = max(1, num_units // m)
        epoch, k = divmod(step, per_epoch)
        if state.get("epoch") != epoch:
            state["epoch"] = epoch
            state["perm"] = rng.permutation(num_units)
        return np.sort(state["perm"][k * m : (k + 1) * m])


#: name -> sampler; ``TrainConfig.sampling`` picks one
SAMPLERS: Registry = Registry("sampling", {"poisson": Poisson(), "fixed_size": FixedSize(), "shuffle": Shuffle()})


def get_sampler(name: str):
    """The sampler called ``name``.

    Raises:
        UserError: an unknown name (the message lists the registered ones)."""
    return SAMPLERS.lookup(name)


def bucket_size(n: int, max_size: int) -> int:
    """Smallest bucket >= n among powers of two below ``max_size`` and ``max_size`` itself."""
    if n >= max_size:
        return max_size
    b = 1
    while b < n:
        b *= 2
    return min(b, max_size)
