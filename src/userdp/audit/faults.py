"""Deliberately broken builds, to prove that the audit can catch one (an audit that cannot catch a
broken mechanism proves nothing).

A fault is a broken *part* handed to the run's plan, never a patch of an engine class: a
:class:`BrokenPlan` gives the run a noise mechanism or a clipping strategy that does something else
than the config says, while the plan's mechanism, its sensitivity and so the accounted epsilon stay
the intact build's:

* ``noise_off``: a noise mechanism that adds nothing to the clipped sum;
* ``clipping_off``: a flat clipping that does not clip (the sensitivity the accountant assumes is false);
* ``user_counted_g_times``: a flat clipping whose every factor is ``times`` times the true one, so
  each sampled unit's clipped update is added ``times`` times (a user whose G records were each
  treated as a unit: sensitivity ``times * C``).

The plan names its fault (``RunPlan.broken_build``), and the run's record, and so ``privacy.json``,
carries ``"broken_build": <fault>``. :func:`broken_plan` breaks a plan for :func:`userdp.engine.train`;
:func:`broken_session` gives ``userdp train``'s job an audit session that breaks the job's plan
(``Launch(audit=broken_session(fault))``). Used by the tests and ``benchmarks/bench_audit.py``;
never by the CLI.
"""

from __future__ import annotations

import dataclasses

import torch

from userdp.audit.session import AuditSession
from userdp.engine.clipping import FlatClip
from userdp.engine.noise.mechanism import IIDGaussian
from userdp.engine.plan import RunPlan, TrainConfig, make_plan
from userdp.engine.user_data import UserData
from userdp.errors import UserError

FAULTS = ("noise_off", "clipping_off", "user_counted_g_times")


class SilentGaussian(IIDGaussian):
    """i.i.d. Gaussian noise that adds nothing (``noise_off``): its draws are made as the intact
    mechanism's are, and filtered to zero (under every distribution: the filter is what a sharded
    step applies to each rank's shards too)."""

    filtered = True

    def filter(self, z, lo, state):
        return z.zero_()


@dataclasses.dataclass(frozen=True)
class Unclipped(FlatClip):
    """Flat clipping that does not clip (``clipping_off``): every factor is 1, the norms as reported."""

    def factors_from_norms(self, tn: torch.Tensor, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        f, norms = super().factors_from_norms(tn, state)
        return torch.ones_like(f), norms


@dataclasses.dataclass(frozen=True)
class CountedTimes(FlatClip):
    """Flat clipping whose factors are ``times`` times the true ones (``user_counted_g_times``)."""

    times: int = 8

    def factors_from_norms(self, tn: torch.Tensor, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        f, norms = super().factors_from_norms(tn, state)
        return f * float(self.times), norms


@dataclasses.dataclass(frozen=True)
class BrokenPlan(RunPlan):
    """A run plan whose parts are broken as its ``broken_build`` names (see the module docstring);
    everything it accounts (mechanism, sensitivity, epsilon) is the intact plan's."""

    times: int = 8

    def make_noise(self, source):
        if self.broken_build == "noise_off":
            return SilentGaussian(source)
        return super().make_noise(source)

    @property
    def clipping(self):
        base = self.config.clipping
        if self.broken_build == "clipping_off":
            return Unclipped(base.norm, base.normalized)
        if self.broken_build == "user_counted_g_times":
            return CountedTimes(base.norm, base.normalized, times=self.times)
        return base


def _check_fault(fault: str) -> None:
    """Raises: UserError: ``fault`` is not one of :data:`FAULTS`."""
    if fault not in FAULTS:
        raise UserError(f"unknown fault {fault!r} (one of {', '.join(FAULTS)})")


def broken_plan(plan: RunPlan, fault: str, times: int = 8) -> BrokenPlan:
    """``plan`` with the part ``fault`` names broken (see the module docstring).

    Raises:
        UserError: an unknown fault, or one the plan cannot carry (``noise_off`` breaks i.i.d.
            Gaussian noise; the clipping faults break flat clipping)."""
    _check_fault(fault)
    if fault == "noise_off" and plan.noise_mechanism is not IIDGaussian:
        raise UserError(f"fault noise_off breaks i.i.d. Gaussian noise, not {plan.noise_mechanism.__name__}")
    if fault != "noise_off" and type(plan.config.clipping) is not FlatClip:
        raise UserError(f"fault {fault} breaks flat clipping, not {type(plan.config.clipping).__name__}")
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(RunPlan)}
    return BrokenPlan(**{**fields, "broken_build": fault}, times=int(times))


def broken_train_plan(config: TrainConfig, data: UserData, fault: str, times: int = 8) -> BrokenPlan:
    """The plan :func:`userdp.engine.train` makes of ``config`` on ``data``, broken by ``fault``
    (its units counted as the engine counts them: users, or |D'| for ELS)."""
    algorithm = config.algorithm
    units = algorithm.count_units(data.sizes(), getattr(algorithm, "group_size", 1))
    return broken_plan(make_plan(config, num_users=data.num_users, num_units=units), fault, times)


def broken_session(fault: str, times: int = 8) -> type[AuditSession]:
    """An audit session for ``Launch(audit=...)`` that hands the job's plan the broken part (an
    unknown fault is refused here, before the job starts)."""
    _check_fault(fault)

    class BrokenSession(AuditSession):
        def plan(self, plan: RunPlan) -> RunPlan:
            return broken_plan(plan, fault, times)

    return BrokenSession
