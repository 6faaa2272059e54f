"""Synthetic mean estimation (Charles et al. 2024, §4; [Charles et al. 2024] §4, Fig 3), trained through
``userdp.engine.train``.

Generator: a population mean mu ~ N(0, pop_scale^2 I_d); user means mu_u ~ N(mu, between^2 I_d);
records x_{u,j} ~ N(mu_u, sigma_w^2 I_d) where sigma_w^2 is the *within-user variance*. Users
hold ``records_per_user`` records each, or a heavy-tailed (log-normal) number with that median.

Model: theta in R^d (an ``nn.Parameter``, initialised at 0); per-record loss 1/2 ||theta - x||^2;
reported loss ||theta_T - mu||^2. ELS (one G_ELS) and ULS (a sweep of G_ULS, M = B / G_ULS) are
compared at the same compute budget B (expected gradients per step), steps T and user-level
(eps, delta); for each algorithm and G the learning rate and clip norm are swept and the best mean
loss over ``trials`` seeds is reported (Charles et al. 2024, §4 protocol).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from userdp import accounting
from userdp.engine import ELS, SGD, ULS, FlatClip, TrainConfig, train
from userdp.engine.performance import Performance
from userdp.engine.run.options import RunOptions
from userdp.engine.user_data import TensorUserData
from userdp.errors import UserError
from userdp.planning import els_group_size, els_noise_multiplier, uls_noise_multiplier


@dataclass(frozen=True)
class MeanEstimationConfig:
    dimension: int = 64
    num_users: int = 2000
    records_per_user: int = 64  # exact count, or the median when heavy_tailed
    heavy_tailed: bool = False
    heavy_tail_sigma: float = 1.0  # log-normal shape for heavy-tailed counts
    max_records_per_user: int = 4096
    population_scale: float = 1.0  # mu ~ N(0, population_scale^2 I)
    between_user_std: float = 1.0  # mu_u ~ N(mu, between_user_std^2 I)
    within_user_variance: float = 10.0  # sigma_w^2
    compute_budget: int = 256  # B: expected gradients per step
    epsilon: float = 1.0
    delta: float | None = None  # default N^-1.1
    steps: int = 60
    els_group_size: int | None = None  # default: median records per user
    uls_group_sizes: tuple[int, ...] = (1, 4, 16, 64)
    # Once clipping bites, lr and C act only through lr*C (and sigma*C scales with it), so one
    # lr and a wide clip grid cover the useful range; add learning rates to sweep both.
    learning_rates: tuple[float, ...] = (1.0,)
    clip_norms: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0)
    trials: int = 2
    seed: int = 0
    accountant: str = "pld"
    average_fraction: float = 0.5  # report the mean of the last fraction of iterates (0 = final)

    def validate(self) -> None:
        for name in ("dimension", "num_users", "records_per_user", "compute_budget", "steps", "trials"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.within_user_variance < 0 or self.between_user_std < 0:
            raise UserError("--within-user-variance and --between-user-std must be >= 0")
        if not 0 <= self.average_fraction <= 1:
            raise UserError(f"--average-fraction must be in [0, 1], got {self.average_fraction}")
        if not self.epsilon > 0:
            raise UserError(f"--epsilon must be > 0, got {self.epsilon}")
        if self.delta is not None and not 0 < self.delta < 1:
            raise UserError(f"--delta must be in (0, 1), got {self.delta}")
        if not self.uls_group_sizes or any(g < 1 for g in self.uls_group_sizes):
            raise UserError("--uls-group-sizes must be positive integers")
        if self.els_group_size is not None and self.els_group_size < 1:
            raise UserError("--els-group-size must be >= 1")
        if any(not lr > 0 for lr in self.learning_rates) or any(not c > 0 for c in self.clip_norms):
            raise UserError("--learning-rates and --clip-norms must be positive")
        if not 0 <= self.seed < 2**63:
            raise UserError(f"--seed must be an integer >= 0, got {self.seed}")
        need = 8 * self.dimension * self.num_users * (self.records_per_user + 2)  # records, user means, copies
        have = _memory_bytes()
        if have and need > have // 2:
            raise UserError(
                f"--dimension {self.dimension} x --users {self.num_users} x --records-per-user "
                f"{self.records_per_user} needs about {need / 2**30:.3g} GiB of memory, more than half "
                f"of this machine's {have / 2**30:.3g} GiB: choose a smaller study"
            )
        for g in self.uls_group_sizes:
            if self.compute_budget / g > self.num_users:
                raise UserError(
                    f"G_ULS = {g} needs a cohort of B/G = {self.compute_budget / g:g} users, more "
                    f"than --num-users {self.num_users}"
                )


def _memory_bytes() -> int:
    """This machine's physical memory (0 where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


@dataclass
class SyntheticUsers:
    mu: np.ndarray  # [d]
    user_means: np.ndarray  # [N, d]
    sizes: np.ndarray  # [N]
    records: np.ndarray  # [sum sizes, d], contiguous by user
    offsets: np.ndarray  # [N+1]

    def user_data(self, group_size: int | None = None, rng: np.random.Generator | None = None):
        """A TensorUserData; with ``group_size`` each user keeps a random subset of at most G
        records (ELS's contribution bounding, Charles et al. 2024, Alg. 1 step 1)."""
        if group_size is None:
            recs, offs = self.records, self.offsets
        else:
            rng = rng if rng is not None else np.random.default_rng()
            keep = []
            for u in range(len(self.sizes)):
                n = int(self.sizes[u])
                sel = np.arange(n) if n <= group_size else rng.choice(n, group_size, replace=False)
                keep.append(self.offsets[u] + np.sort(sel))
            idx = np.concatenate(keep)
            recs = self.records[idx]
            offs = np.concatenate([[0], np.cumsum(np.minimum(self.sizes, group_size))])
        return TensorUserData({"x": torch.from_numpy(recs.astype(np.float32))}, offs)


def generate(config: MeanEstimationConfig, rng: np.random.Generator) -> SyntheticUsers:
    d, n = config.dimension, config.num_users
    mu = rng.normal(0.0, config.population_scale, size=d)
    user_means = mu + rng.normal(0.0, config.between_user_std, size=(n, d))
    if config.heavy_tailed:
        sizes = np.round(config.records_per_user * rng.lognormal(0.0, config.heavy_tail_sigma, size=n))
        sizes = np.clip(sizes, 1, config.max_records_per_user).astype(np.int64)
    else:
        sizes = np.full(n, config.records_per_user, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    owner = np.repeat(np.arange(n), sizes)
    records = user_means[owner] + rng.normal(0.0, math.sqrt(config.within_user_variance), size=(int(offsets[-1]), d))
    return SyntheticUsers(mu, user_means, sizes, records, offsets)


class MeanModel(nn.Module):
    def __init__(self, dimension: int):
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(dimension))


def loss_fn(model: MeanModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-record 1/2 ||theta - x||^2 (vmappable: no data-dependent control flow)."""
    return 0.5 * ((model.theta - batch["x"]) ** 2).sum(-1)


@dataclass(frozen=True)
class Row:
    algorithm: str  # "ELS" or "ULS"
    group_size: int
    cohort_size: float  # ULS: M = B/G; ELS: expected batch size p*|D'|
    sampling_rate: float
    noise_multiplier: float
    within_user_variance: float
    compute_budget: int
    epsilon: float
    delta: float
    steps: int
    learning_rate: float  # best
    clip_norm: float  # best
    loss: float  # mean over trials of ||theta_T - mu||^2 at the best (lr, clip)
    loss_std: float
    trials: int
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------- running


def _median_group_size(sizes: np.ndarray) -> int:
    return els_group_size(sizes).group_size


def _noise_multiplier(
    algorithm: str, group_size: int, rate: float, config: MeanEstimationConfig, delta: float, cache: dict
) -> float:
    key = (algorithm, group_size, round(rate, 15), config.steps, config.epsilon, delta, config.accountant)
    if key not in cache:
        if algorithm == "ELS":
            cache[key] = els_noise_multiplier(rate, group_size, config.steps, config.epsilon, delta, config.accountant)
        else:
            cache[key] = uls_noise_multiplier(rate, config.steps, config.epsilon, delta, config.accountant)
    return cache[key]


def train_once(
    data: SyntheticUsers,
    algorithm,
    config: MeanEstimationConfig,
    *,
    noise_multiplier: float,
    learning_rate: float,
    clip_norm: float,
    seed: int,
    user_data=None,
) -> tuple[float, float]:
    """One run through ``userdp.engine.train``; returns (||theta_T - mu||^2, epsilon recorded)."""
    model = MeanModel(config.dimension)
    ud = user_data if user_data is not None else data.user_data()
    delta = config.delta if config.delta is not None else float(config.num_users) ** -1.1
    # Tail averaging (Polyak-Ruppert over the last ``average_fraction`` of the steps): the
    # iterates are DP outputs, so their mean is post-processing and costs no privacy.
    n_avg = int(round(config.average_fraction * config.steps))
    start = config.steps - n_avg
    acc = {"sum": torch.zeros(config.dimension, dtype=torch.float64), "n": 0}

    def _average(metrics: dict) -> None:
        if metrics["step"] > start:
            acc["sum"] += model.theta.detach().double()
            acc["n"] += 1

    result = train(
        model,
        ud,
        loss_fn,
        TrainConfig(
            algorithm=algorithm,
            steps=config.steps,
            clipping=FlatClip(clip_norm),
            optimizer=SGD(learning_rate),
            noise_multiplier=noise_multiplier,
            delta=delta,
            accountant=config.accountant,
            seed=seed,
            performance=Performance(track_epsilon=False, chunk_size=256),
        ),
        RunOptions(callbacks=(_average,) if n_avg > 0 else ()),
    )
    theta = (acc["sum"] / acc["n"] if acc["n"] else model.theta.detach().double()).numpy()
    return float(np.sum((theta - data.mu) ** 2)), float(result.epsilon)


def run_setting(
    config: MeanEstimationConfig,
    *,
    sweep: str = "base",
    noise_multiplier: float | None = None,
    cache: dict | None = None,
    log: Callable[[str], None] | None = None,
) -> list[dict]:
    """ELS at G_ELS and ULS at each G_ULS for one setting; best (lr, clip) by mean loss over trials.

    ``noise_multiplier`` overrides calibration (0 = non-private, for checks)."""
    config.validate()
    cache = {} if cache is None else cache
    delta = config.delta if config.delta is not None else accounting.default_delta(config.num_users)[0]
    config = replace(config, delta=delta)
    datasets = [generate(config, np.random.default_rng([config.seed, t])) for t in range(config.trials)]
    user_datas = [d.user_data() for d in datasets]
    sizes = datasets[0].sizes
    g_els = config.els_group_size or _median_group_size(sizes)
    plans = [("ELS", g_els)] + [("ULS", int(g)) for g in config.uls_group_sizes]
    rows = []
    for name, g in plans:
        t0 = time.time()
        if name == "ELS":
            dprime = float(np.mean([np.minimum(d.sizes, g).sum() for d in datasets]))
            rate = min(1.0, config.compute_budget / dprime)
            units = rate * dprime
        else:
            units = config.compute_budget / g
            rate = min(1.0, units / config.num_users)
        sigma = (
            noise_multiplier if noise_multiplier is not None else _noise_multiplier(name, g, rate, config, delta, cache)
        )
        alg = ELS(group_size=g, sampling_rate=rate) if name == "ELS" else ULS(group_size=g, sampling_rate=rate)
        best = None
        for lr in config.learning_rates:
            for clip in config.clip_norms:
                out = [
                    train_once(
                        d,
                        alg,
                        config,
                        noise_multiplier=sigma,
                        learning_rate=lr,
                        clip_norm=clip,
                        seed=config.seed * 1_000_003 + t,
                        user_data=ud,
                    )
                    for t, (d, ud) in enumerate(zip(datasets, user_datas, strict=True))
                ]
                losses = np.array([o[0] for o in out])
                if best is None or losses.mean() < best[0]:
                    best = (float(losses.mean()), float(losses.std()), lr, clip, out[0][1])
        row = Row(
            algorithm=name,
            group_size=g,
            cohort_size=float(units),
            sampling_rate=float(rate),
            noise_multiplier=float(sigma),
            within_user_variance=config.within_user_variance,
            compute_budget=config.compute_budget,
            epsilon=config.epsilon,
            delta=float(delta),
            steps=config.steps,
            learning_rate=best[2],
            clip_norm=best[3],
            loss=best[0],
            loss_std=best[1],
            trials=config.trials,
            seconds=time.time() - t0,
        ).to_dict()
        row["epsilon_spent"] = best[4]
        row["sweep"] = sweep
        rows.append(row)
        if log:
            log(
                f"[{sweep}] {name} G={g}: loss={best[0]:.4g} (lr={best[2]:g}, clip={best[3]:g}, "
                f"sigma={sigma:.4g}) in {time.time() - t0:.1f} s"
            )
    return rows


SWEEPABLE = ("within_user_variance", "compute_budget", "epsilon")


def run_study(
    base: MeanEstimationConfig,
    sweeps: dict[str, Sequence] | None = None,
    *,
    noise_multiplier: float | None = None,
    log=None,
) -> list[dict]:
    """The base setting, then each knob of ``sweeps`` varied one at a time (Charles et al. 2024, §4)."""
    cache: dict = {}
    rows = run_setting(base, sweep="base", noise_multiplier=noise_multiplier, cache=cache, log=log)
    for knob, values in (sweeps or {}).items():
        if knob not in SWEEPABLE:
            raise UserError(f"cannot sweep {knob!r}; choose from {', '.join(SWEEPABLE)}")
        for v in values or ():
            if v == getattr(base, knob):
                continue
            cfg = replace(base, **{knob: type(getattr(base, knob))(v)})
            rows += run_setting(cfg, sweep=knob, noise_multiplier=noise_multiplier, cache=cache, log=log)
    return rows


def quick_settings(base: MeanEstimationConfig, sweeps: dict) -> tuple[MeanEstimationConfig, dict]:
    """The reduced ``--quick`` run: fewer users, steps, G values, hyper-parameters and trials,
    and a single swept knob (the within-user variance, raised to 100)."""
    q = replace(
        base,
        num_users=min(base.num_users, 1000),
        steps=min(base.steps, 30),
        uls_group_sizes=tuple(g for g in (1, 4, 16) if g <= base.compute_budget),
        learning_rates=(1.0,),
        clip_norms=(2.0, 4.0),
        trials=min(base.trials, 2),
    )
    return q, {"within_user_variance": (100.0,)}


def format_table(rows: Sequence[dict]) -> str:
    head = (
        f"{'sweep':>22} {'alg':>4} {'G':>5} {'units/step':>10} {'sigma_w^2':>9} {'B':>6} "
        f"{'eps':>6} {'sigma':>8} {'lr':>5} {'clip':>5} {'loss':>10} {'±std':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['sweep']:>22} {r['algorithm']:>4} {r['group_size']:>5d} {r['cohort_size']:>10.4g} "
            f"{r['within_user_variance']:>9g} {r['compute_budget']:>6d} {r['epsilon']:>6g} "
            f"{r['noise_multiplier']:>8.4g} {r['learning_rate']:>5g} {r['clip_norm']:>5g} "
            f"{r['loss']:>10.4g} {r['loss_std']:>9.2g}"
        )
    lines.append(
        "loss = ||theta_T - mu||^2, best (lr, clip) by mean over trials; units/step = ULS "
        "cohort M = B/G or ELS expected batch p|D'|."
    )
    return "\n".join(lines)


def plot(rows: Sequence[dict], base: MeanEstimationConfig, sweeps: dict, out_dir) -> list:
    """One PNG per swept knob: loss against G_ULS (lines), ELS as a dashed level per value."""
    import matplotlib

    matplotlib.use("Agg")

    import matplotlib.pyplot as plt

    written = []
    knobs = [k for k in SWEEPABLE if sweeps and sweeps.get(k)] or ["within_user_variance"]
    for knob in knobs:
        values = sorted({r[knob] for r in rows if r["sweep"] in ("base", knob)})
        fig, ax = plt.subplots(figsize=(5.5, 4))
        for i, v in enumerate(values):
            sel = [r for r in rows if r["sweep"] in ("base", knob) and r[knob] == v]
            uls = sorted((r for r in sel if r["algorithm"] == "ULS"), key=lambda r: r["group_size"])
            els = [r for r in sel if r["algorithm"] == "ELS"]
            color = f"C{i}"
            ax.plot(
                [r["group_size"] for r in uls],
                [r["loss"] for r in uls],
                marker="o",
                color=color,
                label=f"ULS, {knob} = {v:g}",
            )
            for r in els:
                ax.axhline(r["loss"], color=color, ls="--", lw=1, label=f"ELS (G={r['group_size']}), {knob} = {v:g}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("G_ULS (cohort M = B / G)")
        ax.set_ylabel(r"$\|\theta_T - \mu\|^2$")
        ax.set_title(f"mean estimation: varying {knob}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = Path(out_dir) / f"mean_estimation_{knob}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
