"""ELS group size G: the median records per user (Charles et al. 2024, §6, App. E), optionally an
epsilon-DP median (exponential mechanism over a public log-spaced grid)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from userdp.errors import UserError


def per_user_counts(sizes: Sequence[int] | np.ndarray) -> np.ndarray:
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


def dp_median_probabilities(counts: np.ndarray, epsilon: float, grid: np.ndarray) -> np.ndarray:
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
    counts = per_user_counts(counts)
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
    """G_ELS = median records per user, computed on per-user counts (Charles et al. 2024, §6, App. E).

    With ``dp_median_epsilon`` the median is released by an epsilon-DP exponential mechanism
    over a public log-spaced grid in [1, dp_median_upper]; the result's ``epsilon_spent`` must
    be added to the training budget by the privacy report (basic composition).
    """
    counts = per_user_counts(sizes)
    if dp_median_epsilon is None:
        g = max(1, int(math.ceil(float(np.median(counts)))))
        return GroupSizeChoice(
            g,
            "median",
            0.0,
            int(counts.size),
            f"median of {counts.size} per-user record counts, computed without DP (a non-private touch of the data)",
        )
    g = dp_median(counts, dp_median_epsilon, upper=dp_median_upper, rng=rng)
    return GroupSizeChoice(
        g,
        "dp_median",
        float(dp_median_epsilon),
        int(counts.size),
        f"median of {counts.size} per-user record counts released with an "
        f"epsilon={dp_median_epsilon:g}-DP exponential mechanism over a public log grid "
        f"[1, {dp_median_upper}]; add this epsilon to the training budget",
    )
