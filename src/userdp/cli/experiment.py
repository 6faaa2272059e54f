"""``userdp experiment {mean-estimation, variance}``: the synthetic experiments of Charles et al. 2024,
§3-§4; docs/experiments.md."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from pathlib import Path

from userdp.cli import argtypes as A
from userdp.cli import jsonout
from userdp.errors import UserError
from userdp.experiments import mean_estimation as me
from userdp.experiments import variance

_floats = A.list_of(A.positive_float)
_ints = A.list_of(A.positive_int)


def _refuse_quick_overrides(args: argparse.Namespace, parser_defaults: dict, keys: tuple[str, ...]) -> None:
    """--quick replaces these settings: refuse it together with an explicit value for one of them
    (it used to override the value silently)."""
    given = [k for k in keys if getattr(args, k) != parser_defaults.get(k)]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise UserError(f"--quick sets {flags} itself: drop --quick or those options")


def _quiet_absl() -> None:
    # dp_accounting's RDP code logs convergence warnings for orders it then excludes; they are
    # not actionable for the user of an experiment.
    logging.getLogger("absl").setLevel(logging.ERROR)


def _plot_dir(path: str | None) -> Path | None:
    if path is None:
        return None
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--plot {path}: cannot create the directory ({exc.strerror})") from None
    return p


# ----------------------------------------------------------------------------------- variance


def _run_variance(args: argparse.Namespace) -> int:
    _quiet_absl()
    cfg = variance.VarianceConfig(
        num_users=args.users,
        max_group_size=args.max_group_size,
        els_group_size=args.els_group_size,
        compute_budget=args.compute_budget,
        steps=args.steps,
        delta=args.delta,
        epsilons=args.epsilons,
        cohort_sizes=args.cohort_sizes,
        accountant=args.accountant,
    )
    if args.quick:
        _refuse_quick_overrides(args, args._defaults, ("epsilons", "cohort_sizes"))
    if args.quick:  # the extreme epsilons and every other cohort size (small T is *slower*:
        # smaller sigma makes the PLD costlier, so T is left alone)
        eps = cfg.epsilons if len(cfg.epsilons) <= 2 else (cfg.epsilons[0], cfg.epsilons[-1])
        ms = cfg.resolved_cohort_sizes()
        ms = tuple(sorted(set(ms[::2]) | {ms[-1]}))
        cfg = dataclasses.replace(cfg, epsilons=tuple(eps), cohort_sizes=ms)
    plot_dir = _plot_dir(args.plot)
    cfg.validate()
    progress = None
    if not args.json:
        print(
            f"# variance comparison (docs/experiments.md): N={cfg.num_users} G_max={cfg.max_group_size} "
            f"G_ELS={cfg.els_group_size} B={cfg.compute_budget} T={cfg.steps} delta={cfg.delta:g} "
            f"accountant={cfg.accountant}",
            flush=True,
        )
    rows = variance.run(cfg, progress=progress)
    if args.json:
        print(jsonout.dumps([r.to_dict() for r in rows], indent=1))
    else:
        print(variance.format_table(rows))
    if plot_dir is not None:
        out = plot_dir / "variance_ratio.png"
        variance.plot(rows, out)
        print(f"wrote {out}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _add_variance(sub) -> None:
    p = sub.add_parser(
        "variance",
        help="ELS vs ULS noise variance for a compute budget (Charles et al. 2024, Fig 2/9; docs/experiments.md)",
        description="Var_ULS/Var_ELS = (G_ULS L_G sigma_ULS / (L sigma_ELS))^2 over epsilon and "
        "cohort size M (G_ULS = B/M), for L_G = 1 and L_G = 1/sqrt(G).",
    )
    p.add_argument("--users", type=A.positive_int, default=10_000, help="N users (default 10000)")
    p.add_argument("--max-group-size", type=A.positive_int, default=64, help="G_max records per user (default 64)")
    p.add_argument("--els-group-size", type=A.positive_int, default=16, help="G_ELS (default 16)")
    p.add_argument("--compute-budget", type=A.positive_int, default=1024, help="B gradients per step (default 1024)")
    p.add_argument("--steps", type=A.positive_int, default=1000, help="T (default 1000)")
    p.add_argument("--delta", type=A.open_unit, default=1e-6, help="delta (default 1e-6)")
    p.add_argument(
        "--epsilons",
        type=_floats,
        default=(1.0, 2.0, 4.0, 8.0, 16.0),
        help="comma-separated epsilons (default 1,2,4,8,16)",
    )
    p.add_argument(
        "--cohort-sizes",
        type=_ints,
        default=None,
        help="comma-separated M values (default: powers of 2 from B/G_max to min(B, N))",
    )
    p.add_argument(
        "--accountant",
        choices=A.ACCOUNTANT_NAMES,
        metavar="NAME",
        default="pld",
        help="accountant for sigma: %(choices)s (default: pld)",
    )
    p.add_argument("--quick", action="store_true", help="T <= 200 and every other epsilon")
    p.add_argument("--plot", metavar="DIR", help="write variance_ratio.png into DIR")
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    p.set_defaults(func=_run_variance, _defaults={a.dest: a.default for a in p._actions})


# ---------------------------------------------------------------------------- mean estimation


def _run_mean_estimation(args: argparse.Namespace) -> int:
    _quiet_absl()
    if args.quick:  # before the defaults are filled in: only what the user gave is refused
        _refuse_quick_overrides(
            args,
            args._defaults,
            (
                "users",
                "steps",
                "uls_group_sizes",
                "learning_rates",
                "clip_norms",
                "trials",
                "sweep_within_user_variance",
            ),
        )
    D = me.MeanEstimationConfig()  # defaults filled here, so `userdp --help` need not import torch
    for name, field_ in (
        ("dimension", "dimension"),
        ("users", "num_users"),
        ("records_per_user", "records_per_user"),
        ("heavy_tail_sigma", "heavy_tail_sigma"),
        ("population_scale", "population_scale"),
        ("between_user_std", "between_user_std"),
        ("within_user_variance", "within_user_variance"),
        ("compute_budget", "compute_budget"),
        ("epsilon", "epsilon"),
        ("steps", "steps"),
        ("uls_group_sizes", "uls_group_sizes"),
        ("learning_rates", "learning_rates"),
        ("clip_norms", "clip_norms"),
        ("trials", "trials"),
        ("seed", "seed"),
        ("average_fraction", "average_fraction"),
    ):
        if getattr(args, name) is None:
            setattr(args, name, getattr(D, field_))
    base = me.MeanEstimationConfig(
        dimension=args.dimension,
        num_users=args.users,
        records_per_user=args.records_per_user,
        heavy_tailed=args.heavy_tailed,
        heavy_tail_sigma=args.heavy_tail_sigma,
        population_scale=args.population_scale,
        between_user_std=args.between_user_std,
        within_user_variance=args.within_user_variance,
        compute_budget=args.compute_budget,
        epsilon=args.epsilon,
        delta=args.delta,
        steps=args.steps,
        els_group_size=args.els_group_size,
        uls_group_sizes=args.uls_group_sizes,
        learning_rates=args.learning_rates,
        clip_norms=args.clip_norms,
        trials=args.trials,
        seed=args.seed,
        accountant=args.accountant,
        average_fraction=args.average_fraction,
    )
    sweeps = {
        "within_user_variance": args.sweep_within_user_variance,
        "compute_budget": args.sweep_compute_budget,
        "epsilon": args.sweep_epsilon,
    }
    if args.quick:
        base, sweeps = me.quick_settings(base, sweeps)
    if args.no_sweeps:
        sweeps = {}
    plot_dir = _plot_dir(args.plot)
    base.validate()
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json else (lambda msg: print(msg, flush=True))
    t0 = time.time()
    rows = me.run_study(base, sweeps, noise_multiplier=args.noise_multiplier, log=log if args.verbose else None)
    if args.json:
        print(jsonout.dumps(rows, indent=1))
    else:
        print(me.format_table(rows))
        print(f"# {len(rows)} rows in {time.time() - t0:.1f} s")
    if plot_dir is not None:
        for out in me.plot(rows, base, sweeps, plot_dir):
            log(f"wrote {out}")
    return 0


def _add_mean_estimation(sub) -> None:
    p = sub.add_parser(
        "mean-estimation",
        help="ELS vs ULS on synthetic mean estimation (Charles et al. 2024, Fig 3; docs/experiments.md)",
        description="Each user's records are N(mu_u, sigma_w^2 I) around a user mean mu_u near the "
        "population mean mu; theta is trained through userdp.engine.train with loss "
        "1/2||theta - x||^2 under user-level (eps, delta)-DP; the reported loss is "
        "||theta_T - mu||^2, best over the lr x clip sweep, mean over trials. The base "
        "setting is run once per value of each --sweep-* list (one knob at a time).",
    )
    p.add_argument("--dimension", type=A.positive_int, default=None, help="d, the dimension of the mean to estimate")
    p.add_argument("--users", type=A.positive_int, default=None, help="N users")
    p.add_argument(
        "--records-per-user",
        type=A.positive_int,
        default=None,
        help="records per user (the median when --heavy-tailed)",
    )
    p.add_argument(
        "--heavy-tailed", action="store_true", help="log-normal records per user with median --records-per-user"
    )
    p.add_argument(
        "--heavy-tail-sigma",
        type=A.nonneg_float,
        default=None,
        help="log-normal sigma of records per user with --heavy-tailed",
    )
    p.add_argument("--population-scale", type=A.positive_float, default=None, help="std of the population mean mu")
    p.add_argument("--between-user-std", type=A.nonneg_float, default=None, help="std of user means around mu")
    p.add_argument(
        "--within-user-variance",
        type=A.nonneg_float,
        default=None,
        help="sigma_w^2, the variance of a user's records around its mean",
    )
    p.add_argument("--compute-budget", type=A.positive_int, default=None, help="B: expected gradients per step")
    p.add_argument("--epsilon", type=A.positive_float, default=None, help="target epsilon")
    p.add_argument("--delta", type=A.open_unit, default=None, help="default N^-1.1")
    p.add_argument("--steps", type=A.positive_int, default=None, help="T, training steps")
    p.add_argument(
        "--els-group-size", type=A.positive_int, default=None, help="G_ELS (default: median records per user)"
    )
    p.add_argument("--uls-group-sizes", type=_ints, default=None, help="comma-separated ULS group sizes G to try")
    p.add_argument("--learning-rates", type=_floats, default=None, help="comma-separated learning rates to tune over")
    p.add_argument("--clip-norms", type=_floats, default=None, help="comma-separated clip norms to tune over")
    p.add_argument("--trials", type=A.positive_int, default=None, help="repetitions per setting (different seeds)")
    p.add_argument("--seed", type=A.nonneg_int, default=None, help="base seed of the data and the runs")
    p.add_argument(
        "--accountant",
        choices=A.ACCOUNTANT_NAMES,
        metavar="NAME",
        default="pld",
        help="accountant for sigma: %(choices)s (default: pld)",
    )
    p.add_argument(
        "--average-fraction",
        type=A.rate,
        default=None,
        help="report the mean of the last fraction of the iterates (tail averaging, "
        "post-processing); 0 = the final iterate",
    )
    p.add_argument(
        "--noise-multiplier",
        type=A.nonneg_float,
        default=None,
        help="use this sigma instead of calibrating to (epsilon, delta); 0 = non-private "
        "reference (the rows' epsilon_spent then says inf)",
    )
    p.add_argument(
        "--sweep-within-user-variance", type=_floats, default=(1.0, 100.0), help="values of sigma_w^2 for its sweep"
    )
    p.add_argument("--sweep-compute-budget", type=_ints, default=(64, 1024), help="values of B for its sweep")
    p.add_argument("--sweep-epsilon", type=_floats, default=(0.25, 4.0), help="values of epsilon for its sweep")
    p.add_argument("--no-sweeps", action="store_true", help="run the base setting only")
    p.add_argument("--quick", action="store_true", help="a reduced run (under a minute)")
    p.add_argument("--plot", metavar="DIR", help="write one PNG per swept knob into DIR")
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    p.add_argument("--verbose", action="store_true", help="log each setting as it finishes")
    p.set_defaults(func=_run_mean_estimation, _defaults={a.dest: a.default for a in p._actions})


def register(p) -> None:
    p.description = "Synthetic experiments comparing ELS and ULS."
    sub = p.add_subparsers(dest="experiment", metavar="EXPERIMENT")
    _add_mean_estimation(sub)
    _add_variance(sub)

    def _no_experiment(args):
        p.print_help()
        return 2

    p.set_defaults(func=_no_experiment)
