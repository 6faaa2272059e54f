"""The audit's power and cost on the embedded default (issue 13, item 6).

    python benchmarks/bench_audit.py            # every scenario (~10 min on 2 CPU cores)
    python benchmarks/bench_audit.py --quick    # nonprivate, eps=1 and noise_off only
    python benchmarks/bench_audit.py --json     # one JSON list of rows as the last line
    python benchmarks/bench_audit.py --score gradient --only "nonprivate;eps=1;..."  # white-box canaries

Each scenario is one audited `userdp train` of the embedded default (Shakespeare, tiny GPT, ULS,
100 steps, cohort 64) with K canary users, run in this process; the broken builds patch the engine
with :func:`userdp.audit.faults.broken_session` while the accountant still claims the target epsilon.
A build is *caught* when the audited lower bound exceeds the accounted epsilon. Every score is
computed in each run; the bound is the configured score's (``--score``, default the library's),
and the bounds the other scores would have given, had they been chosen before training, are
printed beside it. The baseline, in the same run, is the same training without canaries (timed
before and after the scenarios; the faster is used): the audit's cost is its scoring time over
the baseline's wall time, and the audited run's wall time over the baseline's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

# (name, overrides, fault, times)
SCENARIOS = [
    ("nonprivate", ["training.algorithm=nonprivate"], None, 1),
    ("eps=1", ["privacy.epsilon=1"], None, 1),
    ("eps=1, noise off", ["privacy.epsilon=1"], "noise_off", 1),
    ("eps=1, clipping off", ["privacy.epsilon=1"], "clipping_off", 1),
    ("eps=1, a user counted 16 times", ["privacy.epsilon=1"], "user_counted_g_times", 16),
    ("eps=1, G=16", ["privacy.epsilon=1", "training.group_size=16"], None, 1),
    ("eps=1, G=16, user counted 16 times", ["privacy.epsilon=1", "training.group_size=16"], "user_counted_g_times", 16),
]
QUICK = {"nonprivate", "eps=1", "eps=1, noise off"}


def _run(overrides, out: Path, fault, times):
    from userdp.audit.faults import broken_session
    from userdp.audit.session import AuditSession
    from userdp.lm import config as C
    from userdp.lm.finetune import run
    from userdp.lm.job_context import Launch

    cfg = C.load_config(None, overrides)
    t0 = time.perf_counter()
    session = broken_session(fault, times) if fault else AuditSession
    s = run(cfg, output=str(out), progress=False, log=lambda m: None, launch=Launch(audit=session))
    return s, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--canaries", type=int, default=400)
    ap.add_argument("--score", default=None, help="audit.score (default: the library's default)")
    ap.add_argument("--only", default=None, help="scenario names to run, separated by ';'")
    args = ap.parse_args(argv)
    from userdp.audit.bounds import one_run_bound

    rows = []
    extra = [f"audit.canaries={args.canaries}"] + ([f"audit.score={args.score}"] if args.score else [])
    with tempfile.TemporaryDirectory() as tmp:
        _, base_s = _run([], Path(tmp) / "baseline", None, 1)
        print(f"baseline (no audit, eps=3): {base_s:.1f} s", flush=True)
        for name, ov, fault, times in SCENARIOS:
            if (args.quick and name not in QUICK) or (args.only and name not in args.only.split(";")):
                continue
            s, secs = _run(ov + extra, Path(tmp) / name.replace(" ", "_").replace(",", ""), fault, times)
            priv = json.loads((Path(s["run_dir"]) / "privacy.json").read_text())
            a = priv["audit"]
            sec = json.loads(Path(a["secrets_file"]).read_text())
            others = {
                k: round(one_run_bound(v, sec["included"], delta=a["delta"]).epsilon_lower_bound, 2)
                for k, v in sec["scores"].items()
            }
            row = {
                "scenario": name,
                "fault": fault,
                "epsilon": s["epsilon"],
                "delta": a["delta"],
                "score": a["score"].split(":")[0],
                "epsilon_lower_bound": round(a["epsilon_lower_bound"], 3),
                "caught": a["mechanism_caught"],
                "correct": a["correct"],
                "guesses": a["guesses"],
                "canary_auc": round(a["canary_auc"], 3),
                "bound_had_each_score_been_chosen": others,
                "auc_other_scores": {k: round(v, 3) for k, v in a["canary_auc_other_scores"].items()},
                "user_inference_auc": round((a.get("user_inference") or {}).get("auc", float("nan")), 3),
                "canaries": a["canaries"],
                "seconds": round(secs, 1),
                "audit_seconds": a["seconds"],
            }
            rows.append(row)
            eps = "none" if s["epsilon"] is None else f"{s['epsilon']:.3f}"
            print(
                f"{name:36s} accounted eps {eps:>6s}  audited eps >= {row['epsilon_lower_bound']:.2f} "
                f"({row['correct']}/{row['guesses']} correct, AUC {row['canary_auc']:.3f})  "
                f"{'CAUGHT' if row['caught'] else '      '}  each score: {others}  "
                f"user-inference AUC {row['user_inference_auc']:.3f}  {secs:.0f} s (scoring {a['seconds']:.1f} s)",
                flush=True,
            )
        _, base2 = _run([], Path(tmp) / "baseline2", None, 1)
        base_s = min(base_s, base2)
        for r in rows:
            r["time_ratio"] = round(r["seconds"] / base_s, 2)
            r["audit_overhead"] = round(r["audit_seconds"] / base_s, 3)
        print(
            f"baseline (no audit, eps=3, the faster of two): {base_s:.1f} s; audited runs "
            f"{min(r['time_ratio'] for r in rows):.2f}-{max(r['time_ratio'] for r in rows):.2f}x; "
            f"scoring {min(r['audit_overhead'] for r in rows):.1%}-{max(r['audit_overhead'] for r in rows):.1%} "
            "of the baseline",
            flush=True,
        )
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
