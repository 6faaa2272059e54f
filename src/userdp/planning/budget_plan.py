"""The budget plan (``userdp plan``, ``plan: auto``): ELS's and ULS's group size, cohort size and
sigma for a compute budget, and the recommendation between them. Not to be confused with the
engine's run plan (:class:`userdp.engine.plan.RunPlan`: how one run executes and is accounted)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from userdp import accounting
from userdp.errors import UserError
from userdp.planning.estimate_and_double import estimate_and_double
from userdp.planning.gradient_norms import GradientNormEstimator, NormSample
from userdp.planning.group_size import els_group_size, per_user_counts
from userdp.planning.noise import (
    els_noise_multiplier,
    els_noise_std,
    uls_noise_multiplier,
    uls_noise_std,
    uls_sigma_of_m,
)

DATA_TOUCH_NOTE = (
    "non-private data touches: the per-user record counts (for the ELS median{median}), the "
    "{k} users sampled to estimate L(G) and their gradient norms at the pretrained model were "
    "computed from the private data without noise; the plan is therefore not covered by the "
    "training run's (epsilon, delta) guarantee (docs/plan.md), and the privacy report must say so"
)


@dataclass(frozen=True)
class BudgetPlan:
    els: dict
    uls: dict
    recommended: str  # "els" or "uls"
    data_touches: str
    inputs: dict
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {
            "els": self.els,
            "uls": self.uls,
            "recommended": self.recommended,
            "data_touches": self.data_touches,
            "inputs": self.inputs,
            "notes": list(self.notes),
        }

    def training_overrides(self, algorithm: str | None = None) -> dict:
        """Dotted keys of the LM run config that apply the plan (``plan: auto``)."""
        algo = algorithm or self.recommended
        if algo == "els":
            return {
                "training.algorithm": "els",
                "training.group_size": self.els["group_size"],
                "training.cohort_size": self.els["expected_batch_size"],
            }
        return {
            "training.algorithm": "uls",
            "training.group_size": self.uls["group_size"],
            "training.cohort_size": self.uls["cohort_size"],
        }


@dataclass(frozen=True)
class PlanBudget:
    """What a budget plan is for: ``compute_budget`` (B) gradients a step, ``steps`` (T), the
    target (``epsilon``, ``delta``; None: N^-1.1), the accountant, and ``dp_median_epsilon``: ELS's
    median group size released with that epsilon (None: the median of the counts, a touch disclosed).

    Raises:
        UserError: B or T below 1, or epsilon not above 0."""

    compute_budget: int
    epsilon: float
    steps: int
    delta: float | None = None
    accountant: str = "pld"
    dp_median_epsilon: float | None = None

    def __post_init__(self):
        if self.compute_budget < 1:
            raise UserError(f"--compute-budget must be >= 1, got {self.compute_budget}")
        if not self.epsilon > 0:
            raise UserError(f"--epsilon must be > 0, got {self.epsilon}")
        if self.steps < 1:
            raise UserError(f"--steps must be >= 1, got {self.steps}")


@dataclass(frozen=True)
class Sigmas:
    """The noise multipliers a plan compares, injectable: ``of_m(M)`` for ULS with an expected
    cohort M, ``els(p, G)`` for ELS at rate p with G records a user (None: calibrated)."""

    of_m: Callable[[int], float] | None = None
    els: Callable[[float, int], float] | None = None


def _largest_power_of_two_at_most(x: int) -> int:
    return 1 << (int(x).bit_length() - 1)


def plan_for_budget(
    sizes: np.ndarray,
    budget: PlanBudget,
    l_of_g: Callable[[int], float],
    *,
    sigmas: Sigmas | None = None,
    sample_users: int | None = None,
    rng: np.random.Generator | None = None,
) -> BudgetPlan:
    """The plan from per-user counts and an L(G) (injectable, like sigma(M) and sigma_ELS: ``sigmas``).
    ``sample_users``: how many users L(G) was estimated on (for the data-touch note)."""
    compute_budget, epsilon, steps, delta = budget.compute_budget, budget.epsilon, budget.steps, budget.delta
    accountant, dp_median_epsilon = budget.accountant, budget.dp_median_epsilon
    sigmas = sigmas or Sigmas()
    sigma_of_m, els_sigma = sigmas.of_m, sigmas.els
    counts = per_user_counts(sizes)
    n = int(counts.size)
    notes = []
    if delta is None:
        delta, rule = accounting.default_delta(n)
    else:
        rule = "delta given"
    if sigma_of_m is None:
        sigma_of_m = uls_sigma_of_m(n, steps, epsilon, delta, accountant)
    if els_sigma is None:

        def els_sigma(p: float, g: int) -> float:
            return els_noise_multiplier(p, g, steps, epsilon, delta, accountant)

    # ELS
    choice = els_group_size(counts, dp_median_epsilon=dp_median_epsilon, rng=rng)
    g_els = choice.group_size
    dprime = int(np.minimum(counts, g_els).sum())
    batch = float(min(compute_budget, dprime))
    if compute_budget > dprime:
        notes.append(
            f"the compute budget {compute_budget} exceeds the ELS dataset |D'| = {dprime}: "
            "ELS samples every record (p = 1)"
        )
    p = batch / dprime
    s_els = float(els_sigma(p, g_els))
    l1 = float(l_of_g(1))
    els = {
        "group_size": g_els,
        "group_size_method": choice.method,
        "dp_median_epsilon": choice.epsilon_spent,
        "dataset_size": dprime,
        "expected_batch_size": batch,
        "sampling_rate": p,
        "noise_multiplier": s_els,
        "gradient_norm": l1,
        "noise_std_proxy": els_noise_std(s_els, batch, l1),
    }

    # ULS (Estimate-and-Double on the largest power of two <= B)
    b2 = _largest_power_of_two_at_most(compute_budget)
    if b2 != compute_budget:
        notes.append(
            f"Estimate-and-Double runs on powers of two: B = {b2} (largest power of two "
            f"<= {compute_budget}); the cohort then uses the whole budget, M = B/G"
        )
    ed = estimate_and_double(b2, n, sigma_of_m, l_of_g)
    g_uls = ed.group_size
    m = float(min(n, compute_budget / g_uls))
    q = m / n
    if float(m).is_integer():
        s_uls = float(sigma_of_m(int(m)))
    else:  # a fractional expected cohort: calibrate at q = M/N exactly
        s_uls = uls_noise_multiplier(q, steps, epsilon, delta, accountant)
    lg = float(l_of_g(g_uls))
    uls = {
        "group_size": g_uls,
        "cohort_size": m,
        "sampling_rate": q,
        "noise_multiplier": s_uls,
        "gradient_norm": lg,
        "noise_std_proxy": uls_noise_std(s_uls, m, lg),
        "estimate_and_double": ed.to_dict(),
    }
    rec = "uls" if uls["noise_std_proxy"] <= els["noise_std_proxy"] else "els"
    touches = DATA_TOUCH_NOTE.format(
        median=""
        if dp_median_epsilon is None
        else f"; here released with epsilon={dp_median_epsilon:g}-DP, which a run planned with it spends through "
        "its ledger, within its budget",
        k=sample_users if sample_users is not None else "sampled",
    )
    inputs = {
        "compute_budget": int(compute_budget),
        "epsilon": float(epsilon),
        "delta": float(delta),
        "delta_rule": rule,
        "steps": int(steps),
        "num_users": n,
        "accountant": accountant,
        "l_of_g_sample_users": sample_users,
    }
    return BudgetPlan(els, uls, rec, touches, inputs, tuple(notes))


def plan_for_training(
    data, model, loss_fn, budget: PlanBudget, sample: NormSample | None = None, log=None
) -> BudgetPlan:
    """What ``userdp plan`` and a config with ``plan: auto`` call.

    ``data`` is the resolved training :class:`userdp.engine.user_data.UserData` (the users that will
    train; held-out users excluded), ``model`` the pretrained model in train mode (as it will be
    trained, e.g. with LoRA applied), ``loss_fn`` the engine's per-record loss, ``sample`` the users
    L(G) is estimated on (default ``NormSample()``: 128 users). Returns a :class:`BudgetPlan`;
    ``plan.training_overrides()`` gives the config keys that apply it.
    """
    sample = sample or NormSample()
    rng = np.random.default_rng(sample.seed)
    est = GradientNormEstimator(model, data, loss_fn, sample, rng=rng, log=log)
    return plan_for_budget(data.sizes(), budget, est, sample_users=len(est.users), rng=rng)


def format_plan(plan: BudgetPlan) -> str:
    e, u, i = plan.els, plan.uls, plan.inputs
    lines = [
        f"plan for B = {i['compute_budget']} gradients/step, T = {i['steps']} steps, "
        f"epsilon = {i['epsilon']:g}, delta = {i['delta']:.3g} ({i['delta_rule']}), "
        f"N = {i['num_users']} users",
        "",
        f"  ELS  group_size         {e['group_size']}  ({e['group_size_method']} records per user)",
        f"       batch_size         {e['expected_batch_size']:g}  (expected records per step, of |D'| = "
        f"{e['dataset_size']})",
        f"       sampling_rate      {e['sampling_rate']:.6g}",
        f"       noise_multiplier   {e['noise_multiplier']:.4g}",
        f"       noise std proxy    {e['noise_std_proxy']:.4g}  (sigma * L(1) / B, L(1) = {e['gradient_norm']:.4g})",
        "",
        f"  ULS  group_size         {u['group_size']}",
        f"       cohort_size        {u['cohort_size']:g}  (expected users per step)",
        f"       sampling_rate      {u['sampling_rate']:.6g}",
        f"       noise_multiplier   {u['noise_multiplier']:.4g}",
        f"       noise std proxy    {u['noise_std_proxy']:.4g}  (sigma * L(G) / M, L(G) = {u['gradient_norm']:.4g})",
        "       Estimate-and-Double: "
        + " ".join(
            f"({d['cohort_size']},{d['group_size']})->{d['doubled']}" for d in u["estimate_and_double"]["trace"]
        ),
        "",
        f"  recommended: {plan.recommended.upper()} (lower noise std proxy, docs/plan.md)",
    ]
    lines += ["", "  what this means for the data:"] + [f"    {x}" for x in explain(plan)]
    for note in plan.notes:
        lines.append(f"  note: {note}")
    lines.append(f"  {plan.data_touches}")
    return "\n".join(lines)


def explain(plan: BudgetPlan) -> list[str]:
    """What the recommended choice does to the data, in words: who is seen how often."""
    i, t = plan.inputs, int(plan.inputs["steps"])
    if plan.recommended == "uls":
        u = plan.uls
        g, q = int(u["group_size"]), float(u["sampling_rate"])
        per = "one record" if g == 1 else f"up to {g} of their records (drawn afresh each step)"
        return [
            f"ULS: each step samples each of the {i['num_users']:,} users with probability q = {q:.3g} "
            f"(about {u['cohort_size']:g} users a step); a sampled user contributes {per}, averaged and "
            "clipped as one update.",
            f"a user with n > {g} records has each record in a step they are sampled with probability {g}/n, "
            f"so the heaviest users' records are mostly unseen in any one step; over {t} steps a user is "
            f"sampled about {t * q:.2g} times.",
        ]
    e = plan.els
    g, p = int(e["group_size"]), float(e["sampling_rate"])
    return [
        f"ELS: each user keeps at most G = {g} records (D' holds {e['dataset_size']:,} records); records beyond "
        f"G are never used, so the heaviest users are capped at {g}.",
        f"each step samples each kept record with probability p = {p:.3g} (about {e['expected_batch_size']:g} "
        f"records a step) and clips it alone; over {t} steps a record is used about {t * p:.2g} times.",
    ]
