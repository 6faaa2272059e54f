"""Heuristics that choose the group size, cohort size and noise for a compute budget (SPEC §5).

* ELS: ``G = median records per user`` (SPEC §5.1), computed on the per-user *counts* (one value
  per user, not one per record), optionally with an epsilon-DP median (exponential mechanism over
  a public log-spaced grid) whose epsilon the result states so the privacy report can count it.
* ULS: Estimate-and-Double (SPEC §5.2, Algorithm 3): starting from small powers of two, double
  the cohort size M or the group size G, whichever shrinks the noise proxy sigma(M)*L(G)/M more,
  until M*G reaches the budget B; ties go to M; M never exceeds the number of users N.
  ``sigma_of_m`` and ``l_of_g`` are injected callables, so the loop is testable with a synthetic
  L(G) = L/sqrt(G).
* The noise-standard-deviation proxies of SPEC §7.1: ELS sigma_ELS*L/B, ULS sigma_ULS*L(G)/M
  (per-coordinate std of the noise in the averaged gradient, with C set to the gradient bound).

``plan_for_training(data, model, loss_fn, ...)`` puts them together; it is what ``userdp plan``
and a training config with ``plan: auto`` call.

Non-private data touches: the exact median (without ``dp_median_epsilon``), the users sampled to
estimate L(G) and their gradient norms are computed from the private data without noise. The plan
says so in ``data_touches``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

from userdp.errors import UserError

# --------------------------------------------------------------------------------------------
# ELS group size (SPEC §5.1)
# --------------------------------------------------------------------------------------------


def _per_user_counts(sizes: Sequence[int] | np.ndarray) -> np.ndarray:
    counts = np.asarray(sizes)
    if counts.ndim != 1 or counts.size == 0:
        raise UserError("per-user record counts must be a non-empty 1-D array (one count per user)")
    if not np.issubdtype(counts.dtype, np.integer):
        if not np.all(np.isfinite(counts)) or np.any(counts != np.round(counts)):
            raise UserError("per-user record counts must be whole numbers")
        counts = counts.astype(np.int64)
    if np.any(counts < 1):
        raise UserError(f"every user must hold at least one record; {int(np.sum(counts < 1))} do not")
    return counts.astype(np.int64)


def log_grid(upper: int, points_per_doubling: int = 4) -> np.ndarray:
    """Public candidate values 1..upper, spaced by 2**(1/points_per_doubling), rounded, unique."""
    if upper < 1:
        raise UserError(f"the DP median's upper bound must be >= 1, got {upper}")
    n = int(math.ceil(math.log2(upper) * points_per_doubling)) + 1
    grid = np.unique(np.round(2.0 ** (np.arange(n) / points_per_doubling)).astype(np.int64))
    grid = grid[grid <= upper]
    if grid[-1] != upper:
        grid = np.append(grid, upper)
    return grid


def dp_median_probabilities(
    counts: np.ndarray, epsilon: float, grid: np.ndarray
) -> np.ndarray:
    """Exponential-mechanism probabilities over ``grid`` for the median of ``counts``.

    Utility u(c) = -| #{users with count <= c} - n/2 |. Adding, removing or replacing one user
    changes u(c) by at most 1 for every c (sensitivity 1), so sampling with probability
    proportional to exp(epsilon * u / 2) is epsilon-DP (McSherry & Talwar). The grid is public
    (it does not depend on the data).
    """
    if not epsilon > 0:
        raise UserError(f"the DP median's epsilon must be > 0, got {epsilon}")
    counts = np.sort(np.asarray(counts))
    below = np.searchsorted(counts, grid, side="right")
    utility = -np.abs(below - counts.size / 2.0)
    logits = epsilon * utility / 2.0
    logits -= logits.max()
    probs = np.exp(logits)
    return probs / probs.sum()


def dp_median(
    counts: np.ndarray,
    epsilon: float,
    *,
    upper: int = 1 << 16,
    points_per_doubling: int = 4,
    rng: np.random.Generator | None = None,
) -> int:
    """An epsilon-DP median of per-user counts: exponential mechanism over a public log grid."""
    counts = _per_user_counts(counts)
    grid = log_grid(upper, points_per_doubling)
    probs = dp_median_probabilities(counts, epsilon, grid)
    rng = rng if rng is not None else np.random.default_rng()
    return int(grid[rng.choice(grid.size, p=probs)])


@dataclass(frozen=True)
class GroupSizeChoice:
    """The ELS group size and how it was obtained."""

    group_size: int
    method: str  # "median" (non-private) or "dp_median"
    epsilon_spent: float  # pure-DP epsilon of the median query (0.0 when not private)
    num_users: int
    note: str

    def to_dict(self) -> dict:
        return asdict(self)


def els_group_size(
    sizes: Sequence[int] | np.ndarray,
    *,
    dp_median_epsilon: float | None = None,
    dp_median_upper: int = 1 << 16,
    rng: np.random.Generator | None = None,
) -> GroupSizeChoice:
    """G_ELS = median records per user, computed on per-user counts (SPEC §5.1).

    With ``dp_median_epsilon`` the median is released by an epsilon-DP exponential mechanism
    over a public log-spaced grid in [1, dp_median_upper]; the result's ``epsilon_spent`` must
    be added to the training budget by the privacy report (basic composition).
    """
    counts = _per_user_counts(sizes)
    if dp_median_epsilon is None:
        g = max(1, int(math.ceil(float(np.median(counts)))))
        return GroupSizeChoice(
            g, "median", 0.0, int(counts.size),
            f"median of {counts.size} per-user record counts, computed without DP "
            "(a non-private touch of the data)",
        )
    g = dp_median(counts, dp_median_epsilon, upper=dp_median_upper, rng=rng)
    return GroupSizeChoice(
        g, "dp_median", float(dp_median_epsilon), int(counts.size),
        f"median of {counts.size} per-user record counts released with an "
        f"epsilon={dp_median_epsilon:g}-DP exponential mechanism over a public log grid "
        f"[1, {dp_median_upper}]; add this epsilon to the training budget",
    )


# --------------------------------------------------------------------------------------------
# Estimate-and-Double (SPEC §5.2, Algorithm 3)
# --------------------------------------------------------------------------------------------


def _is_power_of_two(x: int) -> bool:
    return isinstance(x, (int, np.integer)) and x >= 1 and (int(x) & (int(x) - 1)) == 0


@dataclass(frozen=True)
class Doubling:
    """One iteration of Estimate-and-Double: the state before it and what was doubled."""

    cohort_size: int
    group_size: int
    r_m: float  # sigma(2M) / (2 sigma(M)), or inf when 2M > N
    r_g: float  # L(2G) / L(G)
    doubled: str  # "M" or "G"


@dataclass(frozen=True)
class EstimateAndDoubleResult:
    cohort_size: int
    group_size: int
    objective: float  # sigma(M) L(G) / M at the result
    trace: tuple[Doubling, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        return {
            "cohort_size": self.cohort_size,
            "group_size": self.group_size,
            "objective": self.objective,
            "trace": [asdict(d) for d in self.trace],
        }


def estimate_and_double(
    budget: int,
    num_users: int,
    sigma_of_m: Callable[[int], float],
    l_of_g: Callable[[int], float],
    *,
    m0: int = 1,
    g0: int = 1,
) -> EstimateAndDoubleResult:
    """SPEC §5.2 Algorithm 3. ``budget``, ``m0`` and ``g0`` are powers of two with m0*g0 <= budget.

    While M*G < B: r_M = sigma(2M)/(2 sigma(M)), r_G = L(2G)/L(G); double M if r_M <= r_G (ties go
    to M), else G. M is never doubled past ``num_users``. sigma(.) and L(.) are each evaluated at
    most once per argument (cached here).
    """
    for name, v in (("compute budget", budget), ("initial cohort size", m0), ("initial group size", g0)):
        if not _is_power_of_two(v):
            raise UserError(f"{name} must be a power of two for Estimate-and-Double, got {v}")
    if m0 * g0 > budget:
        raise UserError(f"initial M*G = {m0 * g0} exceeds the compute budget {budget}")
    if num_users < 1:
        raise UserError(f"the number of users must be >= 1, got {num_users}")
    if m0 > num_users:
        raise UserError(f"initial cohort size {m0} exceeds the number of users {num_users}")
    sigma = functools.lru_cache(maxsize=None)(sigma_of_m)
    ell = functools.lru_cache(maxsize=None)(l_of_g)
    m, g = int(m0), int(g0)
    trace: list[Doubling] = []
    while m * g < budget:
        r_g = ell(2 * g) / ell(g)
        if 2 * m <= num_users:
            r_m = sigma(2 * m) / (2.0 * sigma(m))
        else:
            r_m = math.inf
        doubled = "M" if r_m <= r_g else "G"
        trace.append(Doubling(m, g, float(r_m), float(r_g), doubled))
        if doubled == "M":
            m *= 2
        else:
            g *= 2
    return EstimateAndDoubleResult(m, g, float(sigma(m) * ell(g) / m), tuple(trace))


# --------------------------------------------------------------------------------------------
# Noise proxies (SPEC §7.1) and sigma(M)
# --------------------------------------------------------------------------------------------


def els_noise_std(noise_multiplier: float, batch_size: float, grad_norm: float = 1.0) -> float:
    """Per-coordinate std of ELS's noise in the averaged gradient with C = L: sigma_ELS * L / B."""
    return float(noise_multiplier * grad_norm / batch_size)


def uls_noise_std(noise_multiplier: float, cohort_size: float, user_grad_norm: float = 1.0) -> float:
    """Per-coordinate std of ULS's noise with C = L_G: sigma_ULS * L_G / M (= sigma L_G G / B)."""
    return float(noise_multiplier * user_grad_norm / cohort_size)


def variance_ratio(
    group_size_uls: float, l_g: float, sigma_uls: float, sigma_els: float, l: float = 1.0
) -> float:
    """SPEC §7.1 eq. (7): Var_ULS / Var_ELS = (G_ULS * L_G * sigma_ULS / (L * sigma_ELS))**2."""
    return float((group_size_uls * l_g * sigma_uls / (l * sigma_els)) ** 2)


def uls_sigma_of_m(
    num_users: int, steps: int, epsilon: float, delta: float, accountant: str = "pld"
) -> Callable[[int], float]:
    """sigma(M): the ULS noise multiplier for q = M/N at fixed (epsilon, delta, T), cached."""
    from userdp import accounting

    @functools.lru_cache(maxsize=None)
    def sigma(m: int) -> float:
        q = min(1.0, m / num_users)
        return float(accounting.calibrate_noise_multiplier(
            lambda s: accounting.uls_step_event(s, q), steps, epsilon, delta, accountant=accountant))

    return sigma


def els_noise_multiplier(
    sampling_rate: float, group_size: int, steps: int, epsilon: float, delta: float,
    accountant: str = "pld",
) -> float:
    from userdp import accounting

    return float(accounting.calibrate_noise_multiplier(
        lambda s: accounting.els_step_event(s, sampling_rate, group_size), steps, epsilon, delta,
        accountant=accountant))
