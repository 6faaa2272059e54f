"""The generic group-privacy reduction (SPEC §2, §4.4): the baseline the tight accountant beats.

An example-level (ε, δ)-DP mechanism run on data where each user has at most k records is
user-level (kε, δ_k)-DP, with δ_k given by one of three standard forms:

* ``"a"`` (default, tightest): δ·(e^{kε} − 1)/(e^{ε} − 1)
* ``"b"`` (Vadhan, Lemma 2.2):  k·e^{(k−1)ε}·δ
* ``"c"`` (the practical guide [S4]): k·e^{kε}·δ

:func:`group_privacy_epsilon` turns an example-level accountant into a user-level guarantee by
choosing the example-level δ_ex that minimizes kε_ex(δ_ex) subject to δ_k ≤ the target δ.
ε_ex(δ_ex) is the smaller of a pessimistic PLD and RDP (both are upper bounds; PLD returns
∞ below about 1e-15, where RDP takes over). When no δ_ex down to ``min_example_delta``
works the result says "infeasible".
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from userdp import accounting
from userdp.errors import UserError

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
    if k < 1 or int(k) != k:
        raise UserError(f"group size must be an integer >= 1 (got {k})")
    if not (0 < delta < 1):
        raise UserError(f"delta must be in (0, 1) (got {delta})")
    if epsilon < 0:
        raise UserError(f"epsilon must be >= 0 (got {epsilon})")
    return math.exp(min(_log_group_delta(float(epsilon), math.log(delta), int(k), form), 700.0))


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
            return (f"generic group privacy (form {self.form}), G={self.group_size}: infeasible "
                    f"(no example-level delta meets user-level delta={self.delta:g})")
        return (f"generic group privacy (form {self.form}), G={self.group_size}: "
                f"epsilon={self.epsilon:.4g} at delta={self.delta:g} (example-level "
                f"({self.example_epsilon:.4g}, {self.example_delta:.3g}) by {self.example_accountant})")


def group_privacy_epsilon(example_event: dpe.DpEvent, group_size: int, delta: float,
                          form: str = "a", *, grid_step_decades: float = 0.1,
                          min_example_delta: float = 1e-300,
                          pld_interval: float = accounting.PLD_INTERVAL) -> GroupPrivacyResult:
    """User-level ε of an example-level mechanism (the whole run's event) by group privacy.

    Scans δ_ex downward from the target δ on a grid of ``grid_step_decades``; since ε_ex is
    non-increasing in δ_ex, the first δ_ex that meets the user-level δ minimizes kε_ex.
    """
    if form not in FORMS:
        raise UserError(f"group-privacy form must be one of a, b, c (got {form!r})")
    k = int(group_size)
    if k < 1 or k != group_size:
        raise UserError(f"group size must be an integer >= 1 (got {group_size})")
    if not (0 < delta < 1):
        raise UserError(f"delta must be in (0, 1) (got {delta})")
    log_target = math.log(delta)
    orders, rdp = accounting._rdp(example_event)
    pld = None
    try:
        pld = accounting._pld(example_event, pld_interval)
    except UserError:
        pld = None  # e.g. fixed cohorts: RDP only

    top = math.log10(delta)
    n = int(math.floor((top - math.log10(min_example_delta)) / grid_step_decades)) + 1
    for i in range(n):
        log10_d = top - i * grid_step_decades
        d = 10.0 ** log10_d
        e_rdp = float(rdp_lib.compute_epsilon(orders, rdp, d)[0])
        e_pld = math.inf
        if pld is not None and d >= 1e-17:
            try:
                e_pld = float(pld.get_epsilon(d))
            except (ValueError, OverflowError):
                e_pld = math.inf
        eps_ex, which = (e_pld, "pld") if e_pld <= e_rdp else (e_rdp, "rdp")
        if not math.isfinite(eps_ex):
            continue
        if _log_group_delta(eps_ex, log10_d * math.log(10), k, form) <= log_target:
            return GroupPrivacyResult(True, k * eps_ex, float(delta), k, form, eps_ex, d, which)
    return GroupPrivacyResult(False, math.inf, float(delta), k, form)
