"""ULS cohort and group size: Estimate-and-Double (Charles et al. 2024, App. F, Algorithm 3)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from userdp.errors import UserError


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
    """Charles et al. 2024, App. F Algorithm 3. ``budget``, ``m0`` and ``g0`` are powers of two with m0*g0 <= budget.

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
        r_m = sigma(2 * m) / (2.0 * sigma(m)) if 2 * m <= num_users else math.inf
        doubled = "M" if r_m <= r_g else "G"
        trace.append(Doubling(m, g, float(r_m), float(r_g), doubled))
        if doubled == "M":
            m *= 2
        else:
            g *= 2
    return EstimateAndDoubleResult(m, g, float(sigma(m) * ell(g) / m), tuple(trace))
