"""The DP step against the non-private step in one process, interleaved (issue 42): for bisecting.

``bench_scale.py`` runs each configuration in its own process, whose start-up, allocator and page
faults move a ratio by up to +-0.2 on this 2-core CPU. Here the non-private step, the ULS step and
the ELS step share one process and one model and take turns (non-private, ULS, ELS, non-private,
...), so a change in the DP step's own work shows through. ``--root`` points at another checkout of
userdp (a ``git worktree`` of an older commit), so that commits are compared on the same machine
in the same way; ``--no-noise`` leaves the noise out (the draw is the same fixed cost at every
commit: 124M normals at gpt2-small), which isolates the per-unit clipping.

    git worktree add /tmp/wt/223f03f 223f03f
    python benchmarks/bench_cpu_step.py --root /tmp/wt/223f03f --no-noise
    python benchmarks/bench_cpu_step.py --no-noise          # this checkout
    python benchmarks/bench_cpu_step.py                     # with the noise, as a user runs it

Prints one JSON line: per algorithm the median wall-time ratio over the repetitions, its range, the
same in process CPU time (which counts the noise threads too), and the non-private step's seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--root",
        default=str(Path(__file__).resolve().parents[1]),
        help="the userdp checkout to measure (its src/ and benchmarks/; default: this one)",
    )
    ap.add_argument("--model", default="gpt2-small", help="a preset of userdp.lm.presets")
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--users", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions (each runs every step once)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-noise", action="store_true", help="leave the noise draw out of the DP steps")
    ap.add_argument("--quick", action="store_true", help="3 repetitions (benchmarks/run.py --quick)")
    a = ap.parse_args(argv)
    if a.quick:
        a.reps = min(a.reps, 3)
    root = str(Path(a.root).resolve())
    sys.path[:0] = [root + "/src", root + "/benchmarks"]  # the checkout's userdp and its bench_scale._setup
    import numpy as np
    import torch
    from bench_scale import _random_batch, _setup

    import userdp.engine.run.loop as loop
    from userdp.engine import ELS, SGD, ULS, FlatClip, TrainConfig

    def performance(**settings) -> dict:  # 0.10 holds them in a Performance; a checkout before it, flat
        try:
            from userdp.engine.performance import Performance
        except ImportError:
            return settings
        return {"performance": Performance(**settings)}

    from userdp.lm.models import causal_lm_loss

    if not loop.__file__.startswith(root):
        raise SystemExit(f"--root {root}: imported userdp from {loop.__file__} instead")
    run_class = getattr(loop, "EngineRun", None) or loop._Run  # older commits name it _Run
    torch.set_num_threads(a.threads)
    m, g = a.users, a.group_size
    model, data = _setup(a.model, "full", 8, a.vocab, a.seq_len, 4 * m, g, torch.device("cpu"))
    rng = np.random.default_rng(1)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def nonprivate():
        batch = _random_batch(data, m * g, rng)
        opt.zero_grad(set_to_none=True)
        causal_lm_loss(model, batch).mean().backward()
        opt.step()

    steps = {"nonprivate": nonprivate}
    for alg in ("uls", "els"):
        n_units = data.num_users if alg == "uls" else int(data.sizes().clip(max=g).sum())
        algo = ULS(g, m / n_units) if alg == "uls" else ELS(g, m * g / n_units)
        sampling, acc = ("fixed_size", "rdp") if alg == "uls" else ("shuffle", "pld")
        cfg = TrainConfig(
            algorithm=algo,
            steps=10**6,
            clipping=FlatClip(1.0),
            optimizer=SGD(1e-4),
            noise_multiplier=1.0,
            delta=1e-5,
            seed=0,
            sampling=sampling,
            accountant=acc,
            **performance(chunk_size=m if alg == "uls" else m * g, track_epsilon=False, per_unit="auto"),
        )
        run = run_class(model, data, causal_lm_loss, cfg, None, None)
        if a.no_noise:
            run.noise.update = lambda sums, state, std: (sums, state)
            run.noise.begin_step = lambda *args, **kw: None  # no draw ahead either
        steps[alg] = run.run_step
    for f in steps.values():  # once untimed: the ghost strategy's first-chunk check, the allocator
        f()
    wall = {k: [] for k in steps}
    cpu = {k: [] for k in steps}
    for _ in range(max(1, a.reps)):
        for k, f in steps.items():
            t0, c0 = time.perf_counter(), time.process_time()
            f()
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    out = {
        "root": root,
        "model": a.model,
        "noise": not a.no_noise,
        "reps": a.reps,
        "threads": a.threads,
        "params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "nonprivate_s": round(statistics.median(wall["nonprivate"]), 3),
    }
    for k in ("uls", "els"):
        rw = [x / y for x, y in zip(wall[k], wall["nonprivate"], strict=True)]
        rc = [x / y for x, y in zip(cpu[k], cpu["nonprivate"], strict=True)]
        out[k] = {
            "time": round(statistics.median(rw), 3),
            "time_range": [round(min(rw), 3), round(max(rw), 3)],
            "cpu": round(statistics.median(rc), 3),
            "cpu_range": [round(min(rc), 3), round(max(rc), 3)],
        }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
