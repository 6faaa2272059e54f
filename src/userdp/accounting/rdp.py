"""Rényi DP of step events: dp_accounting's RdpAccountant, plus the RDP of the ELS mixture of
Gaussians, which dp_accounting 0.6 does not have (computed here by numerical integration of the
Rényi divergence of the dominating pair, in both directions)."""

from __future__ import annotations

import contextlib
import logging
import math
from collections import OrderedDict
from collections.abc import Sequence

import dp_accounting
import numpy as np
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib
from scipy import stats
from scipy.special import logsumexp

from userdp.accounting.events import (
    NeighborRel,
    check_delta,
    compose,
    neighbor_relation,
    pure_dp_epsilon,
    uls_step_event,
)
from userdp.errors import UserError

#: RDP orders used by the RDP backend (dp_accounting's defaults).
RDP_ORDERS = tuple(float(a) for a in rdp_lib.DEFAULT_RDP_ORDERS)


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


def mog_rdp(
    sigma: float,
    sensitivities: Sequence[float],
    probs: Sequence[float],
    orders: Sequence[float] = RDP_ORDERS,
    *,
    max_points: int = 2_000_000,
) -> np.ndarray:
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
    ords = np.asarray(orders, dtype=float)
    h = sigma / 4.0
    lo = -40.0 * sigma - smax
    covered = ords * smax + 40.0 * sigma <= lo + h * max_points
    if not covered.any():  # sigma far below the sensitivities: no order is bounded on the grid
        return np.full(len(ords), np.inf)
    a_max = float(ords[covered].max())
    x = np.arange(lo, a_max * smax + 40.0 * sigma + h, h)
    log_q = -0.5 * (x / sigma) ** 2 - 0.5 * math.log(2 * math.pi) - math.log(sigma) + math.log(h)
    L = np.empty_like(x)
    chunk = max(1, 4_000_000 // len(sens))
    for i in range(0, len(x), chunk):
        L[i : i + chunk] = _mog_log_ratio(x[i : i + chunk], sigma, sens, log_w)
    out = np.full(len(ords), np.inf)
    for i, a in enumerate(ords):
        if not covered[i]:
            continue
        d1 = logsumexp(a * L + log_q) / (a - 1)
        d2 = logsumexp((1 - a) * L + log_q) / (a - 1)
        out[i] = max(d1, d2, 0.0)
    return out


def pure_dp_rdp(epsilon: float, orders: np.ndarray) -> np.ndarray:
    """Rényi DP at ``orders`` of the epsilon-DP dominating pair P = (p, q), Q = (q, p) with
    p = e^eps / (1 + e^eps): D_a = log(p^a q^(1-a) + q^a p^(1-a)) / (a - 1), KL at a = 1. Every
    epsilon-DP mechanism is a post-processing of this pair, so its RDP is at most this."""
    orders = np.asarray(orders, dtype=float)
    log_p, log_q = -np.logaddexp(0.0, -epsilon), -np.logaddexp(0.0, epsilon)
    out = np.empty(len(orders))
    for i, a in enumerate(orders):
        if a == 1.0:
            out[i] = (np.exp(log_p) - np.exp(log_q)) * epsilon
        else:
            out[i] = np.logaddexp(a * log_p + (1 - a) * log_q, a * log_q + (1 - a) * log_p) / (a - 1)
    return np.minimum(out, epsilon)


def _rdp_vector(event: dpe.DpEvent, orders: np.ndarray, relation: NeighborRel) -> np.ndarray:
    if isinstance(event, dpe.SelfComposedDpEvent):
        return event.count * _rdp_vector(event.event, orders, relation)
    if isinstance(event, dpe.ComposedDpEvent):
        return sum((_rdp_vector(e, orders, relation) for e in event.events), np.zeros(len(orders)))
    if isinstance(event, dpe.MixtureOfGaussiansDpEvent):
        sigma, sens, probs = float(event.standard_deviation), tuple(event.sensitivities), tuple(event.sampling_probs)
        return _kept(
            _MOG_RDP_CACHE, 256, (sigma, sens, probs, tuple(orders)), lambda: mog_rdp(sigma, sens, probs, tuple(orders))
        )
    eps = pure_dp_epsilon(event, relation)
    if eps is not None:
        return pure_dp_rdp(eps, orders)
    return _kept(
        _LIBRARY_RDP_CACHE, 1024, (repr(event), tuple(orders), relation), lambda: _library_rdp(event, orders, relation)
    )


#: RDP vectors already computed, the oldest forgotten first (:func:`_kept`): ELS mixtures' (ours),
#: and dp_accounting's of one event (Poisson-sampled or plain Gaussian, a fixed cohort). A
#: calibration's secant search, and the planner's σ(M) beside it, evaluate the same σ again and
#: again; one dp_accounting evaluation is ~60 ms of its series.
_MOG_RDP_CACHE: OrderedDict[tuple, np.ndarray] = OrderedDict()
_LIBRARY_RDP_CACHE: OrderedDict[tuple, np.ndarray] = OrderedDict()


def _kept(cache: OrderedDict[tuple, np.ndarray], size: int, key: tuple, compute) -> np.ndarray:
    """``compute()``, kept in ``cache`` under ``key`` (at most ``size`` entries); a copy, so that a
    caller that changes the vector in place cannot change the cached one."""
    if key not in cache:
        cache[key] = compute()
        while len(cache) > size:
            cache.popitem(last=False)
    return cache[key].copy()


def _library_rdp(event: dpe.DpEvent, orders: np.ndarray, relation: NeighborRel) -> np.ndarray:
    """dp_accounting's RDP of one event at ``orders``."""
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


def clear_caches() -> None:
    """Forget every cached RDP vector (the mixtures' and dp_accounting's)."""
    _MOG_RDP_CACHE.clear()
    _LIBRARY_RDP_CACHE.clear()


def step_rdp(step_event: dpe.DpEvent, orders: Sequence[float] | np.ndarray | None = None) -> np.ndarray:
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
    return _rdp_vector(step_event, orders_arr, neighbor_relation(step_event))


def rdp_curve(event: dpe.DpEvent, orders: Sequence[float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(orders, RDP) of the event; kept for callers of the old private name (use step_rdp)."""
    orders_arr = np.asarray(orders if orders is not None else RDP_ORDERS, dtype=float)
    return orders_arr, step_rdp(event, orders_arr)


def moments_accountant_epsilon(sampling_rate: float, noise_multiplier: float, steps: int, delta: float) -> float:
    """The legacy moments accountant of [McMahan et al. 2018] (McMahan et al. 2018): integer orders 2..33 and the
    classical conversion ε = min_α T·RDP(α) + ln(1/δ)/(α−1). For reproduction only."""
    orders = np.arange(2, 34, dtype=float)
    acc = rdp_lib.RdpAccountant(orders=list(orders))
    with _quiet_rdp_convergence():
        acc.compose(compose(uls_step_event(noise_multiplier, sampling_rate), steps))
    return float(np.min(acc.rdp + math.log(1 / check_delta(delta)) / (orders - 1)))
