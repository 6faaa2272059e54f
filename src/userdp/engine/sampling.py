"""Which units take part in a step (docs/accounting.md). Poisson by default, exactly.

* :class:`Poisson` — every unit independently with probability ``rate``; the cohort size is
  Binomial(num_units, rate) and varies from step to step. This is what the accountant assumes.
* :class:`FixedSize` — ``round(rate * num_units)`` units uniformly without replacement each
  step (accounted as sampling without replacement, replace-one adjacency, RDP only).
* :class:`Shuffle` — fixed batches of one shuffled pass per epoch, as most papers *did*;
  there is no proven amplification. The record then says the epsilon assumes Poisson and also
  gives the no-amplification guarantee.
* :class:`CyclicPoisson` — users split into b groups by a keyed hash of each user's own id; step
  t Poisson-samples group t mod b at rate q·b (the expected cohort stays q·N). A user takes part
  only in steps of its group, b apart: what banded matrix-factorization noise needs
  (:mod:`userdp.engine.noise.bandmf`), accounted as ceil(T/b) compositions
  (:meth:`userdp.accounting.Mechanism.compositions`).

On a device, a chunk of units is padded to one of a few bucket sizes (:func:`bucket_size`), so a
run's chunks take a few shapes whatever its cohorts; on a CPU it is computed as it is
(:func:`userdp.engine.run.cohort.padded_size`). Padding units carry mask 0 and contribute nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from userdp.errors import UserError
from userdp.keyed_hash import keyed_uniforms
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


@dataclass(frozen=True)
class CyclicPoisson:
    """Cyclic Poisson sampling of users (jax_privacy's ``CyclicPoissonSampling`` with a user's group
    fixed by its id): user u is in group ``floor(b · h(u))``, h the keyed hash of its id
    (:func:`keyed_uniforms`), so whether one user is present moves no other user's group; step t
    samples each user of group ``t mod b`` independently at ``rate · b``. The run's state holds the
    groups (:meth:`initial_state`; derived from the data, never saved)."""

    mode = "cyclic_poisson_users"
    accounted_as = "cyclic_poisson"

    def initial_state(self, unit_keys: list, bands: int) -> dict:
        """The state a run starts (and resumes) with: each unit's group and the cycle's length."""
        groups = np.floor(keyed_uniforms(unit_keys, 0, "cyclic-poisson") * int(bands)).astype(np.int64)
        return {"groups": np.minimum(groups, int(bands) - 1), "bands": int(bands)}

    def sample(self, num_units, rate, step, rng, state):
        if "groups" not in state:
            raise UserError("cyclic_poisson sampling needs the run's groups (initial_state): use it through a run")
        bands, groups = state["bands"], state["groups"]
        u = rng.random(num_units)  # one draw per unit, whatever its group: an added unit moves no one
        return np.flatnonzero((groups == step % bands) & (u < min(1.0, rate * bands)))


#: name -> sampler; ``TrainConfig.sampling`` (``privacy.sampler`` in a config) picks one
SAMPLERS: Registry = Registry(
    "sampling",
    {"poisson": Poisson(), "fixed_size": FixedSize(), "shuffle": Shuffle(), "cyclic_poisson": CyclicPoisson()},
)

#: the samplings the accounting knows: a registered sampler declares which one its draws follow
ACCOUNTED = ("poisson", "fixed_size", "shuffle", "cyclic_poisson")


def get_sampler(name: str):
    """The sampler called ``name``.

    Raises:
        UserError: an unknown name (the message lists the registered ones)."""
    return SAMPLERS.lookup(name)


def accounted_as(name: str) -> str:
    """The sampling whose accounting the sampler ``name`` follows: itself for the built-in ones,
    else the ``accounted_as`` it declares (``"poisson"`` for a sampler whose every unit is in
    each cohort independently with probability ``rate``). The plan derives the step's DpEvent
    from it, so a plugin sampler states its own accounting and nothing compares its name.

    Raises:
        UserError: an unknown sampler, or one that declares no accounting the library knows."""
    sampler = get_sampler(name)
    if name in ACCOUNTED:
        return name
    base = getattr(sampler, "accounted_as", None)
    if base not in ACCOUNTED:
        raise UserError(
            f"sampling {name!r}: a registered sampler must declare accounted_as, one of "
            f"{', '.join(ACCOUNTED)} (the sampling whose accounting its draws follow); it declares {base!r}"
        )
    return base


def register_sampler(sampler, name: str | None = None):
    """Make ``sampler`` available by name (``privacy.sampler`` in a config, ``TrainConfig.sampling``).
    It needs ``mode`` (the record's name for it), ``accounted_as`` and ``sample(num_units, rate,
    step, rng, state) -> sorted unit indices``.

    Raises:
        UserError: the name is taken."""
    return SAMPLERS.register(sampler, name=name or getattr(sampler, "name", None))


def bucket_size(n: int, max_size: int) -> int:
    """Smallest bucket >= n among powers of two below ``max_size`` and ``max_size`` itself."""
    if n >= max_size:
        return max_size
    b = 1
    while b < n:
        b *= 2
    return min(b, max_size)
