"""Heuristics that choose the group size, cohort size and noise for a compute budget (docs/plan.md).

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
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

from userdp.errors import UserError

# --------------------------------------------------------------------------------------------
# ELS group size (Charles et al. 2024, §6, App. E)
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
    """G_ELS = median records per user, computed on per-user counts (Charles et al. 2024, §6, App. E).

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
# Estimate-and-Double (Charles et al. 2024, App. F, Algorithm 3)
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
# Noise proxies (Charles et al. 2024, §3, App. B) and sigma(M)
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
    """Charles et al. 2024, §3, App. B eq. (7): Var_ULS / Var_ELS = (G_ULS * L_G * sigma_ULS / (L * sigma_ELS))**2."""
    return float((group_size_uls * l_g * sigma_uls / (l * sigma_els)) ** 2)


def uls_sigma_of_m(
    num_users: int, steps: int, epsilon: float, delta: float, accountant: str = "pld"
) -> Callable[[int], float]:
    """sigma(M): the ULS noise multiplier for q = M/N at fixed (epsilon, delta, T), cached."""
    @functools.lru_cache(maxsize=None)
    def sigma(m: int) -> float:
        return uls_noise_multiplier(min(1.0, m / num_users), steps, epsilon, delta, accountant)

    return sigma


def els_noise_multiplier(
    sampling_rate: float, group_size: int, steps: int, epsilon: float, delta: float,
    accountant: str = "pld",
) -> float:
    """The calibrated ELS noise multiplier at record rate p and group size G."""
    from userdp import accounting

    return float(accounting.Mechanism("els", 1.0, steps, sampling_rate=sampling_rate, group_size=group_size)
                 .calibrated(epsilon, delta, accountant).noise_multiplier)


def uls_noise_multiplier(sampling_rate: float, steps: int, epsilon: float, delta: float,
                         accountant: str = "pld") -> float:
    """The calibrated ULS (and DP-FedAvg) noise multiplier at user rate q."""
    from userdp import accounting

    return float(accounting.Mechanism("uls", 1.0, steps, sampling_rate=sampling_rate)
                 .calibrated(epsilon, delta, accountant).noise_multiplier)


# --------------------------------------------------------------------------------------------
# L(G): median norm of users' mean gradients at the pretrained model (Charles et al. 2024, App. F)
# --------------------------------------------------------------------------------------------


class GradientNormEstimator:
    """``L(G)`` = median over a fixed sample of users of ||mean gradient over up to G of the
    user's records|| at the model's current (pretrained) parameters.

    Uses the engine's vectorized per-unit code (:class:`userdp.engine.per_unit.PerUnit`:
    functional_call + grad + vmap over users, in chunks) — no Python loop over users' gradients.
    The users are sampled once (uniformly without replacement, ``num_users`` of them, default
    128); each L(G) draws up to G records per user afresh via ``data.draw_records``. Calls are
    cached by G. This is a NON-PRIVATE touch of the data.
    """

    def __init__(self, model, data, loss_fn, *, num_users: int = 128, chunk_size: int = 16,
                 rng: np.random.Generator | None = None, log=None):
        from userdp.engine.algorithms import ULS
        from userdp.engine.per_unit import PerUnit

        if num_users < 1:
            raise UserError(f"the number of users sampled for L(G) must be >= 1, got {num_users}")
        self.rng = rng if rng is not None else np.random.default_rng()
        n = int(data.num_users)
        self.users = np.sort(self.rng.choice(n, size=min(num_users, n), replace=False))
        self.model, self.data, self.loss_fn = model, data, loss_fn
        self.chunk_size = int(chunk_size)
        self._per_unit = PerUnit(model, loss_fn, ULS(group_size=1, sampling_rate=1.0))
        self._cache: dict[int, float] = {}
        self.norms: dict[int, np.ndarray] = {}
        self.log = log  # optional progress: one line per group size evaluated

    def user_norms(self, group_size: int) -> np.ndarray:

        out = []
        for lo in range(0, len(self.users), self.chunk_size):
            users = self.users[lo: lo + self.chunk_size]
            batch, mask = self.data.draw_records(users, int(group_size), self.rng)
            updates, _ = self._per_unit(batch, mask)
            sq = sum(u.reshape(u.shape[0], -1).double().pow(2).sum(1) for u in updates)
            out.append(sq.sqrt().detach().cpu().numpy())
        return np.concatenate(out)

    def __call__(self, group_size: int) -> float:
        g = int(group_size)
        if g not in self._cache:
            t0 = time.perf_counter()
            norms = self.user_norms(g)
            self.norms[g] = norms
            self._cache[g] = float(np.median(norms))
            if self.log is not None:
                self.log(f"  L(G = {g}): median gradient norm {self._cache[g]:.4g} over {len(self.users)} sampled "
                         f"users ({time.perf_counter() - t0:.1f} s)")
        return self._cache[g]


# --------------------------------------------------------------------------------------------
# The plan (`userdp plan`, `plan: auto`)
# --------------------------------------------------------------------------------------------

DATA_TOUCH_NOTE = (
    "non-private data touches: the per-user record counts (for the ELS median{median}), the "
    "{k} users sampled to estimate L(G) and their gradient norms at the pretrained model were "
    "computed from the private data without noise; the plan is therefore not covered by the "
    "training run's (epsilon, delta) guarantee (docs/plan.md), and the privacy report must say so")


@dataclass(frozen=True)
class Plan:
    els: dict
    uls: dict
    recommended: str  # "els" or "uls"
    data_touches: str
    inputs: dict
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"els": self.els, "uls": self.uls, "recommended": self.recommended,
                "data_touches": self.data_touches, "inputs": self.inputs, "notes": list(self.notes)}

    def training_overrides(self, algorithm: str | None = None) -> dict:
        """Dotted keys of the LM run config that apply the plan (``plan: auto``)."""
        algo = algorithm or self.recommended
        if algo == "els":
            return {"training.algorithm": "els", "training.group_size": self.els["group_size"],
                    "training.cohort_size": self.els["expected_batch_size"]}
        return {"training.algorithm": "uls", "training.group_size": self.uls["group_size"],
                "training.cohort_size": self.uls["cohort_size"]}


def _largest_power_of_two_at_most(x: int) -> int:
    return 1 << (int(x).bit_length() - 1)


def make_plan(
    sizes: np.ndarray,
    *,
    compute_budget: int,
    epsilon: float,
    steps: int,
    l_of_g: Callable[[int], float],
    delta: float | None = None,
    sigma_of_m: Callable[[int], float] | None = None,
    els_sigma: Callable[[float, int], float] | None = None,
    dp_median_epsilon: float | None = None,
    m0: int = 1,
    g0: int = 1,
    accountant: str = "pld",
    sample_users: int | None = None,
    rng: np.random.Generator | None = None,
) -> Plan:
    """The plan from per-user counts and an L(G) (injectable, like sigma(M) and sigma_ELS)."""
    from userdp import accounting

    counts = _per_user_counts(sizes)
    n = int(counts.size)
    if compute_budget < 1:
        raise UserError(f"--compute-budget must be >= 1, got {compute_budget}")
    if not epsilon > 0:
        raise UserError(f"--epsilon must be > 0, got {epsilon}")
    if steps < 1:
        raise UserError(f"--steps must be >= 1, got {steps}")
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
        notes.append(f"the compute budget {compute_budget} exceeds the ELS dataset |D'| = {dprime}: "
                     "ELS samples every record (p = 1)")
    p = batch / dprime
    s_els = float(els_sigma(p, g_els))
    l1 = float(l_of_g(1))
    els = {"group_size": g_els, "group_size_method": choice.method,
           "dp_median_epsilon": choice.epsilon_spent, "dataset_size": dprime,
           "expected_batch_size": batch, "sampling_rate": p, "noise_multiplier": s_els,
           "gradient_norm": l1, "noise_std_proxy": els_noise_std(s_els, batch, l1)}

    # ULS (Estimate-and-Double on the largest power of two <= B)
    b2 = _largest_power_of_two_at_most(compute_budget)
    if b2 != compute_budget:
        notes.append(f"Estimate-and-Double runs on powers of two: B = {b2} (largest power of two "
                     f"<= {compute_budget}); the cohort then uses the whole budget, M = B/G")
    m0 = min(m0, _largest_power_of_two_at_most(n))
    g0 = min(g0, max(1, b2 // m0))
    ed = estimate_and_double(b2, n, sigma_of_m, l_of_g, m0=m0, g0=g0)
    g_uls = ed.group_size
    m = float(min(n, compute_budget / g_uls))
    q = m / n
    if float(m).is_integer():
        s_uls = float(sigma_of_m(int(m)))
    else:  # a fractional expected cohort: calibrate at q = M/N exactly
        s_uls = uls_noise_multiplier(q, steps, epsilon, delta, accountant)
    lg = float(l_of_g(g_uls))
    uls = {"group_size": g_uls, "cohort_size": m, "sampling_rate": q, "noise_multiplier": s_uls,
           "gradient_norm": lg, "noise_std_proxy": uls_noise_std(s_uls, m, lg),
           "estimate_and_double": ed.to_dict()}
    rec = "uls" if uls["noise_std_proxy"] <= els["noise_std_proxy"] else "els"
    touches = DATA_TOUCH_NOTE.format(
        median="" if dp_median_epsilon is None else
        f"; here released with epsilon={dp_median_epsilon:g}-DP, which the report adds to the budget",
        k=sample_users if sample_users is not None else "sampled")
    inputs = {"compute_budget": int(compute_budget), "epsilon": float(epsilon), "delta": float(delta),
              "delta_rule": rule, "steps": int(steps), "num_users": n, "accountant": accountant,
              "l_of_g_sample_users": sample_users}
    return Plan(els, uls, rec, touches, inputs, tuple(notes))


def plan_for_training(
    data,
    model,
    loss_fn,
    *,
    compute_budget: int,
    epsilon: float,
    steps: int,
    delta: float | None = None,
    sample_users: int = 128,
    dp_median_epsilon: float | None = None,
    accountant: str = "pld",
    seed: int | None = None,
    chunk_size: int = 16,
    log=None,
) -> Plan:
    """What ``userdp plan`` and a config with ``plan: auto`` call.

    ``data`` is the resolved training :class:`userdp.engine.data.UserData` (the users that will
    train; held-out users excluded), ``model`` the pretrained model in train mode (as it will be
    trained, e.g. with LoRA applied), ``loss_fn`` the engine's per-record loss. Returns a
    :class:`Plan`; ``plan.training_overrides()`` gives the config keys that apply it.
    """
    rng = np.random.default_rng(seed)
    est = GradientNormEstimator(model, data, loss_fn, num_users=sample_users, chunk_size=chunk_size,
                                rng=rng, log=log)
    return make_plan(data.sizes(), compute_budget=compute_budget, epsilon=epsilon, steps=steps,
                     l_of_g=est, delta=delta, dp_median_epsilon=dp_median_epsilon,
                     accountant=accountant, sample_users=len(est.users), rng=rng)


def format_plan(plan: Plan) -> str:
    e, u, i = plan.els, plan.uls, plan.inputs
    lines = [
        f"plan for B = {i['compute_budget']} gradients/step, T = {i['steps']} steps, "
        f"epsilon = {i['epsilon']:g}, delta = {i['delta']:.3g} ({i['delta_rule']}), "
        f"N = {i['num_users']} users",
        "",
        f"  ELS  group_size         {e['group_size']}  ({e['group_size_method']} records per user)",
        f"       batch_size         {e['expected_batch_size']:g}  (expected records per step, of |D'| = {e['dataset_size']})",
        f"       sampling_rate      {e['sampling_rate']:.6g}",
        f"       noise_multiplier   {e['noise_multiplier']:.4g}",
        f"       noise std proxy    {e['noise_std_proxy']:.4g}  (sigma * L(1) / B, L(1) = {e['gradient_norm']:.4g})",
        "",
        f"  ULS  group_size         {u['group_size']}",
        f"       cohort_size        {u['cohort_size']:g}  (expected users per step)",
        f"       sampling_rate      {u['sampling_rate']:.6g}",
        f"       noise_multiplier   {u['noise_multiplier']:.4g}",
        f"       noise std proxy    {u['noise_std_proxy']:.4g}  (sigma * L(G) / M, L(G) = {u['gradient_norm']:.4g})",
        "       Estimate-and-Double: " + " ".join(
            f"({d['cohort_size']},{d['group_size']})->{d['doubled']}" for d in u["estimate_and_double"]["trace"]),
        "",
        f"  recommended: {plan.recommended.upper()} (lower noise std proxy, docs/plan.md)",
    ]
    lines += ["", "  what this means for the data:"] + [f"    {x}" for x in explain(plan)]
    for note in plan.notes:
        lines.append(f"  note: {note}")
    lines.append(f"  {plan.data_touches}")
    return "\n".join(lines)


def explain(plan: Plan) -> list[str]:
    """What the recommended choice does to the data, in words (issue 28): who is seen how often."""
    i, t = plan.inputs, int(plan.inputs["steps"])
    if plan.recommended == "uls":
        u = plan.uls
        g, q = int(u["group_size"]), float(u["sampling_rate"])
        per = "one record" if g == 1 else f"up to {g} of their records (drawn afresh each step)"
        return [f"ULS: each step samples each of the {i['num_users']:,} users with probability q = {q:.3g} "
                f"(about {u['cohort_size']:g} users a step); a sampled user contributes {per}, averaged and "
                "clipped as one update.",
                f"a user with n > {g} records has each record in a step they are sampled with probability {g}/n, "
                f"so the heaviest users' records are mostly unseen in any one step; over {t} steps a user is "
                f"sampled about {t * q:.2g} times."]
    e = plan.els
    g, p = int(e["group_size"]), float(e["sampling_rate"])
    return [f"ELS: each user keeps at most G = {g} records (D' holds {e['dataset_size']:,} records); records beyond "
            f"G are never used, so the heaviest users are capped at {g}.",
            f"each step samples each kept record with probability p = {p:.3g} (about {e['expected_batch_size']:g} "
            f"records a step) and clips it alone; over {t} steps a record is used about {t * p:.2g} times."]
