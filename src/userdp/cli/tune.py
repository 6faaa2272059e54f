"""`userdp tune [CONFIG.yaml] --search SPACE.yaml --epsilon E [--on private|public] [--json]`."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from userdp.accounting.selection import TrialCount
from userdp.cli import argtypes as A
from userdp.cli import jsonout
from userdp.engine.algorithms import ALGORITHMS
from userdp.errors import UserError
from userdp.lm import config as C
from userdp.lm.run_dir import read_json
from userdp.tuning import job
from userdp.tuning.space import load_space

MAX_MEAN_TRIALS = 1000  # a tuning run of more trials is not a tuning run this tool can finish
MAX_ETA = 100.0
MAX_EPSILON = 1000.0


def register(p) -> None:
    p.description = (
        "Run a random number of trials of the training job (Papernot & Steinke 2022: truncated "
        "negative binomial or Poisson), each with hyperparameters drawn from SPACE.yaml, score "
        "them on held-out users and release the best; the per-trial noise is calibrated so "
        "tuning + the released model meet --epsilon. With --on public, tune on data declared "
        "public and train once on the private data. See docs/tuning.md."
    )
    p.add_argument("config", nargs="?", help="training config (YAML) layered over the embedded default")
    p.add_argument("--search", metavar="SPACE.yaml", help="the search space (required for a new tuning run)")
    p.add_argument("--epsilon", type=float, metavar="E", help="budget for tuning + the released model")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one key of the training config; repeatable",
    )
    p.add_argument(
        "--on",
        choices=["private", "public"],
        default="private",
        help="private: trials on the private data, accounted (default); public: trials on "
        "--public-config's data, then one private run",
    )
    p.add_argument(
        "--public-config",
        metavar="PUBLIC.yaml",
        help="with --on public: a training config whose data you declare public",
    )
    p.add_argument(
        "--distribution",
        choices=["tnb", "poisson"],
        default="tnb",
        help="the number of trials: truncated negative binomial (default) or Poisson",
    )
    p.add_argument("--mean-trials", type=float, default=8.0, metavar="M", help="expected number of trials (8)")
    p.add_argument("--eta", type=float, default=1.0, help="TNB shape (1: geometric, the default; 0: logarithmic)")
    p.add_argument("--output", metavar="DIR", type=A.output_dir, help="tuning directory (default tune/<timestamp>)")
    p.add_argument("--resume", metavar="DIR", help="continue an interrupted tuning run (never re-draws)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=main)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(args) -> int:
    if args.resume:
        if args.config or args.search or args.overrides or args.output or args.epsilon is not None:
            raise UserError(
                "--resume DIR continues a tuning run with its saved plan: give no CONFIG, "
                "--search, --set, --epsilon or --output with it"
            )
        out = Path(args.resume)
        if not (out / job.STATE).is_file():
            raise UserError(f"--resume {out}: no {job.STATE} there (not a tuning directory)")
        state = job.check_state(read_json(out / job.STATE), out / job.STATE)
        _log(
            f"tune: resuming {out}: {state['trials_planned']} trials as drawn, "
            f"{sum(t.get('score') is not None for t in state['trials'])} done"
        )
    else:
        if not args.search:
            raise UserError("--search SPACE.yaml is required (the hyperparameters to tune)")
        if args.epsilon is None or not args.epsilon > 0:
            raise UserError("--epsilon E is required and must be > 0 (the budget for tuning + the released model)")
        if args.on == "public" and not args.public_config:
            raise UserError("--on public needs --public-config PUBLIC.yaml (a config whose data you declare public)")
        if args.public_config and args.on != "public":
            raise UserError("--public-config is for --on public")
        if not (math.isfinite(args.epsilon) and args.epsilon <= MAX_EPSILON):
            raise UserError(f"--epsilon must be a finite number <= {MAX_EPSILON:g}, got {args.epsilon}")
        if not (math.isfinite(args.mean_trials) and 0 < args.mean_trials <= MAX_MEAN_TRIALS):
            raise UserError(f"--mean-trials must be a finite number in (0, {MAX_MEAN_TRIALS}], got {args.mean_trials}")
        if not (math.isfinite(args.eta) and 0 <= args.eta <= MAX_ETA):
            raise UserError(f"--eta must be a finite number in [0, {MAX_ETA:g}], got {args.eta}")
        if args.output and Path(args.output).exists() and not Path(args.output).is_dir():
            raise UserError(f"--output {args.output}: exists and is not a folder")
        space = load_space(args.search)
        cfg = C.load_config(args.config, args.overrides + [f"privacy.epsilon={args.epsilon!r}"])
        if not ALGORITHMS.lookup(cfg.training.algorithm).private:
            raise UserError(
                f"training.algorithm is {cfg.training.algorithm}, which is not private: there is no "
                "guarantee to account tuning against"
            )
        if cfg.audit.canaries:
            raise UserError("audit.canaries: audit the tuned model's run with userdp audit, not every trial")
        public_cfg = C.load_config(args.public_config, []) if args.public_config else None
        count = TrialCount.with_mean(args.distribution, args.mean_trials, args.eta)
        out = Path(args.output or Path("tune") / time.strftime("%Y%m%d-%H%M%S"))
        state = job.new_tuning(
            cfg, space, epsilon=args.epsilon, count=count, out=out, on=args.on, public_cfg=public_cfg, log=_log
        )
    s = job.run_trials(state, out, progress=not args.no_progress, log=_log)
    print(f"tuning directory:     {out}")
    # the number of trials is printed to the operator (it is in tune.json) but is not in any released file
    print(
        f"trials run:           {len(state['trials'])} ({s['trial_count']['kind']}, mean "
        f"{s['trial_count']['mean']:.3g}; keep it private: the released guarantee needs it secret)"
    )
    print(
        f"best:                 {out / 'best'} (held-out loss {s['best']['heldout_loss']:.4f}): "
        + ", ".join(f"{k} = {v}" for k, v in s["best"]["params"].items())
    )
    if s["on"] == "private":
        print(
            f"privacy:              released model: epsilon = {s['epsilon_total']:.4g} at delta = "
            f"{s['delta']:.3g} (private selection, the number of trials kept secret)"
        )
        print(
            f"                      one trial's own epsilon, {s['epsilon_one_trial']:.4g}, is not a guarantee "
            "for the selected model"
        )
        print(
            f"                      publishing the number of trials, results.csv or any other trial's model "
            f"voids it: then epsilon = {state['epsilon_if_trials_published']:.4g} (their composition, tune.json)"
        )
    else:
        print(
            f"privacy:              epsilon = {s['epsilon_total']:.4g}; delta = {s['delta']:.3g} (tuned on "
            "public data; the private data was touched once, by the final run)"
        )
    sys.stdout.flush()
    if args.json:
        print(jsonout.dumps(s))
    return 0
