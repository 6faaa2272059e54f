"""ULS step time on users of real record counts: padded to G (before) against chunks sorted by
record count and trimmed (``engine.user_data.compact_groups``), and a non-private step on as many
real records, all measured in this run.

A ULS unit averages up to G of a user's records; a user with fewer is padded to G with masked
slots. With the blogs corpus' counts (median 11 posts) a third of the slots are padding at
G = 16 and two thirds at G = 64; the per-unit strategies used to compute them all.

    python benchmarks/bench_padding.py           # G = 16 and 64, 32 users a step
    python benchmarks/bench_padding.py --quick   # G = 16, 16 users a step

User record counts: the blogs corpus' (``../shared/data/blogs``) when present, else a lognormal
with its median (11) and spread. Model: the tiny GPT-2 of bench_engine.py (2 layers, 128 wide).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import gpt2_setup, nonprivate_step  # noqa: E402

from userdp.engine import SGD, ULS, FlatClip, TensorUserData, TrainConfig  # noqa: E402
from userdp.engine.performance import Performance
from userdp.engine.run.step import EngineRun  # noqa: E402

warnings.filterwarnings("ignore")
REPO = Path(__file__).resolve().parents[1]
BLOGS = Path(os.environ.get("USERDP_SHARED_DATA", REPO.parent / "shared" / "data")) / "blogs" / "blogs.jsonl.gz"


def user_sizes(n_users: int, rng) -> tuple[np.ndarray, str]:
    """``n_users`` record counts: a sample of the blogs corpus' users, else a lognormal like it."""
    if BLOGS.is_file():
        counts = Counter()
        with gzip.open(BLOGS, "rt") as f:
            for line in f:
                counts[json.loads(line)["user"]] += 1
        all_sizes = np.array(sorted(counts.values()))
        return rng.choice(all_sizes, n_users, replace=False), f"blogs corpus ({len(all_sizes)} users)"
    return np.maximum(1, np.round(rng.lognormal(np.log(11), 1.3, n_users))).astype(np.int64), "lognormal, median 11"


def setup_with_sizes(sizes, seq_len):
    """bench_engine's tiny GPT-2, with users of ``sizes`` records (capped at 128 each to bound memory)."""
    sizes = np.minimum(sizes, 128)
    model, flat, loss_fn = gpt2_setup(int(sizes.sum()), 1, seq_len)
    return model, TensorUserData(flat.tensors, np.concatenate([[0], np.cumsum(sizes)])), loss_fn


def uls_step(model, data, loss_fn, G, M, chunk, compact: bool):
    cfg = TrainConfig(
        algorithm=ULS(G, M / data.num_users),
        steps=10**6,
        clipping=FlatClip(1.0),
        optimizer=SGD(1e-3),
        noise_multiplier=1.0,
        delta=1e-5,
        seed=0,
        sampling="fixed_size",
        accountant="rdp",
        performance=Performance(chunk_size=chunk, track_epsilon=False),
    )
    run = EngineRun(model, data, loss_fn, cfg)
    run.chunks.compact = compact  # False: the padded chunks of before
    return run.run_step


def bench(G, M, chunk, seq_len, n_users, warmup, reps, rng):
    sizes, source = user_sizes(n_users, rng)
    real = float(np.minimum(sizes, G).mean())
    B = max(1, round(M * real))  # the non-private step gets as many real records as a ULS step averages
    steps = {}
    model, data, loss_fn = setup_with_sizes(sizes, seq_len)
    steps["non-private, same real records"] = nonprivate_step(model, data, loss_fn, B, np.random.default_rng(1))
    model, data, loss_fn = setup_with_sizes(sizes, seq_len)
    steps["ULS padded to G (before)"] = uls_step(model, data, loss_fn, G, M, chunk, compact=False)
    model, data, loss_fn = setup_with_sizes(sizes, seq_len)
    steps["ULS sorted + trimmed (now)"] = uls_step(model, data, loss_fn, G, M, chunk, compact=True)
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in steps}
    for _ in range(reps):  # round-robin: load from other processes hits all alike
        for k, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    base, padded = med["non-private, same real records"], med["ULS padded to G (before)"]
    print(
        f"\nG = {G}, {M} users a step, {seq_len} tokens, chunk {chunk}; user sizes: {source}; "
        f"real records per user slot: {real / G:.2f}; median of {reps} round-robin steps"
    )
    print(f"  {'step':34s} {'s/step':>8s} {'x non-private':>14s} {'x padded':>9s}")
    for k, v in med.items():
        print(f"  {k:34s} {v:8.4f} {v / base:14.2f} {v / padded:9.2f}")
    return {"group_size": G, "users": M, "real_fraction": real / G, **{k: v for k, v in med.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1: steadier on a shared box)"
    )
    ap.add_argument("--json", action="store_true", help="also print the rows as one JSON list")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    gs, m, reps = ([16], 16, 5) if a.quick else ([16, 64], 32, 7)
    rows = [bench(G, m, chunk=8, seq_len=32, n_users=2000, warmup=1, reps=reps, rng=rng) for G in gs]
    print(f"\ndevice cpu, {a.threads} thread(s), torch {torch.__version__}")
    if a.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
