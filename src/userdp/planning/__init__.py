"""Planning: the heuristics that choose the group size, cohort size and noise for a compute budget (docs/plan.md).

* ELS: ``G = median records per user`` (Charles et al. 2024, §6, App. E), computed on the per-user *counts* (one value
  per user, not one per record), optionally with an epsilon-DP median (exponential mechanism over
  a public log-spaced grid) whose epsilon the result states so the privacy report can count it.
* ULS: Estimate-and-Double (Charles et al. 2024, App. F, Algorithm 3): starting from small powers of two, double
  the cohort size M or the group size G, whichever shrinks the noise proxy sigma(M)*L(G)/M more,
  until M*G reaches the budget B; ties go to M; M never exceeds the number of users N.
  ``sigma_of_m`` and ``l_of_g`` are injected callables, so the loop is testable with a synthetic
  L(G) = L/sqrt(G).
* The noise-standard-deviation proxies of Charles et al. 2024, §3, App. B: ELS sigma_ELS*L/B, ULS sigma_ULS*L(G)/M
  (per-coordinate std of the noise in the averaged gradient, with C set to the gradient bound).

``plan_for_training(data, model, loss_fn, ...)`` puts them together; it is what ``userdp plan``
and a training config with ``plan: auto`` call.

Non-private data touches: the exact median (without ``dp_median_epsilon``), the users sampled to
estimate L(G) and their gradient norms are computed from the private data without noise. The plan
says so in ``data_touches``.

Modules: :mod:`~userdp.planning.group_size` (ELS), :mod:`~userdp.planning.estimate_and_double` (ULS),
:mod:`~userdp.planning.noise` (proxies), :mod:`~userdp.planning.gradient_norms` (L(G)) and
:mod:`~userdp.planning.budget_plan` (the budget plan: ``plan_for_training``, ``BudgetPlan``) and
:mod:`~userdp.planning.bands` (b of banded matrix-factorization noise for the ULS plan).
"""

from userdp.planning.bands import choose_bands, prefix_noise
from userdp.planning.budget_plan import (
    DATA_TOUCH_NOTE,
    BudgetPlan,
    PlanBudget,
    Sigmas,
    explain,
    format_plan,
    plan_for_budget,
    plan_for_training,
)
from userdp.planning.estimate_and_double import Doubling, EstimateAndDoubleResult, estimate_and_double
from userdp.planning.gradient_norms import GradientNormEstimator, NormSample
from userdp.planning.group_size import GroupSizeChoice, dp_median, dp_median_probabilities, els_group_size, log_grid
from userdp.planning.noise import (
    els_noise_multiplier,
    els_noise_std,
    uls_noise_multiplier,
    uls_noise_std,
    uls_sigma_of_m,
    variance_ratio,
)

__all__ = [
    "BudgetPlan",
    "choose_bands",
    "prefix_noise",
    "PlanBudget",
    "NormSample",
    "Sigmas",
    "DATA_TOUCH_NOTE",
    "Doubling",
    "EstimateAndDoubleResult",
    "GradientNormEstimator",
    "GroupSizeChoice",
    "dp_median",
    "dp_median_probabilities",
    "els_group_size",
    "els_noise_multiplier",
    "els_noise_std",
    "estimate_and_double",
    "explain",
    "format_plan",
    "log_grid",
    "plan_for_budget",
    "plan_for_training",
    "uls_noise_multiplier",
    "uls_noise_std",
    "uls_sigma_of_m",
    "variance_ratio",
]
