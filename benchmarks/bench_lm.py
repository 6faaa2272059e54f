"""LM benchmark: held-out-user perplexity on Stack Exchange at equal compute (issue 5, Charles et al. 2024, §5).

Public pretraining on the 8 meta sites (declared public), then fine-tuning on the 7 main sites:
  * the pretrained model, no fine-tuning (the baseline DP fine-tuning must beat, Charles et al. 2024, §5)
  * non-private fine-tuning (same sampling and compute, no clipping, no noise)
  * ELS and ULS at epsilon in {1, 3, 8}, delta = N^-1.1

Equal compute: every run processes the same expected number of records per step, B = M * G:
ULS samples M users and averages up to G records each; ELS samples records at the rate giving
B expected records per step from the G-capped dataset. Same steps, optimizer, learning rate.

    python benchmarks/bench_lm.py            # full (about an hour on 2 idle CPU cores)
    python benchmarks/bench_lm.py --quick    # smoke run (a few minutes)

Prints one row per run: held-out-user perplexity (token-averaged) and its ratio to the
pretrained model's, epsilon spent, and the wall time ratio against the non-private run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("USERDP_SHARED_DATA", REPO.parent / "shared" / "data")) / "stackexchange"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="reduced smoke run")
    ap.add_argument("--eps", default="1,3,8")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--cohort", type=int, help="users per step M (ULS); ELS samples M*G records")
    ap.add_argument("--group-size", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--out", help="folder for the runs (default: a temporary folder)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not DATA.is_dir():
        print(f"skip: {DATA} is absent", file=sys.stderr)
        return 0
    from userdp.lm import config as C
    from userdp.lm.finetune import run

    q = args.quick
    steps = args.steps or (8 if q else 60)
    cohort = args.cohort or (16 if q else 32)
    g = args.group_size or (2 if q else 4)
    lr = args.lr or 1e-3
    base = [
        "data.source=stackexchange",
        f"data.path={DATA}",
        "data.heldout_users=0.1",
        f"data.max_eval_users={60 if q else 300}",
        "tokenizer.vocab_size=2048",
        "tokenizer.seq_len=64",
        "model.preset=tiny",
        f"model.pretraining.steps={100 if q else 600}",
        f"training.steps={steps}",
        f"training.group_size={g}",
        f"training.lr={lr}",
        "training.optimizer=adam",
        "training.clip_norm=1.0",
        "training.seed=0",
        f"training.checkpoint_every={steps}",
        "output.plot=false",
    ]
    if q:
        base.append("data.max_users=400")
    eps = [float(e) for e in args.eps.split(",") if e]
    runs = [("nonprivate", None)] + [(a, e) for a in ("els", "uls") for e in eps]
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_lm_"))
    rows = []
    for alg, e in runs:
        sets = base + [f"training.algorithm={alg}"]
        sets.append(f"training.cohort_size={cohort * g if alg == 'els' else cohort}")
        if e is not None:
            sets.append(f"privacy.epsilon={e}")
        cfg = C.load_config(None, sets)
        name = f"{alg}" + (f"-eps{e:g}" if e is not None else "")
        t0 = time.time()
        s = run(cfg, output=str(out / name), progress=False, log=lambda m: None)
        s["wall"] = time.time() - t0
        s["name"] = name
        rows.append(s)
        print(
            f"{name:16s} ppl {s['perplexity_after']:8.2f}  eps {s['epsilon'] if s['epsilon'] is None else round(s['epsilon'], 3)}"
            f"  {s['wall']:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    pre = rows[0]["perplexity_before"]
    base_wall = rows[0]["wall"]
    print(
        f"\nStack Exchange (pretrain: meta sites; fine-tune: main sites), tiny GPT, {steps} steps, "
        f"M = {cohort} users x G = {g} records per step (ELS: {cohort * g} records), "
        f"{rows[0]['train_users']} training users, {rows[0]['eval_users']} held-out users"
    )
    print(
        f"{'run':16s} {'held-out ppl':>12s} {'vs pretrained':>13s} {'epsilon':>8s} {'sigma':>7s} {'wall vs non-private':>20s}"
    )
    print(f"{'pretrained':16s} {pre:12.2f} {1.0:13.3f} {'-':>8s} {'-':>7s} {'-':>20s}")
    for s in rows:
        e = "inf" if s["epsilon"] is None else f"{s['epsilon']:.3f}"
        z = "-" if not s.get("noise_multiplier") else f"{s['noise_multiplier']:.3f}"
        print(
            f"{s['name']:16s} {s['perplexity_after']:12.2f} {s['perplexity_after'] / pre:13.3f} {e:>8s} {z:>7s} "
            f"{s['wall'] / base_wall:20.2f}"
        )
    if args.json:
        print(json.dumps({"pretrained_perplexity": pre, "runs": rows}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
