"""What private tuning costs (issue 14): per-trial noise under private selection vs one run.

    python benchmarks/bench_tuning.py [--quick] [--json]

For the embedded default's mechanism (ULS, N = 1,175 users, 100 steps, cohort 64, delta = N^-1.1)
and budgets E in {1, 3, 8}, calibrate the per-trial sigma so that tuning with a random number of
trials (truncated negative binomial eta = 1 and eta = 0, Poisson; mean 8) plus the released model
meets E, and compare with the baseline measured in the same run: the sigma of ONE run at E (what
an untuned run, or tuning on public data, pays). Also prints the final model's own epsilon and the
epsilon of publishing every trial, and the calibration time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="E = 3 and TNB(eta=1) only")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--mean-trials", type=float, default=8.0)
    args = ap.parse_args(argv)
    from userdp import engine as E
    from userdp.accounting.selection import TrialCount
    from userdp.engine.plan import make_plan
    from userdp.tuning import accounting as TA

    n, steps, cohort = 1175, 100, 64

    def plan_at(tau):
        cfg = E.TrainConfig(
            algorithm=E.ULS(group_size=2, sampling_rate=cohort / n),
            steps=steps,
            clipping=E.FlatClip(1.0),
            optimizer=E.Adam(lr=1e-3),
            target_epsilon=tau,
        )
        return make_plan(cfg, num_users=n, num_units=n)

    budgets = [3.0] if args.quick else [1.0, 3.0, 8.0]
    counts = [("tnb eta=1", TrialCount.with_mean("tnb", args.mean_trials, 1.0))]
    if not args.quick:
        counts += [
            ("tnb eta=0", TrialCount.with_mean("tnb", args.mean_trials, 0.0)),
            ("poisson", TrialCount.with_mean("poisson", args.mean_trials)),
        ]
    rows = []
    for eps in budgets:
        one = plan_at(eps)
        for name, count in counts:
            t0 = time.perf_counter()
            cal = TA.calibrate(lambda k, tau: plan_at(tau), ["uls"], count, one.delta, eps)
            secs = time.perf_counter() - t0
            sigma = cal.plans["uls"].noise_multiplier
            all_trials = TA.epsilon_from_rdp(TA.ORDERS, args.mean_trials * TA.run_rdp(cal.plans["uls"]), one.delta)
            row = {
                "epsilon_budget": eps,
                "trial_count": name,
                "mean_trials": args.mean_trials,
                "sigma_one_run": round(one.noise_multiplier, 4),
                "sigma_per_trial": round(sigma, 4),
                "sigma_ratio": round(sigma / one.noise_multiplier, 3),
                "epsilon_final_model": round(cal.epsilon_trial["uls"], 3),
                "epsilon_total": round(cal.epsilon_total, 3),
                "epsilon_publish_mean_trials": round(all_trials, 2),
                "calibration_s": round(secs, 1),
            }
            rows.append(row)
            print(
                f"E = {eps:g}, {name:10s}: sigma per trial {sigma:.4f} = {row['sigma_ratio']:.2f}x one run's "
                f"{one.noise_multiplier:.4f}; final model alone eps {row['epsilon_final_model']:.3f}, "
                f"tuning + final {row['epsilon_total']:.3f}; publishing {args.mean_trials:g} trials would be "
                f"{row['epsilon_publish_mean_trials']:.2f}; calibrated in {secs:.1f} s",
                flush=True,
            )
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
