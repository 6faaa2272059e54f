"""The mechanism of a run: the one place where an algorithm's unit, its sampling and its noise
become a step's ``DpEvent``.

Every caller that needs a step event — the engine's run plan, calibration, the ledger, the CLI
``account``/``calibrate``, the planner's heuristics, the experiments and the LM job's budget
check — builds a :class:`Mechanism` and asks it. Which event a step is:

========================  ===============================================================
kind                      one step's event
========================  ===============================================================
``els``                   records Poisson-sampled at p, <= G per user: mixture of Gaussians
                          with sensitivity Binomial(G, p) (the Poisson Gaussian when G = 1)
``uls``                   users Poisson-sampled at q: Poisson-subsampled Gaussian
``uls_cyclic``            users split into b groups by a keyed hash of their ids; step t samples
                          group t mod b at q·b: a user takes part in at most ceil(T/b) steps,
                          b apart, so the run is the Poisson-subsampled Gaussian at q·b composed
                          ceil(T/b) times (:meth:`Mechanism.compositions`; with b-banded
                          matrix-factorization noise as with independent noise: jax_privacy's
                          ``amplified_bandmf_event``, Choquette-Choo et al. 2023, Thm. 4)
``fixed_cohort``          m of N units without replacement: replace-one adjacency (RDP)
``no_amplification``      no amplification (shuffled fixed batches): Gaussian, sensitivity G
========================  ===============================================================
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from dp_accounting import dp_event as dpe

from userdp.accounting.accountants import delta as _delta
from userdp.accounting.accountants import epsilon as _epsilon
from userdp.accounting.calibration import calibrate_noise_multiplier
from userdp.accounting.events import (
    adjacency,
    compose,
    els_step_event,
    event_to_dict,
    fixed_cohort_step_event,
    no_amplification_step_event,
    uls_step_event,
)
from userdp.errors import UserError
from userdp.validation import check_int

#: the most bands a cyclic sampler may have (each band is a model-sized noise buffer with BandMF)
MAX_BANDS = 4096

#: what the training-side sampling modes are called (``TrainConfig.sampling``)
SAMPLINGS = ("poisson", "fixed_size", "shuffle", "cyclic_poisson")
#: what a privacy unit is for the sampler
UNITS = ("record", "user")


def cycle_compositions(steps: int, bands: int) -> int:
    """How many times ``steps`` steps compose the step event when users are sampled in a cycle of
    ``bands`` groups: a user takes part in one step of each cycle begun, ceil(steps / bands) (steps
    itself for one band). The one count the mechanism, the ledger, the run plan and the report use."""
    return -(-int(steps) // int(bands))


@dataclasses.dataclass(frozen=True)
class UnitSampling:
    """What a training step samples: its ``unit`` (``record``: ELS, one user owns up to
    ``group_size`` of them; ``user``) at ``sampling_rate``. The engine's algorithms
    (``userdp.engine.ELS``, ``ULS``, ...) carry the same three fields and are accepted as they are."""

    unit: str
    sampling_rate: float
    group_size: int = 1


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """A training run's mechanism, as the privacy report records it.

    Args:
        kind: ``els`` | ``uls`` | ``fixed_cohort`` | ``no_amplification``.
        noise_multiplier: sigma, the noise std on the sum over the per-unit sensitivity (> 0).
        steps: the number of steps (>= 1).
        sampling_rate: p (ELS, records) or q (ULS, users).
        group_size: G (ELS: the records a user can own; no_amplification: the user's whole
            sensitivity in units).
        num_users, cohort_size: N and m of a fixed cohort.
        bands: b, the cycle of ``uls_cyclic`` (users in b groups; a user's steps are b apart);
            1 for every other kind.

    Raises:
        UserError: an unknown kind or a parameter out of range (checked at construction).
    """

    kind: str
    noise_multiplier: float
    steps: int
    sampling_rate: float | None = None
    group_size: int = 1
    num_users: int | None = None
    cohort_size: int | None = None
    bands: int = 1

    KINDS = ("els", "uls", "fixed_cohort", "no_amplification", "uls_cyclic")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise UserError(f"mechanism kind must be one of {', '.join(self.KINDS)} (got {self.kind!r})")
        check_int(self.bands, "bands", 1, MAX_BANDS)
        if self.bands > 1 and self.kind != "uls_cyclic":
            raise UserError(
                f"bands = {self.bands}: only user-level cyclic Poisson sampling has bands (kind uls_cyclic)"
            )
        self.step_event()  # validates the parameters
        check_int(self.steps, "steps")

    @classmethod
    def for_training(
        cls,
        units: UnitSampling,
        sampling: str,
        noise_multiplier: float,
        steps: int,
        num_units: int | None = None,
        bands: int = 1,
    ) -> Mechanism:
        """The mechanism of a training run, from what the sampler does to what a unit is.

        Args:
            units: the unit, its sampling rate and G (a :class:`UnitSampling`, or an engine
                algorithm, which has the same fields): ``record`` (ELS: a user owns up to
                ``group_size`` units) or ``user``.
            sampling: ``poisson`` (as accounted), ``fixed_size`` (``num_units`` needed: cohorts of
                max(1, round(rate · num_units)); ELS only with G = 1), or ``shuffle`` (no
                amplification: the Gaussian mechanism with the user's whole sensitivity), or
                ``cyclic_poisson`` (users only: ``bands`` groups, group t mod b sampled at rate·b).
            noise_multiplier, steps, bands: as in the class.

        Raises:
            UserError: an unknown unit or sampling, a fixed-size ELS run with G > 1 (no
                accounted sampler), or cyclic Poisson sampling of records (no accounting).
        """
        unit, rate, group_size = units.unit, units.sampling_rate, units.group_size
        if unit not in UNITS:
            raise UserError(f"unit must be one of {', '.join(UNITS)} (got {unit!r})")
        if sampling == "cyclic_poisson":
            if unit != "user":
                raise UserError(
                    "cyclic Poisson sampling is accounted for users only (ULS, DP-FedAvg): ELS samples records, "
                    "and a user's records in b-spaced steps have no mixture-of-Gaussians accounting here; use "
                    "algorithm uls, or sampling poisson"
                )
            return cls("uls_cyclic", noise_multiplier, steps, sampling_rate=rate, bands=bands)
        if bands != 1:
            raise UserError(f"bands = {bands} needs sampling 'cyclic_poisson' (got {sampling!r})")
        owned = int(group_size) if unit == "record" else 1  # units one user can own
        if sampling == "shuffle":
            return cls("no_amplification", noise_multiplier, steps, group_size=owned)
        if sampling == "fixed_size":
            if owned > 1:
                raise UserError(
                    "ELS with G > 1 has no accounted fixed-size sampler; use sampling='poisson' "
                    "(or 'shuffle', which reports the no-amplification guarantee too)"
                )
            cohort = None if num_units is None else max(1, int(round(rate * num_units)))
            return cls("fixed_cohort", noise_multiplier, steps, num_users=num_units, cohort_size=cohort)
        if sampling != "poisson":
            raise UserError(f"sampling must be one of {', '.join(SAMPLINGS)} (got {sampling!r})")
        if unit == "record":
            return cls("els", noise_multiplier, steps, sampling_rate=rate, group_size=group_size)
        return cls("uls", noise_multiplier, steps, sampling_rate=rate)

    def step_event(self, noise_multiplier: float | None = None) -> dpe.DpEvent:
        """One step's DpEvent (at ``noise_multiplier`` instead of this one's, when given).

        Raises:
            UserError: a parameter out of range for the kind.
        """
        z = self.noise_multiplier if noise_multiplier is None else noise_multiplier
        if self.kind == "els":
            return els_step_event(z, self._rate(), self.group_size)
        if self.kind == "uls":
            return uls_step_event(z, self._rate())
        if self.kind == "uls_cyclic":
            return uls_step_event(z, self.group_rate)
        if self.kind == "fixed_cohort":
            if self.num_users is None or self.cohort_size is None:
                raise UserError("a fixed_cohort mechanism needs num_users and cohort_size")
            return fixed_cohort_step_event(z, self.num_users, self.cohort_size)
        return no_amplification_step_event(z, self.group_size)

    def _rate(self) -> float:
        if self.sampling_rate is None:
            raise UserError(f"a {self.kind} mechanism needs sampling_rate")
        return self.sampling_rate

    @property
    def group_rate(self) -> float:
        """The rate each user of the step's group is sampled at: q·b (q for every kind but
        ``uls_cyclic``, where b > 1).

        Raises:
            UserError: q·b above 1 (fewer users a step than q·N: the compute the rate promised)."""
        q = self._rate()
        if self.bands == 1:
            return q
        if q * self.bands > 1.0 + 1e-12:
            raise UserError(
                f"sampling rate {q:.4g} with {self.bands} bands samples each group at q·b = {q * self.bands:.4g} > 1: "
                f"use at most {int(1.0 / q)} bands, or a smaller cohort"
            )
        return min(1.0, q * self.bands)

    def compositions(self, steps: int | None = None) -> int:
        """How many times the step event composes over ``steps`` steps (default: the run's):
        ``steps`` itself, except for ``uls_cyclic``, where a user takes part in at most
        ceil(steps / b) of them (one step of each cycle of b). The count of a prefix of the run is
        the count of its own steps, so a run that stops early has spent what its steps spent."""
        return cycle_compositions(self.steps if steps is None else steps, self.bands)

    def event(self) -> dpe.DpEvent:
        """The whole run's DpEvent: :meth:`step_event` composed :meth:`compositions` times."""
        return compose(self.step_event(), self.compositions())

    def replace(self, **changes: Any) -> Mechanism:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def calibrated(self, epsilon: float, delta: float, accountant: str = "pld", prior=()) -> Mechanism:
        """This mechanism with the smallest noise multiplier that meets (epsilon, delta) over its
        steps (never below the true one; see :func:`~userdp.accounting.calibrate_noise_multiplier`),
        after the ``prior`` events (released before the steps) where there are any.

        Raises:
            UserError: epsilon/delta out of range, or no noise multiplier meets them.
        """
        z = calibrate_noise_multiplier(self.step_event, self.compositions(), epsilon, delta, accountant, prior=prior)
        return self.replace(noise_multiplier=z)

    @property
    def adjacency(self) -> str:
        """``add_or_remove_one`` or ``replace_one`` (fixed cohorts)."""
        return adjacency(self.step_event())

    def epsilon(self, delta: float, accountant: str = "pld") -> float:
        """epsilon of the whole run at ``delta`` (an upper bound)."""
        return _epsilon(self.event(), delta, accountant)

    def delta(self, epsilon_: float, accountant: str = "pld") -> float:
        """delta of the whole run at ``epsilon_`` (an upper bound)."""
        return _delta(self.event(), epsilon_, accountant)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields, with the adjacency and the step event."""
        d = dataclasses.asdict(self)
        if self.bands == 1:  # the records of runs without a cycle read as they always have
            del d["bands"]
        d["adjacency"] = self.adjacency
        d["step_event"] = event_to_dict(self.step_event())
        return d

    def to_json(self) -> str:
        """:meth:`to_dict` as sorted JSON."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Mechanism:
        """Inverse of :meth:`to_dict` (extra keys ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
