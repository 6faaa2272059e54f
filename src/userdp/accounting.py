"""User-level privacy accounting: one ``dp_accounting`` DpEvent per training step.

The only thing training tells accounting is a DpEvent (see docs/ARCHITECTURE.md §1):

* ELS step (example-level sampling at rate p, at most G records per user): a mixture of
  Gaussians whose sensitivity is Binomial(G, p) in units of the clip norm (SPEC §4.3).
  For G = 1 this is exactly the Poisson-subsampled Gaussian, and we return that event.
* ULS / DP-FedAvg / DP-FedSGD step: the Poisson-subsampled Gaussian at the user rate q.
* Fixed-size cohorts drawn without replacement: ``SampledWithoutReplacementDpEvent``,
  accounted with RDP under **replace-one** adjacency (SPEC §4.5).
* No amplification (shuffled fixed batches): a Gaussian of sensitivity G every step.

Backends: PLD (default, tight, pessimistic discretization) and RDP (fast; the choice for tiny
δ). dp_accounting 0.6 has no RDP for ``MixtureOfGaussiansDpEvent``; we compute it here by
numerical integration of the Rényi divergence of the dominating pair in both directions.

Calibration (:func:`calibrate_noise_multiplier`) returns a noise multiplier that is never
below the true one: every evaluation it relies on is a pessimistic PLD (an upper bound on
ε), and the returned σ is one at which such an evaluation met the target.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
from collections import OrderedDict
from typing import Any, Callable, Sequence

import dp_accounting
import numpy as np
from dp_accounting import dp_event as dpe
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as PLD
from dp_accounting.pld import privacy_loss_mechanism as PLM
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from scipy import stats
from scipy.special import logsumexp

from userdp.errors import UserError

NeighborRel = dp_accounting.NeighboringRelation

__all__ = [
    "ACCOUNTANTS",
    "Mechanism",
    "els_step_event",
    "uls_step_event",
    "fixed_cohort_step_event",
    "no_amplification_step_event",
    "compose",
    "epsilon",
    "delta",
    "calibrate_noise_multiplier",
    "max_steps",
    "default_delta",
    "adjacency",
    "event_to_dict",
    "event_to_json",
    "event_from_dict",
    "epsilon_and_accountant",
    "moments_accountant_epsilon",
    "rdp_orders",
    "step_rdp",
    "clear_caches",
]

ACCOUNTANTS = ("pld", "rdp")
#: dp_accounting's default PLD discretization; what reported guarantees use.
PLD_INTERVAL = 1e-4
#: RDP orders used by the RDP backend (dp_accounting's defaults).
RDP_ORDERS = tuple(float(a) for a in rdp_lib.DEFAULT_RDP_ORDERS)
#: Largest noise multiplier calibration will consider.
SIGMA_MAX = 1e4
#: Where the PLD accountant stays within seconds (measured on a 2-core CPU, dp_accounting 0.6):
#: sigma / (largest sensitivity) in [0.1, 1e6] (0.05 did not finish in 20 s; ELS at 1e7 neither)
#: and at most 1e7 composed steps (1.5 s; 1e8 did not finish in 20 s). Outside, epsilon() answers
#: with RDP (a valid, looser upper bound) and epsilon_and_accountant() says so.
PLD_SIGMA_RANGE = (0.1, 1e6)
PLD_MAX_STEPS = 10**7
#: Largest ELS group size G the mixture accountant takes (its PLD builds G+1 components: 2.8 s
#: at G = 1e4, over 20 s at 1e5).
MAX_ELS_GROUP = 10_000
#: Smallest sampling rate accounted (below it float64 loses the rate; denormals broke dp_accounting).
MIN_SAMPLING_RATE = 1e-12
#: Largest epsilon calibration accepts (e^epsilon overflows past ~709; beyond ~1000 nothing is promised).
MAX_CALIBRATION_EPSILON = 1000.0


# ----------------------------------------------------------------------------------- checks
def _check_positive(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"{name} must be a positive number (got {value})")
    return value


def _check_rate(name: str, value: float) -> float:
    value = float(value)
    if not (0.0 < value <= 1.0):
        raise UserError(f"{name} must be in (0, 1] (got {value})")
    if value < MIN_SAMPLING_RATE:
        raise UserError(f"{name} = {value:g} is below {MIN_SAMPLING_RATE:g}, where float64 accounting is "
                        "not reliable; use a larger sampling rate")
    return value


def _check_int(name: str, value: int, minimum: int = 1) -> int:
    if isinstance(value, bool) or int(value) != value or int(value) < minimum:
        raise UserError(f"{name} must be an integer >= {minimum} (got {value})")
    return int(value)


def _check_delta(value: float) -> float:
    value = float(value)
    if not (0.0 < value < 1.0):
        raise UserError(f"delta must be in (0, 1) (got {value})")
    return value


def _check_accountant(accountant: str) -> str:
    if accountant not in ACCOUNTANTS:
        raise UserError(f"accountant must be one of {', '.join(ACCOUNTANTS)} (got {accountant!r})")
    return accountant


# ----------------------------------------------------------------------------------- events
def binomial_sensitivity(group_size: int, sampling_rate: float) -> tuple[list[float], list[float]]:
    """Support and pmf of K ~ Binomial(G, p): how many of a user's G records a step samples."""
    ks = np.arange(group_size + 1)
    probs = stats.binom.pmf(ks, group_size, sampling_rate)
    return [float(k) for k in ks], [float(x) for x in probs]


def els_step_event(noise_multiplier: float, sampling_rate: float, group_size: int) -> dpe.DpEvent:
    """One ELS step: Gaussian noise σ, sensitivity K ~ Binomial(G, p) (SPEC §4.3).

    G = 1 returns exactly ``PoissonSampledDpEvent(p, GaussianDpEvent(σ))``.
    """
    sigma = _check_positive("noise_multiplier", noise_multiplier)
    p = _check_rate("sampling_rate", sampling_rate)
    g = _check_int("group_size", group_size)
    if g > MAX_ELS_GROUP:
        raise UserError(f"group_size G = {g} is above {MAX_ELS_GROUP:,}, the largest the ELS mixture "
                        "accountant takes (it builds G+1 components); use a smaller G, or ULS")
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
    n = _check_int("num_users", num_users)
    m = _check_int("cohort_size", cohort_size)
    if m > n:
        raise UserError(f"cohort_size ({m}) must not exceed num_users ({n})")
    return dpe.SampledWithoutReplacementDpEvent(n, m, dpe.GaussianDpEvent(sigma))


def no_amplification_step_event(noise_multiplier: float, group_size: int = 1) -> dpe.DpEvent:
    """What holds when sampling gives no amplification (e.g. shuffled fixed batches).

    A user's G records may all land in one batch, so the sensitivity is G·C: the Gaussian
    mechanism with noise multiplier σ/G.
    """
    sigma = _check_positive("noise_multiplier", noise_multiplier)
    g = _check_int("group_size", group_size)
    return dpe.GaussianDpEvent(sigma / g)


def compose(step_event: dpe.DpEvent, steps: int) -> dpe.DpEvent:
    """T-fold self-composition of one step's event."""
    t = _check_int("steps", steps)
    return dpe.SelfComposedDpEvent(step_event, t)


def default_delta(num_users: int) -> tuple[float, str]:
    """δ = N^-1.1 with N the number of users (SPEC §4.7), and a sentence saying so."""
    n = _check_int("num_users", num_users, minimum=2)
    return float(n) ** -1.1, f"delta = N^-1.1 with N = {n} users"


# ----------------------------------------------------------------------------------- event walk
def _contains(event: dpe.DpEvent, cls: type) -> bool:
    if isinstance(event, cls):
        return True
    if isinstance(event, dpe.SelfComposedDpEvent):
        return _contains(event.event, cls)
    if isinstance(event, dpe.ComposedDpEvent):
        return any(_contains(e, cls) for e in event.events)
    if isinstance(event, (dpe.PoissonSampledDpEvent, dpe.SampledWithoutReplacementDpEvent)):
        return _contains(event.event, cls)
    return False


def adjacency(event: dpe.DpEvent) -> str:
    """The neighbouring relation under which the event is accounted.

    ``"replace_one"`` when the event samples without replacement (fixed-size cohorts), else
    ``"add_or_remove_one"`` (add or remove all of one user's data).
    """
    wor = _contains(event, dpe.SampledWithoutReplacementDpEvent)
    poisson = _contains(event, dpe.PoissonSampledDpEvent) or _contains(
        event, dpe.MixtureOfGaussiansDpEvent
    )
    if wor and poisson:
        raise UserError(
            "cannot compose fixed-size cohorts (replace-one) with Poisson-sampled steps "
            "(add-or-remove) in one guarantee"
        )
    return "replace_one" if wor else "add_or_remove_one"


def _relation(event: dpe.DpEvent) -> NeighborRel:
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
    return event


def event_to_json(event: dpe.DpEvent) -> str:
    return json.dumps(event_to_dict(event), sort_keys=True)


# ----------------------------------------------------------------------------------- RDP of MoG
def rdp_orders() -> tuple[float, ...]:
    return RDP_ORDERS


def _mog_log_ratio(x: np.ndarray, sigma: float, sens: np.ndarray, log_w: np.ndarray) -> np.ndarray:
    """L(x) = log P(x)/Q(x) for P = Σ w_k N(s_k, σ²), Q = N(0, σ²)."""
    z = log_w[None, :] + (np.outer(x, sens) - 0.5 * sens[None, :] ** 2) / sigma**2
    return logsumexp(z, axis=1)


def _mixture_log_weights(sensitivities: Sequence[float], probs: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """(sensitivities, log weights) of a mixture, exact in log space for ELS's Binomial(G, p).

    The event stores the pmf as floats, so a weight below ~1e-308 is 0 there, yet at large
    orders exactly those components (K near G) dominate the RDP: dropping them under-reported
    RDP by orders of magnitude (G = 256, p = 5e-4, sigma = 8: 6.5e-4 instead of 127.8 at order
    5). A mixture over 0..G whose weights are a Binomial(G, p) pmf (checked to 1e-9 wherever the
    stored weight is a normal float) gets its log weights from ``binom.logpmf``; any other
    mixture keeps its positive weights.
    """
    sens = np.asarray(sensitivities, dtype=float)
    w = np.asarray(probs, dtype=float)
    g = len(sens) - 1
    if g >= 1 and np.array_equal(sens, np.arange(g + 1)) and w[0] > 0 and w[1] > 0:
        r = w[1] / w[0]  # = G p / (1 - p)
        p = r / (g + r)
        if 0.0 < p < 1.0:
            logw = stats.binom.logpmf(np.arange(g + 1), g, p)
            normal = w > 1e-300
            if np.allclose(np.exp(logw[normal]), w[normal], rtol=1e-9, atol=0.0):
                return sens, logw - logsumexp(logw)
    keep = w > 0
    sens, w = sens[keep], w[keep]
    return sens, np.log(w / w.sum())


def mog_rdp(sigma: float, sensitivities: Sequence[float], probs: Sequence[float],
            orders: Sequence[float] = RDP_ORDERS, *, max_points: int = 2_000_000) -> np.ndarray:
    """RDP of one Mixture-of-Gaussians step: max(D_α(P‖Q), D_α(Q‖P)) per order, by quadrature.

    With L(x) = log P(x)/Q(x): D_α(P‖Q) = log E_Q[e^{αL}]/(α−1) and D_α(Q‖P) =
    log E_Q[e^{(1−α)L}]/(α−1). The integrands are smooth with every peak at least σ wide
    (their log has curvature ≥ −1/σ²), so the trapezoid rule on a grid of spacing σ/4 is
    accurate far beyond float precision; the grid covers [−40σ − s_max, α·s_max + 40σ]
    (the e^{αL} integrand peaks near α·s_max). Orders the grid cannot cover within
    ``max_points`` get RDP = ∞, which only loosens (never breaks) the bound.
    """
    sens, log_w = _mixture_log_weights(sensitivities, probs)
    smax = float(max(sens.max(), 0.0))
    orders = np.asarray(orders, dtype=float)
    h = sigma / 4.0
    lo = -40.0 * sigma - smax
    covered = orders * smax + 40.0 * sigma <= lo + h * max_points
    if not covered.any():  # sigma far below the sensitivities: no order is bounded on the grid
        return np.full(len(orders), np.inf)
    a_max = float(orders[covered].max())
    x = np.arange(lo, a_max * smax + 40.0 * sigma + h, h)
    log_q = -0.5 * (x / sigma) ** 2 - 0.5 * math.log(2 * math.pi) - math.log(sigma) + math.log(h)
    L = np.empty_like(x)
    chunk = max(1, 4_000_000 // len(sens))
    for i in range(0, len(x), chunk):
        L[i:i + chunk] = _mog_log_ratio(x[i:i + chunk], sigma, sens, log_w)
    out = np.full(len(orders), np.inf)
    for i, a in enumerate(orders):
        if not covered[i]:
            continue
        d1 = logsumexp(a * L + log_q) / (a - 1)
        d2 = logsumexp((1 - a) * L + log_q) / (a - 1)
        out[i] = max(d1, d2, 0.0)
    return out


def _rdp_vector(event: dpe.DpEvent, orders: np.ndarray, relation: NeighborRel) -> np.ndarray:
    if isinstance(event, dpe.SelfComposedDpEvent):
        return event.count * _rdp_vector(event.event, orders, relation)
    if isinstance(event, dpe.ComposedDpEvent):
        return sum((_rdp_vector(e, orders, relation) for e in event.events), np.zeros(len(orders)))
    if isinstance(event, dpe.MixtureOfGaussiansDpEvent):
        return _mog_rdp_cached(float(event.standard_deviation), tuple(event.sensitivities),
                               tuple(event.sampling_probs), tuple(orders))
    acc = rdp_lib.RdpAccountant(orders=list(orders), neighboring_relation=relation)
    try:
        with _quiet_rdp_convergence():
            acc.compose(event)
    except dp_accounting.UnsupportedEventError as exc:
        raise UserError(f"the RDP accountant cannot account this event: {exc}") from None
    return np.asarray(acc.rdp, dtype=float)


class _DropRdpConvergence(logging.Filter):
    """Drops dp_accounting's "_compute_log_a_frac failed to converge" warning.

    At small σ dp_accounting's series for fractional orders near 1 does not converge; it then
    sets that order's RDP to ∞ ("Excluding this order"), which is safe (the bound only
    loosens; ε is the minimum over the other orders), and logs one warning per order per
    evaluation — hundreds during a calibration. Nothing else is filtered.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("_compute_log_a_frac failed to converge")


_RDP_FILTER = _DropRdpConvergence()


@contextlib.contextmanager
def _quiet_rdp_convergence():
    logger = logging.getLogger("absl")
    logger.addFilter(_RDP_FILTER)
    try:
        yield
    finally:
        logger.removeFilter(_RDP_FILTER)


_MOG_RDP_CACHE: "OrderedDict[tuple, np.ndarray]" = OrderedDict()


def _mog_rdp_cached(sigma, sens, probs, orders) -> np.ndarray:
    key = (sigma, sens, probs, orders)
    if key not in _MOG_RDP_CACHE:
        _MOG_RDP_CACHE[key] = mog_rdp(sigma, sens, probs, orders)
        while len(_MOG_RDP_CACHE) > 256:
            _MOG_RDP_CACHE.popitem(last=False)
    return _MOG_RDP_CACHE[key]


# ----------------------------------------------------------------------------------- PLD
_PLD_CACHE: "OrderedDict[tuple, Any]" = OrderedDict()
_PLD_CACHE_SIZE = 64


_STEP_PLD_CACHE: "OrderedDict[tuple, Any]" = OrderedDict()


class _VectorizedMixtureGaussianPrivacyLoss(PLM.MixtureGaussianPrivacyLoss):
    """dp_accounting's ``MixtureGaussianPrivacyLoss`` with its inverse privacy loss vectorized.

    dp_accounting inverts the mixture's (monotone) privacy loss by one recursive bisection,
    a Python call per tree node: at small σ (a wide loss range, ~10^5 grid points) that is
    ~97% of the PLD's cost (e.g. 50 s of a 59 s calibration). Here every loss value follows
    the *same* bisection path as in the recursion — the same bounds, the same midpoints
    ``(b0 + b1) / 2``, the same comparison ``loss < privacy_loss(mid)`` and the same stopping
    rule and output ``floor(b1 / precision) · precision`` — but all values advance together
    in numpy, with the privacy loss at a level's distinct midpoints computed once. The PLD
    built from it equals dp_accounting's (tests compare the pmfs), so the pessimism of the
    connect-the-dots construction is unchanged.
    """

    def _privacy_loss_at(self, x: np.ndarray) -> np.ndarray:
        out = np.empty(len(x))
        consts = self._precompute_privacy_loss_constants
        chunk = max(1, 2_000_000 // len(self.sensitivities))
        for i in range(0, len(x), chunk):
            x_loss = np.multiply.outer(x[i:i + chunk], self.sensitivities) / self._variance
            if self.adjacency_type == PLM.AdjacencyType.ADD:
                out[i:i + chunk] = -np.logaddexp.reduce(consts + x_loss, axis=1)
            else:
                out[i:i + chunk] = np.logaddexp.reduce(consts - x_loss, axis=1)
        return out

    def _inverse_privacy_losses_with_range(self, privacy_losses, bounds, precision=1e-6):
        losses = np.asarray(privacy_losses, dtype=float)
        n = len(losses)
        if n == 0:
            return []
        b0 = np.full(n, float(bounds[0]))
        b1 = np.full(n, float(bounds[1]))
        active = np.nonzero(b1 - b0 > precision)[0]
        while len(active):
            mid = (b0[active] + b1[active]) / 2
            uniq, inverse = np.unique(mid, return_inverse=True)
            split = self._privacy_loss_at(uniq)[inverse]
            lower = losses[active] < split
            b0[active[lower]] = mid[lower]
            b1[active[~lower]] = mid[~lower]
            active = active[b1[active] - b0[active] > precision]
        return np.floor(b1 / precision) * precision


def _mixture_gaussian_pld(sigma: float, sensitivities, probs, interval: float):
    """``PLD.from_mixture_gaussian_mechanism`` (pessimistic, connect-the-dots, truncation
    e^-50) with the vectorized inverse privacy loss; dp_accounting's own if its private
    builder is unavailable."""
    create = getattr(PLD, "_create_pld_pmf_from_monotone_privacy_loss", None)
    if create is None:  # pragma: no cover - a dp_accounting without the private builder
        return PLD.from_mixture_gaussian_mechanism(
            standard_deviation=sigma, sensitivities=sensitivities, sampling_probs=probs,
            value_discretization_interval=interval)

    def single(adjacency):
        loss = _VectorizedMixtureGaussianPrivacyLoss(
            sigma, sensitivities, probs, pessimistic_estimate=True, log_mass_truncation_bound=-50,
            adjacency_type=adjacency)
        return create(loss, pessimistic_estimate=True, value_discretization_interval=interval,
                      use_connect_dots=True)

    return PLD.PrivacyLossDistribution(single(PLM.AdjacencyType.REMOVE), single(PLM.AdjacencyType.ADD))


class _ComposedPLD:
    """get_epsilon / get_delta of a PrivacyLossDistribution, like a PLDAccountant's."""

    def __init__(self, pld) -> None:
        self._pld = pld

    def get_epsilon(self, target_delta: float) -> float:
        return self._pld.get_epsilon_for_delta(target_delta)

    def get_delta(self, target_epsilon: float) -> float:
        return self._pld.get_delta_for_epsilon(target_epsilon)


def _self_composed_from_cached_step(event: dpe.DpEvent, interval: float):
    """T steps of one Gaussian-type step from the cached one-step PLD (None: not applicable).

    The one-step PLD of a mixture is the expensive part (≈5x the T-fold FFT composition);
    caching it makes ε for many T (max_steps, a ledger) cheap. Same arithmetic as
    PLDAccountant: the step's PLD, self-composed T times.
    """
    if not isinstance(event, dpe.SelfComposedDpEvent):
        return None
    step = event.event
    if not isinstance(step, (dpe.MixtureOfGaussiansDpEvent, dpe.PoissonSampledDpEvent)):
        return None
    if isinstance(step, dpe.MixtureOfGaussiansDpEvent):
        if step.standard_deviation <= 0 or (len(step.sensitivities) == 1 and step.sensitivities[0] == 0):
            return None
        make = lambda: _mixture_gaussian_pld(  # noqa: E731
            step.standard_deviation, step.sensitivities, step.sampling_probs, interval)
    else:
        if not isinstance(step.event, dpe.GaussianDpEvent):
            return None
        if step.sampling_probability <= 0 or step.event.noise_multiplier <= 0:
            return None
        make = lambda: PLD.from_gaussian_mechanism(  # noqa: E731
            standard_deviation=step.event.noise_multiplier, value_discretization_interval=interval,
            sampling_prob=step.sampling_probability,
            neighboring_relation=NeighborRel.ADD_OR_REMOVE_ONE)
    key = (repr(step), float(interval))
    base = _STEP_PLD_CACHE.get(key)
    if base is None:
        base = make()
        _STEP_PLD_CACHE[key] = base
        while len(_STEP_PLD_CACHE) > _PLD_CACHE_SIZE:
            _STEP_PLD_CACHE.popitem(last=False)
    else:
        _STEP_PLD_CACHE.move_to_end(key)
    # exactly what PLDAccountant does: identity ∘ (step PLD self-composed T times)
    composed = PLD.identity(value_discretization_interval=interval).compose(base.self_compose(event.count))
    return _ComposedPLD(composed)


def clear_caches() -> None:
    """Forget every cached PLD and RDP (for cold-cache timing, or to free memory)."""
    _PLD_CACHE.clear()
    _STEP_PLD_CACHE.clear()
    _MOG_RDP_CACHE.clear()


def _pld(event: dpe.DpEvent, interval: float):
    """A composed PLD accountant for the event (LRU-cached by the event's parameters)."""
    key = (repr(event), float(interval))
    acc = _PLD_CACHE.get(key)
    if acc is not None:
        _PLD_CACHE.move_to_end(key)
        return acc
    if _contains(event, dpe.SampledWithoutReplacementDpEvent):
        raise UserError(
            "fixed-size cohorts (sampling without replacement) are accounted with RDP under "
            "replace-one adjacency: use accountant='rdp'"
        )
    acc = _self_composed_from_cached_step(event, interval)
    if acc is None:
        acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval)
        try:
            acc.compose(event)
        except dp_accounting.UnsupportedEventError as exc:
            raise UserError(f"the PLD accountant cannot account this event: {exc}") from None
    _PLD_CACHE[key] = acc
    while len(_PLD_CACHE) > _PLD_CACHE_SIZE:
        _PLD_CACHE.popitem(last=False)
    return acc


def step_rdp(step_event: dpe.DpEvent, orders: Sequence[float] | None = None) -> np.ndarray:
    """Rényi DP of one event at each order: ``rdp[i]`` is ε_RDP at ``orders[i]``.

    ``orders`` defaults to :func:`rdp_orders` (dp_accounting's defaults). RDP composes
    additively, so T steps have ``T * step_rdp(step)``, and
    ``dp_accounting.rdp.compute_epsilon(orders, T * step_rdp(step), δ)`` is what
    ``epsilon(compose(step, T), δ, "rdp")`` returns. Poisson-sampled Gaussians (ULS, ELS with
    G = 1), fixed cohorts (replace-one) and plain Gaussians use dp_accounting's
    ``RdpAccountant``; ELS mixtures use :func:`mog_rdp`. Orders where dp_accounting's series
    does not converge (tiny σ) are ∞, which only loosens the bound. Unsupported events raise
    ``UserError``.
    """
    orders_arr = np.asarray(orders if orders is not None else RDP_ORDERS, dtype=float)
    return _rdp_vector(step_event, orders_arr, _relation(step_event))


def _rdp(event: dpe.DpEvent, orders: Sequence[float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(orders, RDP) of the event; kept for callers of the old private name (use step_rdp)."""
    orders_arr = np.asarray(orders if orders is not None else RDP_ORDERS, dtype=float)
    return orders_arr, step_rdp(event, orders_arr)


def _pld_infeasible(event: dpe.DpEvent, count: int = 1) -> str | None:
    """Why the PLD accountant cannot answer this event within seconds (None: it can)."""
    if isinstance(event, dpe.SelfComposedDpEvent):
        return _pld_infeasible(event.event, count * int(event.count))
    if isinstance(event, dpe.ComposedDpEvent):
        for e in event.events:
            why = _pld_infeasible(e, count)
            if why:
                return why
        return None
    if count > PLD_MAX_STEPS:
        return f"{count:.3g} composed steps (PLD handles up to {PLD_MAX_STEPS:.0e})"
    if isinstance(event, (dpe.PoissonSampledDpEvent, dpe.SampledWithoutReplacementDpEvent)):
        return _pld_infeasible(event.event, count)
    ratio = None
    if isinstance(event, dpe.GaussianDpEvent):
        ratio = float(event.noise_multiplier)
    elif isinstance(event, dpe.MixtureOfGaussiansDpEvent):
        ratio = float(event.standard_deviation) / max(max(event.sensitivities), 1e-300)
    if ratio is not None and not (PLD_SIGMA_RANGE[0] <= ratio <= PLD_SIGMA_RANGE[1]):
        return (f"noise multiplier / sensitivity = {ratio:.3g} (PLD handles {PLD_SIGMA_RANGE[0]:g} to "
                f"{PLD_SIGMA_RANGE[1]:.0e})")
    return None


def epsilon_and_accountant(event: dpe.DpEvent, delta: float, accountant: str = "pld", *,
                           value_discretization_interval: float = PLD_INTERVAL,
                           orders: Sequence[float] | None = None) -> tuple[float, str]:
    """ε of the event at δ — an upper bound — and which accountant gave it.

    With ``accountant="pld"``, events outside the PLD's feasible range (see
    :data:`PLD_SIGMA_RANGE`, :data:`PLD_MAX_STEPS`) and deltas it cannot resolve (it returns ∞)
    are answered by RDP instead, also a valid upper bound, looser. The second value is ``"pld"``,
    ``"rdp"``, or ``"rdp (…)"`` with the reason the PLD did not answer. ε may be ``inf`` (no
    order of RDP bounds the event).

    Raises:
        UserError: bad delta or accountant name, or an event the accountant cannot take.
    """
    _check_delta(delta)
    _check_accountant(accountant)
    used = "rdp"
    if accountant == "pld":
        why = _pld_infeasible(event)
        if why is None:
            eps = float(_pld(event, value_discretization_interval).get_epsilon(delta))
            if math.isfinite(eps):
                return eps, "pld"
            why = "it cannot resolve this delta (its tails are truncated)"
        used = f"rdp (PLD infeasible: {why})"
    o, r = _rdp(event, orders)
    return float(rdp_lib.compute_epsilon(o, r, delta)[0]), used


def epsilon(event: dpe.DpEvent, delta: float, accountant: str = "pld", *,
            value_discretization_interval: float = PLD_INTERVAL,
            orders: Sequence[float] | None = None) -> float:
    """ε of the event at δ: an upper bound (see :func:`epsilon_and_accountant`, which also says
    whether the PLD or RDP answered).

    Raises:
        UserError: bad delta or accountant name, or an event the accountant cannot take.
    """
    return epsilon_and_accountant(event, delta, accountant, value_discretization_interval=value_discretization_interval,
                                  orders=orders)[0]


def delta(event: dpe.DpEvent, epsilon: float, accountant: str = "pld", *,
          value_discretization_interval: float = PLD_INTERVAL,
          orders: Sequence[float] | None = None) -> float:
    """δ of the event at ε."""
    eps = float(epsilon)
    if not (eps > 0 and math.isfinite(eps)):
        raise UserError(f"epsilon must be a positive number (got {epsilon})")
    _check_accountant(accountant)
    if accountant == "pld" and _pld_infeasible(event) is None:
        return float(_pld(event, value_discretization_interval).get_delta(eps))
    o, r = _rdp(event, orders)
    return float(rdp_lib.compute_delta(o, r, eps)[0])


def moments_accountant_epsilon(sampling_rate: float, noise_multiplier: float, steps: int,
                               delta: float) -> float:
    """The legacy moments accountant of [S2] (SPEC §4.6): integer orders 2..33 and the
    classical conversion ε = min_α T·RDP(α) + ln(1/δ)/(α−1). For reproduction only."""
    orders = np.arange(2, 34, dtype=float)
    acc = rdp_lib.RdpAccountant(orders=list(orders))
    with _quiet_rdp_convergence():
        acc.compose(compose(uls_step_event(noise_multiplier, sampling_rate), steps))
    return float(np.min(acc.rdp + math.log(1 / _check_delta(delta)) / (orders - 1)))


# ----------------------------------------------------------------------------------- max_steps
def max_steps(step_event: dpe.DpEvent, epsilon: float, delta: float, accountant: str = "pld",
              *, limit: int = 10**7) -> int:
    """Largest T with ε(T steps) ≤ epsilon (0 if even one step exceeds; ``limit`` if reached)."""
    eps_target = float(epsilon)
    if not (eps_target > 0):
        raise UserError(f"epsilon must be a positive number (got {epsilon})")
    _check_delta(delta)

    def ok(t: int) -> bool:
        return globals()["epsilon"](compose(step_event, t), delta, accountant) <= eps_target

    if not ok(1):
        return 0
    lo, hi = 1, 2
    while ok(hi):
        lo = hi
        if hi >= limit:
            return limit
        hi = min(hi * 2, limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


# ----------------------------------------------------------------------------------- calibration
def _gdp_delta(eps: float, mu: float) -> float:
    """δ(ε) of μ-GDP (Dong, Roth, Su): Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2)."""
    return float(stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2))


def _step_mixture(ev: dpe.DpEvent) -> tuple[np.ndarray, np.ndarray, float] | None:
    """(sensitivities, probabilities, σ) of a Poisson-Gaussian / MoG / WOR-Gaussian step."""
    if isinstance(ev, dpe.MixtureOfGaussiansDpEvent):
        return (np.asarray(ev.sensitivities, float), np.asarray(ev.sampling_probs, float),
                float(ev.standard_deviation))
    if isinstance(ev, dpe.PoissonSampledDpEvent) and isinstance(ev.event, dpe.GaussianDpEvent):
        q = float(ev.sampling_probability)
        return np.array([0.0, 1.0]), np.array([1 - q, q]), float(ev.event.noise_multiplier)
    if isinstance(ev, dpe.SampledWithoutReplacementDpEvent) and isinstance(ev.event, dpe.GaussianDpEvent):
        q = ev.sample_size / ev.source_dataset_size  # replace-one: sensitivity 2
        return np.array([0.0, 2.0]), np.array([1 - q, q]), float(ev.event.noise_multiplier)
    if isinstance(ev, dpe.GaussianDpEvent):
        return np.array([1.0]), np.array([1.0]), float(ev.noise_multiplier)
    return None


def _initial_guess(make_step_event: Callable[[float], dpe.DpEvent], steps: int, eps: float,
                   dlt: float) -> float | None:
    """A cheap estimate of the answer from the central limit theorem of composition.

    T steps of a mixture P = Σ w_k N(s_k, σ²) against Q = N(0, σ²) are close to μ-GDP with
    μ² = T·χ²(P‖Q), χ² = Σ_{k,k'} w_k w_k' e^{s_k s_k'/σ²} − 1. Only used to place the
    search (microseconds); never trusted for the answer.
    """
    try:
        mix = _step_mixture(make_step_event(1.0))
    except UserError:
        return None
    if mix is None:
        return None
    sens, w, sigma1 = mix
    keep = w > 0
    sens, log_w = sens[keep], np.log(w[keep])
    outer = np.add.outer(log_w, log_w)
    prod = np.outer(sens, sens)

    def chi2(s: float) -> float:
        return float(np.expm1(logsumexp(outer + prod / s**2)))

    lo, hi = 1e-3, 1e3  # μ bracket
    if _gdp_delta(eps, hi) < dlt:
        return None
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if _gdp_delta(eps, mid) > dlt:
            hi = mid
        else:
            lo = mid
    target_chi2 = lo**2 / steps
    lo_s, hi_s = 1e-2, SIGMA_MAX
    if chi2(hi_s) > target_chi2:
        return None
    for _ in range(60):
        mid = math.sqrt(lo_s * hi_s)
        if chi2(mid) > target_chi2:
            lo_s = mid
        else:
            hi_s = mid
    return hi_s / sigma1  # the factory maps z to an event std of z * sigma1


def calibrate_noise_multiplier(make_step_event: Callable[[float], dpe.DpEvent], steps: int,
                               epsilon: float, delta: float, accountant: str = "pld", *,
                               rtol: float = 0.004, sigma_max: float = SIGMA_MAX,
                               value_discretization_interval: float = 1e-3,
                               orders: Sequence[float] | None = None) -> float:
    """Smallest noise multiplier whose T-step composition is (ε, δ)-DP, never below the truth.

    Returns σ such that an upper bound on ε(σ) meets the target (PLD with pessimistic
    discretization at ``value_discretization_interval``, default 1e-3, or RDP): so σ ≥ the
    true σ. It stops when some σ' < σ with σ/σ' ≤ 1 + ``rtol`` fails the same evaluation.
    With 1e-3 discretization the answer is within about 0.3% of what a 1e-4 PLD gives (the
    pessimism of the coarser grid); see benchmarks/bench_accounting.py.

    Speed: PLD evaluations at small σ are the slow ones, so the search never steps far below
    a σ it has seen: it starts from a central-limit (μ-GDP) estimate and runs a safeguarded
    secant on log ε against log σ, aiming just either side of the root.
    """
    eps = float(epsilon)
    if not (eps > 0 and math.isfinite(eps)):
        raise UserError(f"epsilon must be a positive number (got {epsilon})")
    if eps > MAX_CALIBRATION_EPSILON:
        raise UserError(f"epsilon = {eps:g} promises nothing (e^epsilon overflows); calibrate for an "
                        f"epsilon of at most {MAX_CALIBRATION_EPSILON:g}")
    dlt = _check_delta(delta)
    t = _check_int("steps", steps)
    _check_accountant(accountant)
    try:
        return _calibrate(make_step_event, t, eps, dlt, accountant, rtol=rtol, sigma_max=sigma_max,
                          value_discretization_interval=value_discretization_interval, orders=orders)
    except RuntimeError:
        raise UserError(f"no noise multiplier up to {sigma_max:g} meets epsilon = {eps:g} at delta = {dlt:g} "
                        f"over {t} steps; raise epsilon or delta, or take fewer steps") from None


def _calibrate(make_step_event, t, eps, dlt, accountant, *, rtol, sigma_max, value_discretization_interval,
               orders):
    log_target = math.log(eps)

    def eps_at(s: float, interval: float) -> float:
        ev = compose(make_step_event(s), t)
        if accountant == "rdp":
            return globals()["epsilon"](ev, dlt, "rdp", orders=orders)
        return globals()["epsilon"](ev, dlt, "pld", value_discretization_interval=interval)

    def f_of(e: float) -> float:
        if e <= 0:
            return -50.0
        if not math.isfinite(e):
            return 50.0
        return math.log(e) - log_target

    guess = _initial_guess(make_step_event, t, eps, dlt)
    s0 = min(max(guess if guess else 1.0, 1e-3), sigma_max)
    # Pessimism of a Δ grid after T steps, measured here: ε(Δ) − ε ≈ 0.7·T·Δ² near ε ≈ 3
    # (0.0065 at T = 1e4, Δ = 1e-3; 0.07 at T = 1e5). Start on a grid that keeps it ≲ 0.3%;
    # the 3Δ check below catches mechanisms where the constant is larger.
    interval = value_discretization_interval
    if accountant == "pld":
        predicted = math.sqrt(0.003 * eps / (0.7 * t))
        interval = min(interval, max(PLD_INTERVAL, PLD_INTERVAL * math.floor(predicted / PLD_INTERVAL)))
    hi, lo, slope = _secant_search(lambda s: f_of(eps_at(s, interval)), s0, [], rtol, sigma_max,
                                   eps, dlt, t)
    if accountant == "rdp" or interval <= PLD_INTERVAL:
        return hi
    # The discretization's pessimism grows with T (about as Δ²): estimate it at the answer
    # from a 3Δ evaluation, and if σ could be too far above the 1e-4 answer, search again on
    # a finer grid (down to 1e-4) from the current bracket.
    e1 = eps_at(hi, interval)
    e3 = eps_at(hi, 3 * interval)  # a 3Δ grid costs a third of a Δ one
    excess = max(e3 - e1, 0.0) / 8.0  # ε(Δ) - ε(0) ≈ (ε(3Δ) - ε(Δ)) / 8 when error ∝ Δ²
    sigma_excess = excess / max(e1, 1e-12) / max(abs(slope), 0.05)
    if sigma_excess + rtol <= 0.008:
        return hi
    fine = max(PLD_INTERVAL, interval * math.sqrt(0.001 / sigma_excess))
    fine = PLD_INTERVAL * math.ceil(fine / PLD_INTERVAL - 1e-9)
    pts = [(hi, f_of(eps_at(hi, fine)))]
    start = hi * math.exp(-min(sigma_excess, 0.2))
    hi2, _, _ = _secant_search(lambda s: f_of(eps_at(s, fine)), start, pts, rtol, sigma_max, eps, dlt, t)
    return hi2


def _secant_search(f: Callable[[float], float], s: float, pts: list, rtol: float, sigma_max: float,
                   eps: float, dlt: float, t: int) -> tuple[float, float | None, float]:
    """Safeguarded secant on (log σ, f = log ε − log ε_target) for a decreasing ε(σ).

    Returns (hi, lo, slope): hi passes (f ≤ 0), lo fails or None, hi ≤ lo·(1 + rtol). Never
    steps more than ×1.5 below a passing σ (small σ are the expensive evaluations).
    """
    pts = list(pts)
    evaluate = True
    for _ in range(60):
        if evaluate:
            pts.append((s, f(s)))
        evaluate = True
        passes = [p for p in pts if p[1] <= 0]
        fails = [p for p in pts if p[1] > 0]
        hi = min(p[0] for p in passes) if passes else None
        lo = max(p[0] for p in fails) if fails else None
        near = sorted(pts, key=lambda p: abs(p[1]))[:2]
        slope = -1.0
        if len(near) == 2 and near[0][0] != near[1][0] and abs(near[0][1]) < 50 and abs(near[1][1]) < 50:
            sl = (near[0][1] - near[1][1]) / (math.log(near[0][0]) - math.log(near[1][0]))
            if -20.0 < sl < -0.05:
                slope = sl
        if hi is not None and lo is not None and hi <= lo * (1 + rtol):
            return float(hi), float(lo), slope
        if hi is None and lo >= sigma_max:
            raise UserError(
                f"epsilon={eps:g} at delta={dlt:g} is not reachable with any noise multiplier "
                f"up to {sigma_max:g} in {t} steps")
        r = math.exp(math.log(near[0][0]) - max(min(near[0][1], 5.0), -5.0) / slope)
        step = rtol / 3
        if hi is None:  # no passing σ yet: aim just above the root, but grow at most 3x
            s = min(max(r * (1 + step), lo * (1 + step)), lo * 3, sigma_max)
        elif lo is None:  # no failing σ yet: aim just below, never far below a σ seen
            s = max(min(r * (1 - step), hi / (1 + step)), hi / 1.5)
            if s < 1e-3:
                return float(hi), None, slope
        else:
            r = min(max(r, lo), hi)
            s = r * (1 + step) if hi / r > r / lo else r * (1 - step)
            if not (lo * (1 + 1e-9) < s < hi * (1 - 1e-9)) or hi / s < 1 + rtol / 10 or s / lo < 1 + rtol / 10:
                s = math.sqrt(lo * hi)
    raise RuntimeError("calibration did not converge")  # pragma: no cover


# ----------------------------------------------------------------------------------- mechanism
@dataclasses.dataclass(frozen=True)
class Mechanism:
    """A training run's mechanism, as the privacy report records it.

    kind: ``els`` | ``uls`` | ``fixed_cohort`` | ``no_amplification``.
    ``sampling_rate`` is p (ELS, records) or q (ULS, users); fixed cohorts give
    ``num_users`` and ``cohort_size`` instead.
    """

    kind: str
    noise_multiplier: float
    steps: int
    sampling_rate: float | None = None
    group_size: int = 1
    num_users: int | None = None
    cohort_size: int | None = None

    KINDS = ("els", "uls", "fixed_cohort", "no_amplification")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise UserError(f"mechanism kind must be one of {', '.join(self.KINDS)} (got {self.kind!r})")
        self.step_event()  # validates the parameters
        _check_int("steps", self.steps)

    def step_event(self, noise_multiplier: float | None = None) -> dpe.DpEvent:
        z = self.noise_multiplier if noise_multiplier is None else noise_multiplier
        if self.kind == "els":
            return els_step_event(z, self._rate(), self.group_size)
        if self.kind == "uls":
            return uls_step_event(z, self._rate())
        if self.kind == "fixed_cohort":
            if self.num_users is None or self.cohort_size is None:
                raise UserError("a fixed_cohort mechanism needs num_users and cohort_size")
            return fixed_cohort_step_event(z, self.num_users, self.cohort_size)
        return no_amplification_step_event(z, self.group_size)

    def _rate(self) -> float:
        if self.sampling_rate is None:
            raise UserError(f"a {self.kind} mechanism needs sampling_rate")
        return self.sampling_rate

    def event(self) -> dpe.DpEvent:
        return compose(self.step_event(), self.steps)

    @property
    def adjacency(self) -> str:
        return adjacency(self.step_event())

    def epsilon(self, delta: float, accountant: str = "pld") -> float:
        return epsilon(self.event(), delta, accountant)

    def delta(self, epsilon_: float, accountant: str = "pld") -> float:
        return delta(self.event(), epsilon_, accountant)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["adjacency"] = self.adjacency
        d["step_event"] = event_to_dict(self.step_event())
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Mechanism":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
