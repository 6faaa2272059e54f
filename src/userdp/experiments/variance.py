"""ELS versus ULS noise variance under a fixed compute budget (Charles et al. 2024, §3, App. B; [Charles et al.
2024] Fig 2 and App B).

Setting: N users with G_max records each, a budget of B gradients per step, T steps, (eps, delta).
ELS samples records at p = B/(N G_ELS); ULS samples users at q = M/N with G_ULS = B/M. With C set
to the gradient bound (L for ELS, L_G for ULS) clipping is a no-op and

    Var_ULS / Var_ELS = (G_ULS * L_G * sigma_ULS / (L * sigma_ELS))**2          (eq. 7)

evaluated here for L = 1 and two regimes: L_G = 1 (identical gradients within a user) and
L_G = 1/sqrt(G_ULS) (orthogonal gradients). Every parameter the paper lost is an argument.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from userdp.errors import UserError
from userdp.planning import els_noise_multiplier, uls_sigma_of_m, variance_ratio


@dataclass(frozen=True)
class VarianceConfig:
    num_users: int = 10_000
    max_group_size: int = 64  # G_max: records each user holds
    els_group_size: int = 16  # G_ELS (its choice barely matters, Charles et al. 2024, §3, App. B)
    compute_budget: int = 1024  # B gradients per step
    steps: int = 1000
    delta: float = 1e-6
    epsilons: tuple[float, ...] = (1.0, 2.0, 4.0, 8.0, 16.0)
    cohort_sizes: tuple[int, ...] | None = None  # default: powers of 2 from B/G_max to min(B, N)
    accountant: str = "pld"

    def resolved_cohort_sizes(self) -> list[int]:
        if self.cohort_sizes is not None:
            ms = sorted(set(int(m) for m in self.cohort_sizes))
        else:
            lo = max(1, math.ceil(self.compute_budget / self.max_group_size))
            hi = min(self.compute_budget, self.num_users)
            ms, m = [], 1
            while m <= hi:
                if m >= lo:
                    ms.append(m)
                m *= 2
        return ms

    def validate(self) -> None:
        if self.num_users < 1 or self.max_group_size < 1 or self.compute_budget < 1 or self.steps < 1:
            raise UserError("--users, --max-group-size, --compute-budget and --steps must be >= 1")
        if not 1 <= self.els_group_size <= self.max_group_size:
            raise UserError(
                f"--els-group-size must be in [1, --max-group-size={self.max_group_size}], got {self.els_group_size}"
            )
        if self.compute_budget > self.num_users * self.els_group_size:
            raise UserError(
                f"--compute-budget {self.compute_budget} exceeds the ELS dataset size "
                f"N*G_ELS = {self.num_users * self.els_group_size} (sampling rate would exceed 1)"
            )
        if not 0 < self.delta < 1:
            raise UserError(f"--delta must be in (0, 1), got {self.delta}")
        if not self.epsilons or any(not e > 0 for e in self.epsilons):
            raise UserError("--epsilons must be positive numbers")
        for m in self.resolved_cohort_sizes():
            if not 1 <= m <= self.num_users:
                raise UserError(f"cohort size {m} is outside [1, --users={self.num_users}]")
            if self.compute_budget % m:
                raise UserError(f"cohort size {m} does not divide --compute-budget {self.compute_budget}")
            if self.compute_budget // m > self.max_group_size:
                raise UserError(f"cohort size {m} needs G_ULS = {self.compute_budget // m} > --max-group-size")
        if not self.resolved_cohort_sizes():
            raise UserError("no cohort size M with B/G_max <= M <= min(B, N): widen the settings")


@dataclass(frozen=True)
class VarianceRow:
    epsilon: float
    cohort_size: int
    group_size_uls: int
    group_size_els: int
    sampling_rate_els: float
    sampling_rate_uls: float
    sigma_els: float
    sigma_uls: float
    ratio_identical: float  # L_G = 1
    ratio_orthogonal: float  # L_G = 1/sqrt(G_ULS)

    def to_dict(self) -> dict:
        return asdict(self)


def run(config: VarianceConfig, progress=None) -> list[VarianceRow]:
    config.validate()
    n, b = config.num_users, config.compute_budget
    p = b / (n * config.els_group_size)
    rows: list[VarianceRow] = []
    for eps in config.epsilons:
        sigma_els = els_noise_multiplier(p, config.els_group_size, config.steps, eps, config.delta, config.accountant)
        sigma_of_m = uls_sigma_of_m(n, config.steps, eps, config.delta, config.accountant)
        for m in config.resolved_cohort_sizes():
            g = b // m
            s_uls = sigma_of_m(m)
            rows.append(
                VarianceRow(
                    epsilon=float(eps),
                    cohort_size=m,
                    group_size_uls=g,
                    group_size_els=config.els_group_size,
                    sampling_rate_els=p,
                    sampling_rate_uls=m / n,
                    sigma_els=sigma_els,
                    sigma_uls=s_uls,
                    ratio_identical=variance_ratio(g, 1.0, s_uls, sigma_els),
                    ratio_orthogonal=variance_ratio(g, 1.0 / math.sqrt(g), s_uls, sigma_els),
                )
            )
            if progress:
                progress(rows[-1])
    return rows


def format_table(rows: Sequence[VarianceRow]) -> str:
    head = (
        f"{'eps':>6} {'M':>6} {'G_ULS':>6} {'sigma_ELS':>10} {'sigma_ULS':>10} "
        f"{'ratio(L_G=1)':>13} {'ratio(L_G=1/sqrtG)':>19}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.epsilon:>6g} {r.cohort_size:>6d} {r.group_size_uls:>6d} {r.sigma_els:>10.4g} "
            f"{r.sigma_uls:>10.4g} {r.ratio_identical:>13.4g} {r.ratio_orthogonal:>19.4g}"
        )
    lines.append("ratio = Var_ULS / Var_ELS (docs/experiments.md, eq. 7); < 1 means ULS adds less noise.")
    return "\n".join(lines)


def plot(rows: Sequence[VarianceRow], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, key, title in (
        (axes[0], "ratio_identical", "identical gradients, $L_G = 1$"),
        (axes[1], "ratio_orthogonal", r"orthogonal gradients, $L_G = 1/\sqrt{G}$"),
    ):
        for eps in sorted({r.epsilon for r in rows}):
            sel = [r for r in rows if r.epsilon == eps]
            ax.plot([r.cohort_size for r in sel], [getattr(r, key) for r in sel], marker="o", label=f"ε = {eps:g}")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ULS cohort size M (G_ULS = B / M)")
        ax.set_title(title)
    axes[0].set_ylabel("Var_ULS / Var_ELS")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
