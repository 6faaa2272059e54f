"""A frozen config makes a frozen run plan: the single source of truth for a run's mechanism.

:class:`TrainConfig` is what the user chooses; :func:`make_plan` turns it, with the counts of the
data (users, units, total weight), into a :class:`RunPlan` that holds everything that decides the
guarantee: the algorithm (what a unit is and its update), the clipping strategy, the sampler, the
public denominator, the noise (the accounted multiplier, the update's multiplier after adaptive
clipping's split, the count query's std), delta, the accountant and the
:class:`~userdp.accounting.Mechanism` whose DpEvent the ledger records. The training loop reads
the plan; so do the LM job's budget check, the CLI and the report (jax_privacy's
``execution_plan`` is the model: the config *makes* the plan; nothing downstream re-derives it).

Calibration returns a new plan (:meth:`RunPlan.calibrated`); so does a change of noise
multiplier (:meth:`RunPlan.with_noise_multiplier`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dp_accounting import dp_event as dpe

from userdp import accounting
from userdp.accounting.split import update_noise_multiplier
from userdp.engine.aggregation import ClippedDenominator, FixedDenominator
from userdp.engine.algorithms import ALGORITHMS, ELS, ULS, FedAvg
from userdp.engine.clipping import AdaptiveClip, FlatClip, PerLayerClip
from userdp.engine.noise.mechanism import NOISE_MECHANISMS
from userdp.engine.optimizers import SGD, Adafactor, Adam
from userdp.engine.performance import PERFORMANCE_FIELDS, Performance
from userdp.engine.sampling import accounted_as, get_sampler
from userdp.errors import UserError
from userdp.validation import (
    MAX_STEPS,
    check_fields,
    check_fraction,
    check_instance,
    check_int,
    check_nonnegative,
    check_string,
    optional,
)

#: (sampling, unit) -> the sampler mode the record names
SAMPLER_MODE = {
    ("poisson", "record"): "poisson_examples",
    ("poisson", "user"): "poisson_users",
    ("fixed_size", "record"): "fixed_size_wor",
    ("fixed_size", "user"): "fixed_size_wor",
    ("shuffle", "record"): "shuffle_fixed_batches",
    ("shuffle", "user"): "shuffle_fixed_batches",
    ("cyclic_poisson", "user"): "cyclic_poisson_users",
}


class _RefusesMovedSettings(type):
    """TrainConfig's metaclass: a 0.9 setting now in :class:`~userdp.engine.performance.Performance`
    (``TrainConfig(chunk_size=8)``, or ``dataclasses.replace(config, chunk_size=8)``) is refused in
    one line that says where it went, instead of an unexpected-keyword TypeError."""

    def __call__(cls, *args, **kwargs):
        moved = [k for k in kwargs if k in PERFORMANCE_FIELDS]
        if moved:
            given = ", ".join(f"{k}={kwargs[k]!r}" for k in moved)
            raise UserError(
                f"{', '.join(moved)}: a performance setting, a field of Performance since userdp 0.10: "
                f"TrainConfig(..., performance=Performance({given}))"
            )
        return super().__call__(*args, **kwargs)


@dataclass(frozen=True)
class TrainConfig(metaclass=_RefusesMovedSettings):
    """Everything that defines a run (and its guarantee).

    Give either ``noise_multiplier`` (sigma; with adaptive clipping this is the *effective*
    multiplier the accountant sees, and the update's z_Delta is derived by the Theorem-1 split),
    or ``target_epsilon`` (with ``steps``) to calibrate sigma. With both, sigma is used and the
    run stops before epsilon would pass the target. ``noise_multiplier=0`` is a non-private run
    (epsilon = inf; refused together with a target). ``delta`` None -> N^-1.1.
    ``sampling``: "poisson" (default, as accounted), or on explicit request "fixed_size"
    (without replacement, replace-one, RDP) or "shuffle" (fixed batches; no amplification).
    ``noise``: the noise mechanism (a name in
    :data:`~userdp.engine.noise.mechanism.NOISE_MECHANISMS`); ``accountant``: a registered accountant;
    ``performance``: how the run computes (:class:`~userdp.engine.performance.Performance`: chunk
    size, per-unit strategy, precision, distribution, checkpoint cadence), outside the config's
    equality and ``repr`` and so outside what a run's journal is bound to. ``prior_events``: ``dp_accounting``
    DpEvents released about the same people before training (e.g. the DP median that chose G): the
    ledger counts them before the first step, against ``target_epsilon`` like the steps, and a
    calibrated sigma leaves room for them; the journal is bound to them (they are a privacy
    setting). ``bands``: b, the cycle of ``sampling="cyclic_poisson"`` (users in b groups, a user's
    steps b apart) and the band count of ``noise="bandmf"`` (:mod:`~userdp.engine.noise.bandmf`).

    Raises:
        UserError: a value out of range or a combination that cannot be accounted.
    """

    algorithm: ELS | ULS | FedAvg  # or any registered algorithm class (engine.algorithms.ALGORITHMS)
    steps: int
    clipping: FlatClip | PerLayerClip | AdaptiveClip = FlatClip(1.0)
    optimizer: SGD | Adam | Adafactor = SGD(0.1)
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float | None = None
    accountant: str = "pld"
    sampling: str = "poisson"
    denominator: FixedDenominator | ClippedDenominator = FixedDenominator()
    seed: int | None = None
    noise: str = "iid_gaussian"
    prior_events: tuple = ()
    bands: int = 1
    performance: Performance = field(default=Performance(), compare=False, repr=False)

    def __post_init__(self):
        # the one boundary of the engine's config: every field's type and range, converted in
        # place, so that a nan sigma, a string clip or a float step count never reaches a step
        check_instance(
            self.algorithm,
            "algorithm",
            tuple(ALGORITHMS[n] for n in ALGORITHMS),
            f"an algorithm ({', '.join(ALGORITHMS[n].__name__ for n in ALGORITHMS)})",
        )
        check_instance(
            self.clipping, "clipping", (FlatClip, PerLayerClip, AdaptiveClip), "FlatClip, PerLayerClip or AdaptiveClip"
        )
        if not callable(getattr(self.optimizer, "build", None)):
            raise UserError(
                f"optimizer must be SGD, Adam, Adafactor or an object with build(params) "
                f"(got {type(self.optimizer).__name__})"
            )
        check_instance(
            self.denominator,
            "denominator",
            (FixedDenominator, ClippedDenominator),
            "FixedDenominator() or ClippedDenominator()",
        )
        check_fields(
            self,
            steps=(check_int, "steps", 1, MAX_STEPS),
            noise_multiplier=(optional(check_nonnegative), "noise_multiplier"),
            target_epsilon=(optional(accounting.check_target_epsilon), "target_epsilon"),
            delta=(optional(check_fraction), "delta"),
            accountant=(check_string, "accountant"),
            sampling=(check_string, "sampling"),
            seed=(optional(check_int), "seed", 0),
            noise=(check_string, "noise"),
            bands=(check_int, "bands", 1, accounting.MAX_BANDS),
        )
        if not isinstance(self.prior_events, (tuple, list)):
            raise UserError(
                f"prior_events must be a tuple of dp_accounting DpEvents (got {type(self.prior_events).__name__})"
            )
        object.__setattr__(self, "prior_events", tuple(self.prior_events))
        for i, event in enumerate(self.prior_events):
            check_instance(event, f"prior_events[{i}]", (dpe.DpEvent,), "a dp_accounting DpEvent")
        if self.prior_events and self.noise_multiplier == 0:
            raise UserError("prior_events: a non-private run (noise_multiplier=0) has no guarantee to count them in")
        if self.noise_multiplier is None and self.target_epsilon is None:
            raise UserError("give a noise_multiplier or a target_epsilon to calibrate one")
        if self.noise_multiplier == 0 and self.target_epsilon is not None:
            raise UserError("noise_multiplier=0 is non-private: it cannot meet a target epsilon")
        sampling = accounted_as(self.sampling)  # a registered sampler states its accounting (else refused)
        accounting.get_accountant(self.accountant)
        NOISE_MECHANISMS.lookup(self.noise)
        check_instance(self.performance, "performance", (Performance,), "a Performance (userdp.engine.performance)")
        if sampling == "fixed_size" and self.accountant != "rdp":
            raise UserError("sampling='fixed_size' is accounted with RDP (replace-one): set accountant='rdp'")
        if isinstance(self.denominator, ClippedDenominator) and self.clipping.adaptive:
            raise UserError("adaptive clipping uses the fixed denominator")
        _check_bands(self, sampling)


def _check_bands(config: TrainConfig, sampling: str) -> None:
    """The combinations of cyclic sampling and banded noise that are accounted; the rest refused in
    one line each.

    Raises:
        UserError: naming the setting to change."""
    banded = getattr(NOISE_MECHANISMS.lookup(config.noise), "banded", False)
    if sampling == "cyclic_poisson" and config.algorithm.unit != "user":
        raise UserError(
            "sampling 'cyclic_poisson' samples users (ULS, DP-FedAvg): ELS samples records, and a user's records "
            "in b-spaced steps have no mixture-of-Gaussians accounting here; use algorithm uls"
        )
    if config.bands > 1 and sampling != "cyclic_poisson":
        raise UserError(
            f"bands = {config.bands} needs sampling 'cyclic_poisson' (users in b groups, a user's steps b apart); "
            f"got {config.sampling!r}"
        )
    if not banded:
        return
    if sampling != "cyclic_poisson":
        raise UserError(
            f"noise 'bandmf' needs sampling 'cyclic_poisson' with the same bands: under {config.sampling!r} sampling "
            "a user can take part in steps less than b apart, where banded noise is not accounted"
        )
    if config.clipping.adaptive:
        raise UserError(
            "noise 'bandmf' needs a constant sensitivity: adaptive clipping moves the clip norm during the "
            "run; use a fixed clip (FlatClip / PerLayerClip), e.g. one chosen by userdp plan"
        )
    if isinstance(config.denominator, ClippedDenominator):
        raise UserError(
            "noise 'bandmf' needs the same noise scale every step: the clipped denominator scales it by the "
            "step's weight; use the fixed denominator"
        )


def privacy_repr(config: TrainConfig) -> str:
    """``repr`` of ``config``: what a run's ledger journal and checkpoints are bound to. Its
    :class:`~userdp.engine.performance.Performance` is not in it (a resume may change how the run
    computes, nothing else)."""
    return repr(config)


def config_difference(saved: str, current: str) -> str:
    """Which fields differ between two :func:`privacy_repr` strings, in words (``"steps: 10 there,
    20 here"``): what a refused resume names. Fields are split at the top level of the repr."""
    a, b = _repr_fields(saved), _repr_fields(current)
    diff = [
        f"{k}: {a.get(k, '(absent)')} there, {b.get(k, '(absent)')} here"
        for k in list(a) + [k for k in b if k not in a]
        if a.get(k) != b.get(k)
    ]
    return (
        "; ".join(diff[:3]) + (f" and {len(diff) - 3} more" if len(diff) > 3 else "") if diff else "the config differs"
    )


def held_performance(saved: str) -> bool:
    """Whether a :func:`privacy_repr` string read from a checkpoint was written by userdp 0.9 or
    earlier, whose ``TrainConfig`` held the performance settings as its own fields (``chunk_size=64,
    ...``): such a run resumes under the version that wrote it, not this one."""
    return any(name in PERFORMANCE_FIELDS for name in _repr_fields(saved))


def _repr_fields(text: str) -> dict[str, str]:
    """``TrainConfig(a=1, b=X(c=2))`` -> ``{"a": "1", "b": "X(c=2)"}`` (top-level fields only)."""
    start = text.find("(")
    body = text[start + 1 : -1] if start >= 0 and text.endswith(")") else text
    fields, depth, cur = {}, 0, ""
    for ch in body + ",":
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            key, _, value = cur.strip().partition("=")
            if key:
                fields[key] = value
            cur = ""
        else:
            cur += ch
    return fields


@dataclass(frozen=True)
class RunPlan:
    """The frozen plan of one run (see the module docstring). Build it with :func:`make_plan`.

    Attributes:
        config: the :class:`TrainConfig` it was made from (its ``noise_multiplier`` may be None:
            the plan's :attr:`noise_multiplier` is the one used).
        unit: ``record`` (ELS) or ``user``.
        num_users, num_units: N, and the units the sampler draws from (|D'| for ELS).
        expected_units: units per step in expectation (Poisson) or the fixed cohort size.
        expected_weight: the public denominator's expectation (FedAvg weights, else = units).
        delta, delta_rule: delta and how it was chosen.
        noise_multiplier: sigma as the accountant sees it (0: non-private).
        update_noise_multiplier: z_Delta applied to the update sum (= sigma unless adaptive).
        count_stddev: adaptive clipping's count-query noise (None when not adaptive).
        mechanism: the accounted mechanism (None for a non-private run).
        safe_steps: steps the calibration guarantees within the target (None: not calibrated).
        sampler: the sampler that draws each step's cohort (``config.sampling`` looked up once
            in :data:`~userdp.engine.sampling.SAMPLERS`; a plugin's declares its accounting).
        noise_mechanism: the noise mechanism's class (``config.noise`` looked up once in
            :data:`~userdp.engine.noise.mechanism.NOISE_MECHANISMS`); the run instantiates it over its
            keyed source.
        broken_build: None, or the audit's deliberately broken part (:mod:`userdp.audit.faults`).

    The clipping strategy and the algorithm are the config's own frozen parts (:attr:`clipping`,
    :attr:`algorithm`); the settings that change how the run computes, not what it releases, are
    apart in :attr:`performance` (a resume may change them; the journal is not bound to them).
    """

    config: TrainConfig
    unit: str
    num_users: int
    num_units: int
    expected_units: float
    expected_weight: float
    delta: float
    delta_rule: str
    noise_multiplier: float
    update_noise_multiplier: float
    count_stddev: float | None
    mechanism: accounting.Mechanism | None
    safe_steps: int | None
    sampler: Any
    noise_mechanism: type
    broken_build: str | None = None

    # ---------------------------------------------------------------- what the plan says
    @property
    def algorithm(self):
        """The algorithm dataclass (unit, update, loading)."""
        return self.config.algorithm

    @property
    def clipping(self):
        """The clipping strategy the run clips by."""
        return self.config.clipping

    @property
    def performance(self) -> Performance:
        """How the run computes, not what it releases (:class:`~userdp.engine.performance.Performance`)."""
        return self.config.performance

    @property
    def accountant(self) -> str:
        """The registered accountant's name."""
        return self.config.accountant

    @property
    def sampling_rate(self) -> float:
        """p (ELS) or q (ULS/FedAvg)."""
        return float(self.config.algorithm.sampling_rate)

    @property
    def sampler_mode(self) -> str:
        """What the record calls the sampler (e.g. ``poisson_users``)."""
        return SAMPLER_MODE[(self.accounted_sampling, self.unit)]

    @property
    def accounted_sampling(self) -> str:
        """The sampling the accountant treats this run's sampler as (:func:`~userdp.engine.sampling.accounted_as`)."""
        return accounted_as(self.config.sampling)

    @property
    def private(self) -> bool:
        """False for ``noise_multiplier = 0`` (epsilon = inf)."""
        return self.mechanism is not None

    @property
    def step_event(self) -> dpe.DpEvent | None:
        """One step's DpEvent (None for a non-private run): what the ledger records per step."""
        return self.mechanism.step_event() if self.mechanism is not None else None

    def mechanism_for(self, sampling: str) -> accounting.Mechanism:
        """The mechanism the same run would have under another sampler (for the record's labelled
        comparisons, e.g. the Poisson-assumed epsilon of a shuffled run)."""
        return _mechanism(self.config, self.unit, sampling, self.noise_multiplier, self.num_units)

    @property
    def cycle(self) -> int:
        """b of cyclic sampling (a user's steps are b apart); 1 for every other sampler."""
        return self.config.bands if self.accounted_sampling == "cyclic_poisson" else 1

    def compositions(self, steps: int) -> int:
        """How many times the step event composes over ``steps`` steps (``steps`` but for cyclic
        sampling: ceil(steps / b), :meth:`userdp.accounting.Mechanism.compositions`)."""
        return accounting.cycle_compositions(steps, self.cycle)

    def make_noise(self, source):
        """The run's noise mechanism over its keyed ``source`` (a banded one gets the run's bands)."""
        cls = self.noise_mechanism
        return cls(source, bands=self.config.bands) if getattr(cls, "banded", False) else cls(source)

    def sensitivity(self, clip_state: dict, num_tensors: int) -> float:
        """The bound on one unit's contribution to the sum at ``clip_state``."""
        return self.config.clipping.sensitivity(clip_state, num_tensors)

    # ---------------------------------------------------------------- new plans
    def with_noise_multiplier(self, noise_multiplier: float, *, safe_steps: int | None = None) -> RunPlan:
        """The same plan at another (accounted) noise multiplier; adaptive clipping's split is redone.

        Raises:
            UserError: adaptive clipping's count noise cannot support that multiplier.
        """
        z = float(noise_multiplier)
        update_z, count_std = _noise_split(self.config, z, self.expected_units)
        mech = _mechanism(self.config, self.unit, self.accounted_sampling, z, self.num_units) if z > 0 else None
        return dataclasses.replace(
            self,
            noise_multiplier=z,
            update_noise_multiplier=update_z,
            count_stddev=count_std,
            mechanism=mech,
            safe_steps=safe_steps,
        )

    def calibrated(self, target_epsilon: float) -> RunPlan:
        """The plan with the smallest noise multiplier whose ``config.steps`` steps meet
        ``target_epsilon`` at the plan's delta (never below the truth).

        Raises:
            UserError: the target cannot be met (see :func:`~userdp.accounting.calibrate_noise_multiplier`).
        """
        base = self.mechanism_for(self.accounted_sampling) if self.mechanism is None else self.mechanism
        mech = base.calibrated(target_epsilon, self.delta, self.accountant, prior=self.config.prior_events)
        return self.with_noise_multiplier(mech.noise_multiplier, safe_steps=self.config.steps)


def _cohort(config: TrainConfig, num_units: int) -> int:
    return max(1, int(round(config.algorithm.sampling_rate * num_units)))


def _mechanism(config: TrainConfig, unit: str, sampling: str, z: float, num_units: int) -> accounting.Mechanism:
    """The one place a training config becomes a mechanism (and so a DpEvent)."""
    algo = config.algorithm
    units = accounting.UnitSampling(unit, algo.sampling_rate, algo.group_size)
    bands = config.bands if sampling == "cyclic_poisson" else 1  # another sampling's figure has no cycle
    return accounting.Mechanism.for_training(units, sampling, z if z > 0 else 1.0, config.steps, num_units, bands)


def _noise_split(config: TrainConfig, z: float, expected_units: float) -> tuple[float, float | None]:
    """(z_Delta on the update sum, sigma_b on the count): the Theorem-1 split for adaptive
    clipping (z is then the effective multiplier), else (z, None)."""
    if not config.clipping.adaptive:
        return z, None
    if z == 0:
        return z, 0.0
    count_std = config.clipping.resolved_count_stddev(expected_units)
    return update_noise_multiplier(z, count_std), count_std


def check_delta_for_users(delta: float, num_users: int, *, private: bool = True) -> None:
    """Refuse a delta of at least 1/N: a mechanism that publishes one random user's data outright
    is (0, 1/N)-DP, so such a delta promises nothing about any one user.

    Raises:
        UserError: naming delta, N and 1/N."""
    if private and num_users and delta * num_users >= 1.0:
        raise UserError(
            f"privacy.delta = {delta:g} is at least 1/N = {1 / num_users:.3g} (N = {num_users} users): "
            "a guarantee with such a delta allows publishing a user's data outright; use a delta well "
            f"below 1/N (the default is N^-1.1 = {float(num_users) ** -1.1:.3g})"
        )


def make_plan(config: TrainConfig, *, num_users: int, num_units: int, total_weight: float | None = None) -> RunPlan:
    """Make the run plan of ``config`` on data with these counts.

    Args:
        config: the run's configuration.
        num_users: N (delta's default rule N^-1.1).
        num_units: the units the sampler draws from (users; |D'| for ELS).
        total_weight: FedAvg's total user weight W (None: every unit weighs 1).

    Returns:
        The plan, calibrated when the config gives a target and no noise multiplier.

    Raises:
        UserError: counts out of range, or a target that cannot be met.
    """
    check_int(num_units, "num_units")
    unit = config.algorithm.unit
    if accounted_as(config.sampling) in ("poisson", "cyclic_poisson"):  # q·N a step (cyclic: q·b of N/b)
        expected_units = config.algorithm.sampling_rate * num_units
    else:
        expected_units = float(_cohort(config, num_units))
    tw = float(total_weight) if total_weight is not None else float(num_units)
    expected_weight = expected_units * tw / num_units
    if config.delta is not None:
        delta, rule = config.delta, "given"
        check_delta_for_users(delta, num_users, private=config.algorithm.private)
        default = float(num_users) ** -1.1  # default_delta's rule (it refuses N < 2; a given delta does not)
        if config.algorithm.private and delta > default * (1 + 1e-9):
            # above the default N^-1.1 (not 1/(10 N): the default itself is above that for N < 1e10)
            rule = f"given; above N^-1.1 = {default:.3g}, the default: a weaker guarantee"
    else:
        delta, rule = accounting.default_delta(num_users)
    plan = RunPlan(
        config=config,
        unit=unit,
        num_users=int(num_users),
        num_units=int(num_units),
        expected_units=expected_units,
        expected_weight=expected_weight,
        delta=delta,
        delta_rule=rule,
        noise_multiplier=0.0,
        update_noise_multiplier=0.0,
        count_stddev=None,
        mechanism=None,
        safe_steps=None,
        sampler=get_sampler(config.sampling),
        noise_mechanism=NOISE_MECHANISMS.lookup(config.noise),
    )
    if config.noise_multiplier is None or config.noise_multiplier > 0:
        # the accountant must handle this run's kind of step event: refused now, before a
        # calibration or an optimizer step asks it (its shape does not depend on sigma)
        probe = plan.mechanism_for(plan.accounted_sampling).step_event()
        accounting.check_supports(config.accountant, probe, delta)
    if config.noise_multiplier is None:
        return plan.calibrated(config.target_epsilon)
    return plan.with_noise_multiplier(config.noise_multiplier)
