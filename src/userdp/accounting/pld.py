"""The privacy-loss-distribution (PLD) backend: dp_accounting's PLDAccountant, with the one-step
PLD cached (so epsilon for many step counts is cheap) and a vectorized inverse privacy loss for the
ELS mixture of Gaussians and the Poisson-subsampled Gaussian (the PLDs built equal dp_accounting's)."""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting import dp_event as dpe
from dp_accounting.pld import common as pld_common
from dp_accounting.pld import pld_pmf, pld_privacy_accountant
from dp_accounting.pld import privacy_loss_distribution as PLD
from dp_accounting.pld import privacy_loss_mechanism as PLM
from scipy import fft

from userdp.accounting.events import NeighborRel, contains_event, split_pure_dp
from userdp.errors import UserError

#: dp_accounting's default PLD discretization; what reported guarantees use.
PLD_INTERVAL = 1e-4
#: Where the PLD accountant stays within seconds (measured on a 2-core CPU, dp_accounting 0.6):
#: sigma / (largest sensitivity) in [0.1, 1e6] (0.05 did not finish in 20 s; ELS at 1e7 neither)
#: and at most 1e7 composed steps (1.5 s; 1e8 did not finish in 20 s). Outside, epsilon() answers
#: with RDP (a valid, looser upper bound) and epsilon_and_accountant() says so.
PLD_SIGMA_RANGE = (0.1, 1e6)
# A mixture of Gaussians (ELS's Binomial(G, p) sensitivities) keeps the PLD down to
# sigma / G = 0.05: ELS at G = 11 needs sigma 0.6-1.1 at epsilon 0.5-8 on real data, and below
# sigma / G = 0.1 RDP answered instead, so loosely that calibration could not go below sigma 1.1
# (epsilon jumped from 8.5 by RDP to 3.3 by PLD across sigma = 1.1: ELS ran with up to 40% more
# noise than its epsilon needed). A PLD evaluation at sigma / G = 0.05 takes ~20 s (T = 80).
# The largest sensitivity is the one left after truncate_mixture_tails (K ~ Binomial(G, p) with
# p ~ 1e-4 keeps K <= 4 of 11): ELS at G = 11 is then answered by the PLD down to sigma ~ 0.2.
PLD_MIXTURE_RATIO_MIN = 0.05
PLD_MAX_STEPS = 10**7

#: The share of δ that the dropped tails of mixtures of Gaussians may take (see
#: :func:`truncate_mixture_tails`): the ε this costs is below 1e-6 relative.
MIXTURE_TAIL_SHARE = 1e-6
#: The tail mass :meth:`~userdp.accounting.accountants.PLDAccountant.delta` first drops (δ is
#: not known before it is computed): an absolute addition to δ of at most this.
MIXTURE_TAIL_FLOOR = 1e-18


def _mixture_steps(event: dpe.DpEvent, count: int = 1) -> int:
    """How many mixture-of-Gaussians steps the composed ``event`` holds."""
    if isinstance(event, dpe.SelfComposedDpEvent):
        return _mixture_steps(event.event, count * int(event.count))
    if isinstance(event, dpe.ComposedDpEvent):
        return sum(_mixture_steps(e, count) for e in event.events)
    return count if isinstance(event, dpe.MixtureOfGaussiansDpEvent) else 0


def _truncate_mixture(event: dpe.MixtureOfGaussiansDpEvent, tail_max: float):
    """The mixture without its largest-sensitivity components of total probability ≤
    ``tail_max``, renormalized, and the mass dropped (the event itself and 0 if none is)."""
    sens = np.asarray(event.sensitivities, float)
    probs = np.asarray(event.sampling_probs, float)
    order = np.argsort(-sens, kind="stable")
    tail = np.cumsum(probs[order])
    n_drop = int(np.searchsorted(tail, tail_max, side="right"))  # tail[:n_drop] <= tail_max
    n_drop = min(n_drop, len(order) - 1)  # one component always stays
    while n_drop and sens[order[n_drop]] == sens[order[n_drop - 1]]:
        n_drop -= 1  # never split equal sensitivities (dropping one of them would not lower the maximum)
    if n_drop == 0:
        return event, 0.0
    dropped = float(tail[n_drop - 1])
    keep = np.sort(order[n_drop:])
    kept = probs[keep] / (1.0 - dropped)
    return (
        dpe.MixtureOfGaussiansDpEvent(
            event.standard_deviation, [float(x) for x in sens[keep]], [float(x) for x in kept]
        ),
        dropped,
    )


def truncate_mixture_tails(event: dpe.DpEvent, budget: float) -> tuple[dpe.DpEvent, float, float]:
    """Drop the improbable largest sensitivities of every mixture of Gaussians in ``event``.

    An ELS step's sensitivity is K ~ Binomial(G, p): with p ~ 1e-4 the components K ≥ 4 carry
    ~1e-13 of the probability but stretch the PLD's loss grid to K = G (the cost, and the reason
    small σ used to fall back to the looser RDP). Write one step as P = (1 − τ)·P' + τ·P_tail,
    P' the mixture of the components kept (renormalized) and τ the mass dropped, Q = N(0, σ²).
    Over the run's n mixture steps (adaptive composition included: K is drawn independently of
    everything released):

    * remove one user: couple the runs on "no step drew a dropped K", which fails with
      probability ≤ S = Σ τ; so Pⁿ(E) ≤ P'ⁿ(E) + S for every event E;
    * add one user: the density of P is ≥ (1 − τ)·that of P' everywhere, so
      Pⁿ(E) ≥ e^{−η}·P'ⁿ(E) with η = −Σ log(1 − τ).

    Hence if the truncated run is (ε', δ')-DP, the real one is (ε' + η, δ' + S)-DP, and
    δ(ε) ≤ δ'(ε − η) + S. The mixtures keep the largest set of components whose dropped mass is
    at most ``budget`` shared equally over the n steps.

    Args:
        event: a composed DpEvent (other event types pass through unchanged).
        budget: the largest total S allowed (≥ 0; 0 drops nothing).

    Returns:
        (the truncated event, S, η); (``event``, 0, 0) when nothing is dropped.
    """
    n = _mixture_steps(event)
    if n == 0 or not budget > 0:
        return event, 0.0, 0.0
    tail_max = float(budget) / n
    slack = [0.0, 0.0]

    def walk(ev: dpe.DpEvent, count: int) -> dpe.DpEvent:
        if isinstance(ev, dpe.SelfComposedDpEvent):
            inner = walk(ev.event, count * int(ev.count))
            return ev if inner is ev.event else dpe.SelfComposedDpEvent(inner, ev.count)
        if isinstance(ev, dpe.ComposedDpEvent):
            parts = [walk(e, count) for e in ev.events]
            return ev if all(a is b for a, b in zip(parts, ev.events, strict=True)) else dpe.ComposedDpEvent(parts)
        if isinstance(ev, dpe.MixtureOfGaussiansDpEvent):
            out, tau = _truncate_mixture(ev, tail_max)
            slack[0] += count * tau
            slack[1] += -count * math.log1p(-tau)
            return out
        return ev

    out = walk(event, 1)
    return out, slack[0], slack[1]


# ----------------------------------------------------------------------------------- PLD
PLD_CACHE: OrderedDict[tuple, Any] = OrderedDict()
_PLD_CACHE_SIZE = 64


_STEP_PLD_CACHE: OrderedDict[tuple, Any] = OrderedDict()


def clear_caches() -> None:
    """Forget every cached PLD (composed, and of one step)."""
    PLD_CACHE.clear()
    _STEP_PLD_CACHE.clear()


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
            x_loss = np.multiply.outer(x[i : i + chunk], self.sensitivities) / self._variance
            if self.adjacency_type == PLM.AdjacencyType.ADD:
                out[i : i + chunk] = -np.logaddexp.reduce(consts + x_loss, axis=1)
            else:
                out[i : i + chunk] = np.logaddexp.reduce(consts - x_loss, axis=1)
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


class _VectorizedGaussianPrivacyLoss(PLM.GaussianPrivacyLoss):
    """dp_accounting's ``GaussianPrivacyLoss`` (ADD or REMOVE, Poisson-subsampled) with the
    inverse privacy loss of ``get_delta_for_epsilon`` taken for all ε at once.

    dp_accounting forms the connect-the-dots PLD from δ(ε) on the whole loss grid, and inverts
    the loss one ε at a time in Python (``[self.inverse_privacy_loss(eps) for eps in ...]``):
    ~33,000 scalar calls per PLD at σ ≈ 1, q ≈ 0.05, which was ~70% of a ULS calibration and of
    every ULS ε printed. The closed forms below are dp_accounting's own, term for term
    (``_inverse_privacy_loss_add/remove``, ``log_a_times_exp_b_plus_c``, ``_log_sub``, the
    Gaussian's inverse without subsampling, the same ``isclose`` endpoints), evaluated in numpy;
    anything else (REPLACE, a value where dp_accounting would raise) takes dp_accounting's loop.
    The PLD built equals dp_accounting's (a test compares the pmfs).
    """

    def _x_cutoffs(self, eps: np.ndarray) -> np.ndarray | None:
        q, s = self.sampling_prob, self.sensitivity
        var = self._standard_deviation**2
        add = self.adjacency_type == PLM.AdjacencyType.ADD
        if self.adjacency_type not in (PLM.AdjacencyType.ADD, PLM.AdjacencyType.REMOVE):
            return None
        if q == 1.0:
            loss = eps
            endpoint = np.zeros(len(eps), bool)
        else:
            edge = -math.log(1 - q) if add else math.log(1 - q)
            endpoint = np.abs(eps - edge) <= 1e-9 * np.maximum(np.abs(eps), abs(edge))  # math.isclose
            a, c = 1 / q, 1 - 1 / q  # log(a·exp(b) + c) with b = ∓ε: a > 0 > c
            b = -eps if add else eps
            with np.errstate(all="ignore"):
                d = b + np.log(a)
                lc = np.log(-c)
                inner = np.where(b == 0, np.log(a + c), d + np.log1p(-np.exp(lc - d)))
            if np.any(~endpoint & (b != 0) & ~(lc < d)):
                return None  # where dp_accounting raises: let it say so
            loss = -inner if add else inner
        with np.errstate(all="ignore"):
            x = -0.5 * s - loss * var / s  # the Gaussian's inverse without subsampling (REMOVE)
        if add:
            x = s + x
        if q != 1.0:
            x = np.where(endpoint, -math.inf if add else math.inf, x)
        return x

    def get_delta_for_epsilon(self, epsilon):
        if isinstance(epsilon, numbers.Number):
            return super().get_delta_for_epsilon(epsilon)
        epsilons = np.asarray(epsilon, dtype=float)
        deltas = np.zeros_like(epsilons, dtype=float)
        q = self.sampling_prob
        if q == 1.0:
            use = np.full(epsilons.shape, True)
        elif self.adjacency_type == PLM.AdjacencyType.ADD:
            use = epsilons < -math.log1p(-q)
        elif self.adjacency_type == PLM.AdjacencyType.REMOVE:
            use = epsilons > math.log1p(-q)
            deltas[~use] = -np.expm1(epsilons[~use])
        else:
            return super().get_delta_for_epsilon(epsilon)
        x = self._x_cutoffs(epsilons[use])
        if x is None:
            return super().get_delta_for_epsilon(epsilon)
        deltas[use] = self.mu_upper_cdf(x) - np.exp(epsilons[use] + self.mu_lower_log_cdf(x))
        return np.clip(deltas, 0, 1)


def gaussian_pld(sigma: float, sampling_prob: float, interval: float):
    """``PLD.from_gaussian_mechanism`` (sensitivity 1, add-or-remove, pessimistic,
    connect-the-dots, truncation e^-50) with the vectorized inverse privacy loss; dp_accounting's
    own if its private builder is unavailable."""
    create = getattr(PLD, "_create_pld_pmf_from_monotone_privacy_loss", None)
    if create is None:  # pragma: no cover - a dp_accounting without the private builder
        return PLD.from_gaussian_mechanism(
            standard_deviation=sigma,
            value_discretization_interval=interval,
            sampling_prob=sampling_prob,
            neighboring_relation=NeighborRel.ADD_OR_REMOVE_ONE,
        )

    def single(adjacency):
        loss = _VectorizedGaussianPrivacyLoss(
            sigma,
            sensitivity=1,
            pessimistic_estimate=True,
            log_mass_truncation_bound=-50,
            sampling_prob=sampling_prob,
            adjacency_type=adjacency,
        )
        return create(loss, pessimistic_estimate=True, value_discretization_interval=interval, use_connect_dots=True)

    remove = single(PLM.AdjacencyType.REMOVE)
    if sampling_prob == 1.0:
        return PLD.PrivacyLossDistribution(remove)
    return PLD.PrivacyLossDistribution(remove, single(PLM.AdjacencyType.ADD))


def mixture_gaussian_pld(sigma: float, sensitivities, probs, interval: float):
    """``PLD.from_mixture_gaussian_mechanism`` (pessimistic, connect-the-dots, truncation
    e^-50) with the vectorized inverse privacy loss; dp_accounting's own if its private
    builder is unavailable."""
    create = getattr(PLD, "_create_pld_pmf_from_monotone_privacy_loss", None)
    if create is None:  # pragma: no cover - a dp_accounting without the private builder
        return PLD.from_mixture_gaussian_mechanism(
            standard_deviation=sigma,
            sensitivities=sensitivities,
            sampling_probs=probs,
            value_discretization_interval=interval,
        )

    def single(adjacency):
        loss = _VectorizedMixtureGaussianPrivacyLoss(
            sigma,
            sensitivities,
            probs,
            pessimistic_estimate=True,
            log_mass_truncation_bound=-50,
            adjacency_type=adjacency,
        )
        return create(loss, pessimistic_estimate=True, value_discretization_interval=interval, use_connect_dots=True)

    return PLD.PrivacyLossDistribution(single(PLM.AdjacencyType.REMOVE), single(PLM.AdjacencyType.ADD))


class _ComposedPLD:
    """get_epsilon / get_delta of a PrivacyLossDistribution, like a PLDAccountant's."""

    def __init__(self, pld) -> None:
        self.pld_distribution = pld

    def get_epsilon(self, target_delta: float) -> float:
        return self.pld_distribution.get_epsilon_for_delta(target_delta)

    def get_delta(self, target_epsilon: float) -> float:
        return self.pld_distribution.get_delta_for_epsilon(target_epsilon)


def _self_convolve_bounds(probs: np.ndarray, num_times: int, tail_mass_truncation: float) -> tuple[int, int]:
    """dp_accounting's ``common.compute_self_convolve_bounds`` (the Chernoff bounds at the orders
    ±1..20 / n), its 40 ``scipy.special.logsumexp`` calls made one numpy expression: the same
    log-moment-generating functions, the same ceil/floor of the same bounds. The 40 calls were
    ~70% of a ledger's per-step epsilon (scipy's per-call overhead at these small lengths)."""
    n = len(probs)
    upper, lower = (n - 1) * num_times, 0
    if tail_mass_truncation == 0:
        return lower, upper
    orders = np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / n
    a = np.arange(n)[None, :] * orders[:, None]
    a_max = a.max(axis=1, keepdims=True)
    log_mgfs = np.log(np.sum(probs[None, :] * np.exp(a - a_max), axis=1)) + a_max[:, 0]
    log_tail = math.log(2 / tail_mass_truncation)
    for order, log_mgf in zip(orders.tolist(), log_mgfs.tolist(), strict=True):
        bound = (num_times * log_mgf + log_tail) / order
        if not math.isfinite(bound):
            continue
        if order > 0:
            upper = min(upper, math.ceil(bound))
        else:
            lower = max(lower, math.floor(bound))
    return lower, upper


def _self_compose_pmf(pmf, num_times: int, tail_mass_truncation: float = 1e-15):
    """``DensePLDPmf.self_compose`` (dp_accounting 0.6) with :func:`_self_convolve_bounds`:
    the same FFT, truncation and infinity mass, so the same pmf (tests compare them)."""
    if type(pmf) is not pld_pmf.DensePLDPmf:
        return pmf.self_compose(num_times, tail_mass_truncation)
    probs = np.asarray(pmf._probs, dtype=float)
    lo, hi = _self_convolve_bounds(probs, num_times, tail_mass_truncation)
    out_len = hi - lo + 1
    fast_len = fft.next_fast_len(max(out_len, len(probs)))
    conv = np.real(fft.ifft(fft.fft(probs, fast_len) ** num_times))
    out = np.array(np.roll(conv, -lo)[:out_len])
    inf_prob = tail_mass_truncation - math.expm1(num_times * math.log1p(-pmf._infinity_mass))
    return pld_pmf.DensePLDPmf(
        pmf._discretization, pmf._lower_loss * num_times + lo, out, inf_prob, pmf._pessimistic_estimate
    )


def self_compose(pld, num_times: int):
    """``PrivacyLossDistribution.self_compose(num_times)``, faster (see :func:`_self_compose_pmf`)."""
    if num_times <= 0:
        raise ValueError(f"num_times should be >= 1, num_times={num_times}")
    remove = _self_compose_pmf(pld._pmf_remove, num_times)
    if pld._symmetric:
        return PLD.PrivacyLossDistribution(remove)
    return PLD.PrivacyLossDistribution(remove, _self_compose_pmf(pld._pmf_add, num_times))


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
        make = lambda: mixture_gaussian_pld(  # noqa: E731
            step.standard_deviation, step.sensitivities, step.sampling_probs, interval
        )
    else:
        if not isinstance(step.event, dpe.GaussianDpEvent):
            return None
        if step.sampling_probability <= 0 or step.event.noise_multiplier <= 0:
            return None
        make = lambda: gaussian_pld(  # noqa: E731
            step.event.noise_multiplier, step.sampling_probability, interval
        )
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
    composed = PLD.identity(value_discretization_interval=interval).compose(self_compose(base, event.count))
    return _ComposedPLD(composed)


def _with_pure(acc, pure: list[float], interval: float):
    """``acc``'s PLD composed with the pure epsilon-DP dominating pair of each epsilon in ``pure``
    (``PrivacyLossDistribution.from_privacy_parameters(epsilon, 0)``: the two-point pair that
    every epsilon-DP mechanism is a post-processing of, under whichever adjacency it is DP)."""
    pld = None
    if acc is not None:  # ours, or dp_accounting's PLDAccountant (its PLD is its _pld)
        pld = acc.pld_distribution if isinstance(acc, _ComposedPLD) else acc._pld
    for eps in pure:
        step = PLD.from_privacy_parameters(
            pld_common.DifferentialPrivacyParameters(eps, 0.0), value_discretization_interval=interval
        )
        pld = step if pld is None else pld.compose(step)
    return _ComposedPLD(pld)


def pld_distribution(event: dpe.DpEvent, interval: float):
    """A composed PLD accountant for the event (LRU-cached by the event's parameters)."""
    key = (repr(event), float(interval))
    acc = PLD_CACHE.get(key)
    if acc is not None:
        PLD_CACHE.move_to_end(key)
        return acc
    if contains_event(event, dpe.SampledWithoutReplacementDpEvent):
        raise UserError(
            "fixed-size cohorts (sampling without replacement) are accounted with RDP under "
            "replace-one adjacency: use accountant='rdp'"
        )
    rest, pure = split_pure_dp(event)
    if pure:  # dp_accounting's PLD takes no pure-DP event under add-or-remove: composed here
        acc = _with_pure(pld_distribution(rest, interval) if rest is not None else None, pure, interval)
    else:
        acc = _self_composed_from_cached_step(event, interval)
    if acc is None:
        acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval)
        try:
            acc.compose(event)
        except dp_accounting.UnsupportedEventError as exc:
            raise UserError(f"the PLD accountant cannot account this event: {exc}") from None
    PLD_CACHE[key] = acc
    while len(PLD_CACHE) > _PLD_CACHE_SIZE:
        PLD_CACHE.popitem(last=False)
    return acc


def pld_infeasible(event: dpe.DpEvent, count: int = 1) -> str | None:
    """Why the PLD accountant cannot answer this event within seconds (None: it can)."""
    if isinstance(event, dpe.SelfComposedDpEvent):
        return pld_infeasible(event.event, count * int(event.count))
    if isinstance(event, dpe.ComposedDpEvent):
        for e in event.events:
            why = pld_infeasible(e, count)
            if why:
                return why
        return None
    if count > PLD_MAX_STEPS:
        return f"{count:.3g} composed steps (PLD handles up to {PLD_MAX_STEPS:.0e})"
    if isinstance(event, (dpe.PoissonSampledDpEvent, dpe.SampledWithoutReplacementDpEvent)):
        return pld_infeasible(event.event, count)
    ratio, low = None, PLD_SIGMA_RANGE[0]
    if isinstance(event, dpe.GaussianDpEvent):
        ratio = float(event.noise_multiplier)
    elif isinstance(event, dpe.MixtureOfGaussiansDpEvent):
        ratio = float(event.standard_deviation) / max(max(event.sensitivities), 1e-300)
        low = PLD_MIXTURE_RATIO_MIN
    if ratio is not None and not (low <= ratio <= PLD_SIGMA_RANGE[1]):
        return f"noise multiplier / sensitivity = {ratio:.3g} (PLD handles {low:g} to {PLD_SIGMA_RANGE[1]:.0e})"
    return None
