"""The neighbour test: sensitivity as a tested property, for any path that releases a noisy sum.

A step of user-level DP releases ``S(D) + N``: the sum of the sampled units' clipped updates plus
Gaussian noise scaled to the sensitivity C. The guarantee needs ``|S(D ∪ {u}) - S(D)| <= C`` for
every dataset D and every user u, *as computed* — not as believed from the algebra. This module
runs the same seeded step on D and on D plus one (adversarial) user, with identical noise and an
identical cohort for everyone else, and measures the difference of the two released sums in
float64. Plugin authors run it on their per-unit strategy, clipping or sampler::

    from userdp.engine.neighbour import neighbour_gap
    gap = neighbour_gap(build_model, data, attacker, loss_fn, config)
    assert gap.within()            # |S(D+u) - S(D)| <= C (1 + rtol) + atol

The same seed gives both runs the same noise draw and the same sampling draws for the users of
D (the added user comes last), so the difference of the released sums is the user's own
contribution plus the floating-point rounding of everyone else's — which the tolerance covers.
Use a sampling rate of 1 (every unit in the cohort) unless the sampler under test keeps the others'
membership: a sampler that moves other users when one is added fails here by design.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from userdp.engine.distributed.sharding import whole
from userdp.engine.plan import TrainConfig
from userdp.engine.private_loop import make_private
from userdp.engine.run.loop import start_run
from userdp.engine.run.options import RunOptions
from userdp.engine.user_data import TensorUserData, UserData
from userdp.errors import UserError

#: the default relative tolerance: float32 sums of a few hundred terms, reordered
RTOL = 1e-4


@dataclass(frozen=True)
class Gap:
    """What :func:`neighbour_gap` measured: ``gap`` = ``|S(D+u) - S(D)|`` (float64) and the
    ``sensitivity`` the noise was scaled to."""

    gap: float
    sensitivity: float
    rtol: float = RTOL
    atol: float = 1e-6

    @property
    def ratio(self) -> float:
        """``gap / sensitivity``: at most 1 (up to the tolerance) when the path is sound."""
        return self.gap / self.sensitivity

    def within(self) -> bool:
        """Whether the gap is within the sensitivity, up to the tolerance."""
        return math.isfinite(self.gap) and self.gap <= self.sensitivity * (1.0 + self.rtol) + self.atol


#: the entry points a step can be released through: ``userdp.engine.train``'s loop, or a loop the
#: caller writes around ``make_private`` (its ``step.backward()``)
ENTRIES = ("train", "make_private")


def released_sum(
    model: nn.Module, data: UserData, loss_fn: Callable, config: TrainConfig, *, combiner=None, entry: str = "train"
) -> tuple[list[torch.Tensor], float]:
    """One step's released noisy sum (the privatized gradient times its public denominator), float64,
    and the bound on one user's share of it: the sensitivity the noise was scaled to, times the units
    one user can own (G for ELS). ``model`` is trained in place (pass a fresh copy). ``entry``:
    ``"train"`` releases the step as :func:`userdp.engine.train` does; ``"make_private"`` through
    :func:`userdp.engine.make_private` and the step's ``backward()``, with an SGD optimizer over
    the model's trainable parameters."""
    if entry == "make_private":
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
        private = make_private(model, opt, data, loss_fn, config, RunOptions(combiner=combiner))
        run = private._run
        try:
            steps = iter(private)  # held: the loop's generator ends the step when it is dropped
            next(steps).backward()
            return _released(run), float(run._sensitivity()) * float(getattr(run.algo, "group_sensitivity", 1))
        finally:
            private.close()
    if entry != "train":
        raise UserError(f"released_sum: entry must be one of {', '.join(ENTRIES)} (got {entry!r})")
    run = start_run(model, data, loss_fn, config, RunOptions(combiner=combiner))
    try:
        run.release()
        # one user owns up to group_sensitivity units (ELS: G records, each clipped to C)
        return _released(run), float(run._sensitivity()) * float(getattr(run.algo, "group_sensitivity", 1))
    finally:
        run.chunks.close()


def _released(run) -> list[torch.Tensor]:
    """The step's released sum, float64: ``.grad`` times the public denominator, whole (gathered
    on every rank where the distribution left each rank part of them, as DTensors)."""
    den = float(run.last_denominator)
    return [whole(m.grad).detach().double() * den for m in run.master]


def neighbour_gap(
    build_model: Callable[[], nn.Module],
    data: UserData,
    added: UserData | None,
    loss_fn: Callable,
    config: TrainConfig,
    *,
    rtol: float = RTOL,
    combiner=None,
    entry: str = "train",
) -> Gap:
    """``|S(D ∪ added) - S(D)|`` for one seeded step (see the module docstring).

    Args:
        build_model: returns the same fresh model at every call (seed its initialisation).
        data: D, as :class:`TensorUserData`.
        added: the one user added (a :class:`TensorUserData` of one user), appended after D's users;
            None measures the run against itself (a gap of 0: the determinism check).
        loss_fn: ``loss_fn(model, batch) -> Tensor[n]``.
        config: the run's config; it must have a seed (both runs draw the same noise).
        entry: ``"train"`` or ``"make_private"`` (:data:`ENTRIES`): the path the step is released by.

    Raises:
        UserError: no seed, or data that is not TensorUserData.
    """
    if config.seed is None:
        raise UserError("neighbour_gap: config.seed is required (both runs must draw the same noise)")
    if not isinstance(data, TensorUserData) or (added is not None and not isinstance(added, TensorUserData)):
        raise UserError("neighbour_gap: data and added must be TensorUserData")
    if added is not None and added.num_users != 1:
        raise UserError(f"neighbour_gap: added must hold exactly one user, it holds {added.num_users}")
    bigger = data if added is None else join(data, added)
    config = replace(config, performance=replace(config.performance, checkpoint_every=0))
    s0, sens0 = released_sum(build_model(), data, loss_fn, config, combiner=combiner, entry=entry)
    s1, sens1 = released_sum(build_model(), bigger, loss_fn, config, combiner=combiner, entry=entry)
    diff = math.sqrt(sum(float(((a - b) ** 2).sum()) for a, b in zip(s1, s0, strict=True)))
    return Gap(diff, max(sens0, sens1), rtol)


def join(data: TensorUserData, added: TensorUserData) -> TensorUserData:
    """D with ``added``'s users appended after its own (their rows last)."""
    if set(data.tensors) != set(added.tensors):
        raise UserError(f"join: the added user's fields {sorted(added.tensors)} differ from D's {sorted(data.tensors)}")
    tensors = {k: torch.cat([data.tensors[k], added.tensors[k].to(data.tensors[k].dtype)]) for k in data.tensors}
    offsets = np.concatenate([data.offsets, data.offsets[-1] + added.offsets[1:]])
    return TensorUserData(tensors, offsets)
