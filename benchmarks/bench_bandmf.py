"""What banded matrix-factorization noise costs a DP step: the ULS step with BandMF noise against the
same step with independent noise, interleaved in one process on the same threads.

The two steps share the model, the data, the sampler (fixed-size cohorts, so both process the same
number of users) and the per-unit work; only the noise mechanism differs: i.i.d. Gaussian, or
BandMF with b bands (the recursion over the last b − 1 noise vectors, run inside the draw a piece at
a time). The BandMF mechanism is put on the run directly (the plan would ask for cyclic sampling,
which makes the cohort size vary between the two steps): a timing, not a private run. The noise
alone is timed too, on zeros of the model's size, after b steps (the ring full).

    python benchmarks/bench_bandmf.py --threads 2 --bands 4          # gpt2-small, 2 users × 4 × 32
    python benchmarks/bench_bandmf.py --model base --bands 2,4,16 --reps 5

Prints one JSON line: the non-private step's seconds; per b the BandMF step over the independent-noise
step (median and range over the repetitions), each DP step over the non-private one, and the noise
alone (independent, BandMF, seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _median(xs):
    return round(statistics.median(xs), 3)


def noise_alone(numel: int, bands: int, reps: int) -> tuple[float, float]:
    """(independent, BandMF) median seconds of one step's noise added to zeros of ``numel``."""
    import torch

    from userdp.engine.noise.bandmf import BandMF
    from userdp.engine.noise.gaussian import GaussianNoise
    from userdp.engine.noise.mechanism import IIDGaussian

    iid, mf = IIDGaussian(GaussianNoise(1, seeded=True)), BandMF(GaussianNoise(1, seeded=True), bands=bands)
    target = [torch.zeros(numel)]
    states = {"iid": None, "mf": mf.init(numel, torch.float32, "cpu")}
    for _ in range(bands):  # the ring full: every step from here reads b - 1 past vectors
        target, states["mf"] = mf.update(target, states["mf"], 1.0)
    times: dict[str, list[float]] = {"iid": [], "mf": []}
    for _ in range(reps):
        for k, mech in (("iid", iid), ("mf", mf)):
            t0 = time.perf_counter()
            target, states[k] = mech.update(target, states[k], 1.0)
            times[k].append(time.perf_counter() - t0)
    return _median(times["iid"]), _median(times["mf"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-small", help="a preset of userdp.lm.presets")
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--users", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--bands", default="4", help="band counts b, comma-separated")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    sys.path[:0] = [str(HERE.parent / "src"), str(HERE)]
    import numpy as np
    import torch
    from bench_scale import _random_batch, _setup

    from userdp.engine import SGD, ULS, FlatClip, RunOptions, TrainConfig
    from userdp.engine.noise.bandmf import BandMF
    from userdp.engine.performance import Performance
    from userdp.engine.run.loop import start_run
    from userdp.lm.models import causal_lm_loss

    torch.set_num_threads(a.threads)
    m, g = a.users, a.group_size
    bands = [int(x) for x in a.bands.split(",")]
    model, data = _setup(a.model, "full", 8, a.vocab, a.seq_len, 4 * m, g, torch.device("cpu"))
    rng = np.random.default_rng(1)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def nonprivate():
        batch = _random_batch(data, m * g, rng)
        opt.zero_grad(set_to_none=True)
        causal_lm_loss(model, batch).mean().backward()
        opt.step()

    cfg = TrainConfig(
        algorithm=ULS(g, m / data.num_users),
        steps=10**6,
        clipping=FlatClip(1.0),
        optimizer=SGD(1e-4),
        noise_multiplier=1.0,
        delta=1e-5,
        seed=0,
        sampling="fixed_size",
        accountant="rdp",
        performance=Performance(chunk_size=m, track_epsilon=False),
    )
    steps = {"nonprivate": nonprivate}
    for b in (1, *bands):
        run = start_run(model, data, causal_lm_loss, cfg, RunOptions())
        if b > 1:
            run.noise = BandMF(run.noise.source, bands=b)
            run.noise_state = run.distribution.noise_init(run)
        steps[f"b{b}"] = run.run_step
    for _ in range(max(bands)):  # untimed: the first-chunk checks, the allocator, BandMF's ring filled
        for f in steps.values():
            f()
    wall: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(max(1, a.reps)):
        for k, f in steps.items():
            t0 = time.perf_counter()
            f()
            wall[k].append(time.perf_counter() - t0)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    out = {
        "model": a.model,
        "params": params,
        "threads": a.threads,
        "users": m,
        "reps": a.reps,
        "nonprivate_s": _median(wall["nonprivate"]),
        "iid_over_nonprivate": _median([x / y for x, y in zip(wall["b1"], wall["nonprivate"], strict=True)]),
    }
    for b in bands:
        r = [x / y for x, y in zip(wall[f"b{b}"], wall["b1"], strict=True)]
        iid_s, mf_s = noise_alone(params, b, a.reps)
        out[f"bands_{b}"] = {
            "over_iid": _median(r),
            "over_iid_range": [round(min(r), 3), round(max(r), 3)],
            "over_nonprivate": _median([x / y for x, y in zip(wall[f"b{b}"], wall["nonprivate"], strict=True)]),
            "noise_alone_s": {"iid": iid_s, "bandmf": mf_s},
        }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
