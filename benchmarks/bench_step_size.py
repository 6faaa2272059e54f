"""Where the per-step noise stops mattering: the DP step against the non-private step as the step
grows (users per step × model), both sides on the same cores.

A DP step adds one Gaussian draw of the model's size, whatever the cohort: at gpt2-small that is
124M normals, a fixed cost per step. Its share of the step falls as the step's own work grows.
Each row runs ``bench_cpu_step.py`` (the non-private, ULS and ELS steps interleaved in one process,
on ``--threads`` torch threads, the noise drawn on the same threads) for one model and one cohort
size, and adds the noise draw alone, timed in the same process as the steps' model.

    python benchmarks/bench_step_size.py --threads 2                  # gpt2-small, 2..16 users
    python benchmarks/bench_step_size.py --models base,gpt2-small --users 2,8,32 --reps 3

Prints a Markdown table: model, parameters, users × G records × tokens per step, the non-private
step's seconds, the ULS and ELS steps' median time ratios [min-max], and the noise's share.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def noise_seconds(numel: int, threads: int, reps: int = 3) -> float:
    """The median seconds of one draw of ``numel`` normals added to zeros (the step's noise alone)."""
    import torch

    sys.path.insert(0, str(HERE.parent / "src"))
    from userdp.engine.noise.gaussian import GaussianNoise

    torch.set_num_threads(threads)
    src = GaussianNoise(1, seeded=True)
    target = [torch.zeros(numel)]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        src.add_(target, 1.0)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2-small", help="presets of userdp.lm.presets, comma-separated")
    ap.add_argument("--users", default="2,4,8,16", help="users per step, comma-separated")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    print(
        f"| model | parameters | step (users × G × tokens) | non-private s | ULS time | ELS time | noise s "
        f"(share of the ULS step) |  — {a.threads} torch thread(s) each side"
    )
    print("|---|---|---|---|---|---|---|")
    for model in a.models.split(","):
        for m in [int(x) for x in a.users.split(",")]:
            cmd = [
                sys.executable,
                str(HERE / "bench_cpu_step.py"),
                "--model",
                model,
                "--users",
                str(m),
                "--group-size",
                str(a.group_size),
                "--seq-len",
                str(a.seq_len),
                "--threads",
                str(a.threads),
                "--reps",
                str(a.reps),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            row = json.loads(out)
            noise = noise_seconds(row["params"], a.threads)
            uls, els = row["uls"], row["els"]
            uls_s = uls["time"] * row["nonprivate_s"]
            print(
                f"| {model} | {row['params'] / 1e6:.0f}M | {m} × {a.group_size} × {a.seq_len} | "
                f"{row['nonprivate_s']:.2f} | {uls['time']:.2f}× [{uls['time_range'][0]:.2f}–{uls['time_range'][1]:.2f}] | "
                f"{els['time']:.2f}× [{els['time_range'][0]:.2f}–{els['time_range'][1]:.2f}] | "
                f"{noise:.2f} ({noise / uls_s:.0%}) |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
