"""The generic group-privacy reduction (docs/algorithms.md, §4.4): the baseline the tight accountant beats.

An example-level (ε, δ)-DP mechanism run on data where each user has at most k records is
user-level (kε, δ_k)-DP, with δ_k given by one of three standard forms:

* ``"a"`` (default, tightest): δ·(e^{kε} − 1)/(e^{ε} − 1)
* ``"b"`` (Vadhan, Lemma 2.2):  k·e^{(k−1)ε}·δ
* ``"c"`` (the practical guide [Ponomareva et al. 2023]): k·e^{kε}·δ

:func:`group_privacy_epsilon` turns an example-level accountant into a user-level guarantee by
choosing the example-level (ε_ex, δ_ex) that minimizes kε_ex subject to δ_k ≤ the target δ,
on a fine grid of ε_ex. δ_ex(ε_ex) is the smaller of a pessimistic PLD and RDP (both are upper
bounds; PLD is of no use below δ ≈ 1e-15, where RDP takes over). When no δ_ex down to ``min_example_delta``
works the result says "infeasible".
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from userdp.accounting import pld as _pld_mod
from userdp.accounting import rdp as _rdp_mod
from userdp.accounting.pld import PLD_INTERVAL
from userdp.errors import UserError
from userdp.validation import check_choice, check_fraction, check_int, check_nonnegative

__all__ = ["FORMS", "group_delta", "group_privacy", "GroupPrivacyResult", "group_privacy_epsilon"]

FORMS = {
    "a": "delta_user = delta_ex * (exp(k*eps_ex) - 1) / (exp(eps_ex) - 1)",
    "b": "delta_user = k * exp((k-1)*eps_ex) * delta_ex  (Vadhan Lemma 2.2)",
    "c": "delta_user = k * exp(k*eps_ex) * delta_ex  (Ponomareva et al. guide)",
}


def _log_group_delta(eps: float, log_delta: float, k: int, form: str) -> float:
    """log of the user-level δ; computed in log space (δ_ex may be 1e-300, kε may be 500)."""
    if form == "a":
        if eps == 0:
            return log_delta + math.log(k)
        # log((e^{kε}-1)/(e^{ε}-1)) = (k-1)ε + log(1-e^{-kε}) - log(1-e^{-ε})
        return log_delta + (k - 1) * eps + math.log1p(-math.exp(-k * eps)) - math.log1p(-math.exp(-eps))
    if form == "b":
        return log_delta + math.log(k) + (k - 1) * eps
    if form == "c":
        return log_delta + math.log(k) + k * eps
    raise UserError(f"group-privacy form must be one of a, b, c (got {form!r})")


def group_delta(epsilon: float, delta: float, k: int, form: str = "a") -> float:
    """User-level δ for an example-level (ε, δ) guarantee and groups of at most k records."""
    k = check_int(k, "group size")
    delta = check_fraction(delta, "delta")
    epsilon = check_nonnegative(epsilon, "epsilon")
    check_choice(form, "group-privacy form", FORMS)
    return math.exp(min(_log_group_delta(epsilon, math.log(delta), k, form), 700.0))


def group_privacy(epsilon: float, delta: float, k: int, form: str = "a") -> tuple[float, float]:
    """(kε, δ_k): the user-level guarantee of an example-level (ε, δ)-DP mechanism."""
    return int(k) * float(epsilon), group_delta(epsilon, delta, k, form)


@dataclasses.dataclass(frozen=True)
class GroupPrivacyResult:
    feasible: bool
    epsilon: float  # user-level ε (inf when infeasible)
    delta: float  # user-level target δ
    group_size: int
    form: str
    example_epsilon: float | None = None
    example_delta: float | None = None
    example_accountant: str | None = None  # which backend gave ε_ex at δ_ex

    def describe(self) -> str:
        if not self.feasible:
            return (
                f"generic group privacy (form {self.form}), G={self.group_size}: infeasible "
                f"(no example-level delta meets user-level delta={self.delta:g})"
            )
        return (
            f"generic group privacy (form {self.form}), G={self.group_size}: "
            f"epsilon={self.epsilon:.4g} at delta={self.delta:g} (example-level "
            f"({self.example_epsilon:.4g}, {self.example_delta:.3g}) by {self.example_accountant})"
        )


def _rdp_delta_grid(orders: np.ndarray, rdp: np.ndarray, eps: np.ndarray) -> np.ndarray:
    """log δ from RDP at many ε: dp_accounting's ``compute_delta`` (improved bound), vectorized."""
    a = np.asarray(orders, float)[:, None]
    r = np.asarray(rdp, float)[:, None]
    e = np.asarray(eps, float)[None, :]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        kl = np.where(r > 0, 0.5 * np.log1p(-np.exp(-r)), -np.inf) * np.ones_like(e)
        bound = np.where(a > 1.01, (a - 1) * (r - e + np.log1p(-1 / a)) - np.log(a), np.inf)
        logd = np.minimum(kl, bound)
        logd = np.where(r < 0, -np.inf, logd)
        logd = np.where(np.isnan(logd), np.inf, logd)
    return np.minimum(logd.min(axis=0), 0.0)


def group_privacy_epsilon(
    example_event: dpe.DpEvent,
    group_size: int,
    delta: float,
    form: str = "a",
    *,
    min_example_delta: float = 1e-300,
    pld_interval: float = PLD_INTERVAL,
    grid_rtol: float = 1e-3,
) -> GroupPrivacyResult:
    """User-level ε of an example-level mechanism (the whole run's event) by group privacy.

    For each example-level ε_ex on a geometric grid (relative step ``grid_rtol``) the best
    example-level δ_ex(ε_ex) is the smaller of the PLD and RDP values (both upper bounds; PLD
    is vectorized over the grid, RDP covers δ_ex below PLD's reach). The answer is the smallest
    G·ε_ex whose user-level δ meets the target with δ_ex ≥ ``min_example_delta``.
    """
    check_choice(form, "group-privacy form", FORMS)
    k = check_int(group_size, "group size")
    delta = check_fraction(delta, "delta")
    if not isinstance(example_event, dpe.DpEvent):
        raise UserError(f"example_event must be a dp_accounting DpEvent (got {type(example_event).__name__})")
    log_target = math.log(delta)
    orders, rdp = np.asarray(_rdp_mod.rdp_orders(), dtype=float), _rdp_mod.step_rdp(example_event)
    # The smallest useful ε_ex is ε_ex at δ_ex = target (δ_ex must be below the target).
    pld = None
    with contextlib.suppress(UserError):  # e.g. fixed cohorts: RDP only
        pld = _pld_mod.pld_distribution(example_event, pld_interval)
    e_lo = float(rdp_lib.compute_epsilon(orders, rdp, delta)[0])
    e_pld_hi = 0.0
    if pld is not None:
        e_lo = min(e_lo, float(pld.get_epsilon(delta)))
        for d_floor in (1e-16, 1e-15, 1e-14, 1e-13, 1e-12, 1e-11, 1e-10):
            e_pld_hi = float(pld.get_epsilon(d_floor))  # PLD gives ∞ below ~1e-15
            if math.isfinite(e_pld_hi):
                break
    e_lo = max(e_lo, 1e-6)
    eps_grid = np.exp(np.arange(math.log(e_lo), math.log(max(1e4, 2 * e_lo)), math.log1p(grid_rtol)))
    log_d_rdp = _rdp_delta_grid(orders, rdp, eps_grid)
    log_d_pld = np.full_like(eps_grid, np.inf)
    inner = getattr(pld, "pld_distribution", None)
    if inner is not None and math.isfinite(e_pld_hi):
        sel = eps_grid <= e_pld_hi
        if sel.any():
            with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
                log_d_pld[sel] = np.log(np.maximum(np.asarray(inner.get_delta_for_epsilon(eps_grid[sel]), float), 0.0))
    use_pld = log_d_pld <= log_d_rdp
    log_d = np.where(use_pld, log_d_pld, log_d_rdp)
    log_floor = math.log(min_example_delta)
    for i, e in enumerate(eps_grid):
        ld = log_d[i]
        if not np.isfinite(ld):
            continue
        ld = max(ld, log_floor)  # a δ_ex below the floor is not used; the floor is (looser)
        if ld >= log_target:
            continue
        if _log_group_delta(float(e), float(ld), k, form) <= log_target:
            return GroupPrivacyResult(
                True, k * float(e), float(delta), k, form, float(e), math.exp(ld), "pld" if use_pld[i] else "rdp"
            )
    return GroupPrivacyResult(False, math.inf, float(delta), k, form)
