"""The guarantee of a tuning run: per-trial RDP curves -> private selection -> (eps, delta).

Trials may differ in what changes the mechanism (algorithm, G, cohort, steps). Random search
draws each trial's hyperparameters independently of the data, so a trial is a mixture of the
candidates' mechanisms, and the Rényi divergence of a mixture is at most the largest of its
components' (quasi-convexity): the trial's RDP curve is the pointwise maximum of the candidates'.

:func:`calibrate` finds one per-trial target epsilon tau (each distinct mechanism gets the
smallest sigma meeting tau alone, by userdp's PLD calibration) such that the selection's total
meets the tuning budget E; the final model alone then has epsilon <= tau.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from userdp.accounting.private_selection import ORDERS, total_epsilon
from userdp.accounting.rdp import step_rdp
from userdp.accounting.selection import TrialCount, epsilon_from_rdp, selection_rdp
from userdp.errors import UserError


def run_rdp(plan) -> np.ndarray:
    """RDP curve (on :data:`ORDERS`) of one training run: steps x the step event's RDP."""
    return plan.compositions(plan.config.steps) * step_rdp(plan.step_event, ORDERS)


def floor_epsilon(count: TrialCount, delta: float) -> float:
    """The total epsilon of tuning with infinitely noisy trials: what the selection alone costs."""
    return epsilon_from_rdp(ORDERS, selection_rdp(ORDERS, np.zeros_like(ORDERS), count), delta)


@dataclass(frozen=True)
class Calibration:
    """Per-trial target ``tau``, the plans (one per distinct mechanism, calibrated to tau) and the
    total epsilon of tuning + the released model."""

    tau: float
    plans: dict
    epsilon_total: float
    epsilon_trial: dict  # each mechanism's own epsilon at its sigma (the final model alone)


def calibrate(
    make_plan_at: Callable[[str, float], object],
    keys: Sequence[str],
    count: TrialCount,
    delta: float,
    epsilon: float,
    iterations: int = 14,
) -> Calibration:
    """The largest per-trial target tau whose selection total is <= ``epsilon``.

    Args:
        make_plan_at: (mechanism key, tau) -> the RunPlan calibrated to tau.
        keys: the distinct mechanisms of the search space.
        count: the trial-count distribution.
        delta: the tuning guarantee's delta.
        epsilon: the budget E for tuning + the released model.

    Raises:
        UserError: E cannot cover the selection's own cost, or even a per-trial target of
            E/100 overshoots it.
    """
    floor = floor_epsilon(count, delta)
    if floor >= epsilon:
        raise UserError(
            f"--epsilon {epsilon:g} cannot cover tuning: drawing the number of trials "
            f"({count.kind}, mean {count.mean():.3g}) costs epsilon >= {floor:.3g} at delta {delta:.3g} "
            "even with infinitely noisy trials; raise --epsilon or lower --mean-trials"
        )

    def at(tau):
        plans = {k: make_plan_at(k, tau) for k in keys}
        return plans, total_epsilon([run_rdp(p) for p in plans.values()], count, delta)

    lo, hi = epsilon / 100, epsilon
    plans_lo, tot_lo = at(lo)
    if tot_lo > epsilon:
        raise UserError(
            f"--epsilon {epsilon:g} cannot cover the per-trial minimum: even trials at epsilon "
            f"{lo:.3g} each give {tot_lo:.3g} in total with {count.kind} trials of mean "
            f"{count.mean():.3g}; raise --epsilon or lower --mean-trials"
        )
    best = (lo, plans_lo, tot_lo)
    for _ in range(iterations):
        mid = (lo * hi) ** 0.5
        plans, tot = at(mid)
        if tot <= epsilon:
            lo, best = mid, (mid, plans, tot)
        else:
            hi = mid
    tau, plans, tot = best
    eps_trial = {k: float(p.mechanism.epsilon(p.delta, p.accountant)) for k, p in plans.items()}
    return Calibration(tau, plans, tot, eps_trial)
