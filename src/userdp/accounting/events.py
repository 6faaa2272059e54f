"""DpEvents of one training step, their composition and their JSON form.

The only thing training tells accounting is a ``dp_accounting`` DpEvent (docs/ARCHITECTURE.md):

* ELS step (records Poisson-sampled at rate p, at most G records per user): a mixture of
  Gaussians whose sensitivity is K ~ Binomial(G, p) in units of the clip norm (docs/accounting.md,
  "ELS"). For G = 1 this is exactly the Poisson-subsampled Gaussian, and that event is returned.
* ULS / DP-FedAvg / DP-FedSGD step: the Poisson-subsampled Gaussian at the user rate q.
* Fixed-size cohorts drawn without replacement: ``SampledWithoutReplacementDpEvent``,
  accounted with RDP under **replace-one** adjacency.
* No amplification (shuffled fixed batches): a Gaussian of sensitivity G every step.

Which of these a run takes is decided in one place, :class:`userdp.accounting.Mechanism`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting import dp_event as dpe
from scipy import stats

from userdp.errors import UserError
from userdp.validation import check_fraction, check_int, check_nonnegative, check_number, check_positive, check_rate

NeighborRel = dp_accounting.NeighboringRelation  # (the enum, also its type below)

#: at G = 1e4, over 20 s at 1e5).
MAX_ELS_GROUP = 10_000
#: Largest target epsilon anything accepts: calibration, the step search and a run's budget
#: (e^epsilon overflows past ~709; beyond ~1000 nothing is promised, and the PLD of a search there
#: can need minutes or a 100 GB grid).
MAX_TARGET_EPSILON = 1000.0
MAX_CALIBRATION_EPSILON = MAX_TARGET_EPSILON  # the name it had in 0.4


def check_target_epsilon(value: float, name: str = "epsilon") -> float:
    """A target epsilon: a number in (0, MAX_TARGET_EPSILON] (one rule for every search and budget)."""
    eps = check_positive(value, name)
    if eps > MAX_TARGET_EPSILON:
        raise UserError(
            f"{name} = {eps:g} promises nothing (e^epsilon overflows past ~709): use an epsilon of at "
            f"most {MAX_TARGET_EPSILON:g}"
        )
    return eps


# ----------------------------------------------------------------------------------- checks
def _check_positive(name: str, value: float) -> float:
    return check_positive(value, name)


def _check_rate(name: str, value: float) -> float:
    return check_rate(value, name)


def check_delta(value: float) -> float:
    return check_fraction(value, "delta")


# ----------------------------------------------------------------------------------- events
def binomial_sensitivity(group_size: int, sampling_rate: float) -> tuple[list[float], list[float]]:
    """Support and pmf of K ~ Binomial(G, p): how many of a user's G records a step samples."""
    ks = np.arange(group_size + 1)
    probs = stats.binom.pmf(ks, group_size, sampling_rate)
    return [float(k) for k in ks], [float(x) for x in probs]


def els_step_event(noise_multiplier: float, sampling_rate: float, group_size: int) -> dpe.DpEvent:
    """One ELS step: Gaussian noise σ, sensitivity K ~ Binomial(G, p) (Charles et al. 2024, Thm. 1).

    G = 1 returns exactly ``PoissonSampledDpEvent(p, GaussianDpEvent(σ))``.
    """
    sigma = _check_positive("noise_multiplier", noise_multiplier)
    p = _check_rate("sampling_rate", sampling_rate)
    g = check_int(group_size, "group_size")
    if g > MAX_ELS_GROUP:
        raise UserError(
            f"group_size G = {g} is above {MAX_ELS_GROUP:,}, the largest the ELS mixture "
            "accountant takes (it builds G+1 components); use a smaller G, or ULS"
        )
    if g == 1:
        return dpe.PoissonSampledDpEvent(p, dpe.GaussianDpEvent(sigma))
    sens, probs = binomial_sensitivity(g, p)
    return dpe.MixtureOfGaussiansDpEvent(sigma, sens, probs)


def uls_step_event(noise_multiplier: float, sampling_rate: float) -> dpe.DpEvent:
    """One ULS / DP-FedAvg / DP-FedSGD step: users Poisson-sampled at rate q, Gaussian noise σ."""
    sigma = _check_positive("noise_multiplier", noise_multiplier)
    q = _check_rate("sampling_rate", sampling_rate)
    return dpe.PoissonSampledDpEvent(q, dpe.GaussianDpEvent(sigma))


def fixed_cohort_step_event(noise_multiplier: float, num_users: int, cohort_size: int) -> dpe.DpEvent:
    """A fixed-size cohort of m users drawn without replacement from N (replace-one, RDP only)."""
    sigma = _check_positive("noise_multiplier", noise_multiplier)
    n = check_int(num_users, "num_users")
    m = check_int(cohort_size, "cohort_size")
    if m > n:
        raise UserError(f"cohort_size ({m}) must not exceed num_users ({n})")
    return dpe.SampledWithoutReplacementDpEvent(n, m, dpe.GaussianDpEvent(sigma))


def no_amplification_step_event(noise_multiplier: float, group_size: int = 1) -> dpe.DpEvent:
    """What holds when sampling gives no amplification (e.g. shuffled fixed batches).

    A user's G records may all land in one batch, so the sensitivity is G·C: the Gaussian
    mechanism with noise multiplier σ/G.
    """
    sigma = _check_positive("noise_multiplier", noise_multiplier)
    g = check_int(group_size, "group_size")
    return dpe.GaussianDpEvent(sigma / g)


def check_event(event: Any, name: str = "event") -> dpe.DpEvent:
    """``event`` if it is a dp_accounting ``DpEvent``.

    Raises:
        UserError: naming ``name`` and what was given instead."""
    if not isinstance(event, dpe.DpEvent):
        raise UserError(
            f"{name} must be a dp_accounting DpEvent (e.g. userdp.accounting.uls_step_event(...)), "
            f"got {type(event).__name__}"
        )
    return event


def compose(step_event: dpe.DpEvent, steps: int) -> dpe.DpEvent:
    """T-fold self-composition of one step's event.

    Raises:
        UserError: ``step_event`` is not a DpEvent, or ``steps`` is not an integer >= 0."""
    t = check_int(steps, "steps")
    return dpe.SelfComposedDpEvent(check_event(step_event, "step_event"), t)


def compose_after(prior: Sequence[dpe.DpEvent], step_event: dpe.DpEvent, steps: int) -> dpe.DpEvent:
    """The ``prior`` events followed by ``steps`` steps, composed by ``dp_accounting.DpEventBuilder``
    (exactly ``compose(step_event, steps)`` without prior events; the prior alone for 0 steps)."""
    if not prior:
        return compose(step_event, steps)
    builder = dp_accounting.DpEventBuilder()
    for event in prior:
        builder.compose(event)
    if steps:
        builder.compose(step_event, check_int(steps, "steps"))
    return builder.build()


def pure_dp_event(epsilon: float) -> dpe.DpEvent:
    """The DpEvent of an epsilon-DP release under add-or-remove-one-user adjacency (a DP median).

    dp_accounting has no pure (epsilon, 0) event. Binary randomized response at epsilon (noise
    parameter p = 2 / (e^epsilon + 1)) is the dominating pair of every epsilon-DP mechanism
    (Kairouz, Oh & Viswanath 2015), so it stands for one without under-counting. dp_accounting
    accounts that event only under replace-one; userdp's accountants account it as this stand-in
    (:func:`pure_dp_epsilon`) under either adjacency."""
    eps = check_positive(epsilon, "epsilon")
    return dp_accounting.RandomizedResponseDpEvent(2.0 / (math.exp(eps) + 1.0), 2)


def pure_dp_epsilon(event: dpe.DpEvent, relation: dp_accounting.NeighboringRelation | None = None) -> float | None:
    """The epsilon of a :func:`pure_dp_event` under ``relation`` (None: not such an event).

    Under add-or-remove it is the event's epsilon; under replace-one (fixed-size cohorts), where
    replacing a user is removing one and adding another, twice that (group privacy of 2)."""
    if not (
        isinstance(event, dpe.RandomizedResponseDpEvent)
        and event.num_buckets == 2
        and 0 < float(event.noise_parameter) < 1
    ):
        return None
    eps = math.log(2.0 / float(event.noise_parameter) - 1.0)
    return 2.0 * eps if relation == NeighborRel.REPLACE_ONE else eps


def split_pure_dp(event: dpe.DpEvent) -> tuple[dpe.DpEvent | None, list[float]]:
    """``event`` less its :func:`pure_dp_event` parts (e.g. a DP median composed before the steps;
    None when nothing else is left), and their epsilons under add-or-remove."""
    eps = pure_dp_epsilon(event)
    if eps is not None:
        return None, [eps]
    if isinstance(event, dpe.SelfComposedDpEvent):
        eps = pure_dp_epsilon(event.event)
        return (None, [eps] * int(event.count)) if eps is not None else (event, [])
    if isinstance(event, dpe.ComposedDpEvent):
        rest, pure = [], []
        for e in event.events:
            r, p = split_pure_dp(e)
            pure += p
            if r is not None:
                rest.append(r)
        if not pure:
            return event, []
        return (rest[0] if len(rest) == 1 else dpe.ComposedDpEvent(rest)) if rest else None, pure
    return event, []


def has_pure_dp(event: dpe.DpEvent | None) -> bool:
    """Whether ``event`` composes a :func:`pure_dp_event` (e.g. a plan's DP median, spent through
    the ledger before the steps)."""
    return event is not None and bool(split_pure_dp(event)[1])


def default_delta(num_users: int) -> tuple[float, str]:
    """δ = N^-1.1 with N the number of users (docs/accounting.md), and a sentence saying so."""
    n = check_int(num_users, "num_users", 2)
    return float(n) ** -1.1, f"delta = N^-1.1 with N = {n} users"


# ----------------------------------------------------------------------------------- event walk
def contains_event(event: dpe.DpEvent, cls: type) -> bool:
    if isinstance(event, cls):
        return True
    if isinstance(event, dpe.SelfComposedDpEvent):
        return contains_event(event.event, cls)
    if isinstance(event, dpe.ComposedDpEvent):
        return any(contains_event(e, cls) for e in event.events)
    if isinstance(event, (dpe.PoissonSampledDpEvent, dpe.SampledWithoutReplacementDpEvent)):
        return contains_event(event.event, cls)
    return False


def adjacency(event: dpe.DpEvent) -> str:
    """The neighbouring relation under which the event is accounted.

    ``"replace_one"`` when the event samples without replacement (fixed-size cohorts), else
    ``"add_or_remove_one"`` (add or remove all of one user's data).
    """
    wor = contains_event(event, dpe.SampledWithoutReplacementDpEvent)
    poisson = contains_event(event, dpe.PoissonSampledDpEvent) or contains_event(event, dpe.MixtureOfGaussiansDpEvent)
    if wor and poisson:
        raise UserError(
            "cannot compose fixed-size cohorts (replace-one) with Poisson-sampled steps "
            "(add-or-remove) in one guarantee"
        )
    return "replace_one" if wor else "add_or_remove_one"


def neighbor_relation(event: dpe.DpEvent) -> dp_accounting.NeighboringRelation:
    return NeighborRel.REPLACE_ONE if adjacency(event) == "replace_one" else NeighborRel.ADD_OR_REMOVE_ONE


def event_to_dict(event: dpe.DpEvent) -> dict[str, Any]:
    """JSON-ready form of a DpEvent, via dp_accounting's ``to_named_tuple`` serialization."""

    def convert(value: Any) -> Any:
        if hasattr(value, "_asdict"):
            return {k: convert(v) for k, v in value._asdict().items() if k != "module_name"}
        if isinstance(value, (list, tuple)):
            return [convert(v) for v in value]
        if isinstance(value, (np.floating, np.integer)):
            return value.item()
        return value

    return convert(event.to_named_tuple())


def event_from_dict(obj: Any) -> dpe.DpEvent:
    """Inverse of :func:`event_to_dict`: rebuild a DpEvent from its JSON form.

    Only classes of ``dp_accounting.dp_event`` are built (a saved file cannot name other code).

    Raises:
        UserError: the object is not a DpEvent's JSON form.
    """

    def build(value: Any) -> Any:
        if isinstance(value, dict) and "class_name" in value:
            name = value["class_name"]
            cls = getattr(dpe, str(name), None)
            if not (isinstance(cls, type) and issubclass(cls, dpe.DpEvent)):
                raise UserError(f"not a dp_accounting event class: {name!r}")
            kwargs = {k: build(v) for k, v in value.items() if k not in ("class_name", "module_name")}
            try:
                return cls(**kwargs)
            except (TypeError, ValueError) as exc:
                raise UserError(f"malformed {name}: {exc}") from None
        if isinstance(value, list):
            return [build(v) for v in value]
        return value

    event = build(obj)
    if not isinstance(event, dpe.DpEvent):
        raise UserError("not the JSON form of a DpEvent (no class_name)")
    _check_event_values(event)
    return event


#: the numeric fields of dp_accounting's events and the range each must lie in
_EVENT_FIELDS = {
    "noise_multiplier": "nonnegative",
    "standard_deviation": "nonnegative",
    "sampling_probability": "probability",
    "count": "count",
    "sample_size": "count",
    "source_dataset_size": "count",
    "num_steps": "count",
    "sensitivity": "nonnegative",
    "epsilon": "nonnegative",
    "delta": "probability",
}


def _check_event_values(event: dpe.DpEvent, where: str = "event") -> None:
    """A saved event's numbers in their ranges (a negative σ or a nan rate read from a file would
    otherwise fail inside dp_accounting, or answer a wrong epsilon).

    Raises:
        UserError: naming the event class and field."""
    name = type(event).__name__
    for field, kind in _EVENT_FIELDS.items():
        if not hasattr(event, field):
            continue
        value = getattr(event, field)
        label = f"{where}: {name}.{field}"
        if kind == "count":
            check_int(value, label, 0)
        elif kind == "probability":
            x = check_number(value, label)
            if not 0.0 <= x <= 1.0:
                raise UserError(f"{label} must be in [0, 1] (got {value})")
        else:
            check_nonnegative(value, label)
    for field in ("sensitivities", "probabilities"):
        for i, v in enumerate(getattr(event, field, None) or ()):
            check_nonnegative(v, f"{where}: {name}.{field}[{i}]")
    for field in ("event", "events"):
        inner = getattr(event, field, None)
        for i, e in enumerate(inner if isinstance(inner, (list, tuple)) else [inner] if inner is not None else []):
            if isinstance(e, dpe.DpEvent):
                _check_event_values(e, f"{where}.{field}" + (f"[{i}]" if isinstance(inner, (list, tuple)) else ""))


def event_to_json(event: dpe.DpEvent) -> str:
    return json.dumps(event_to_dict(event), sort_keys=True)
