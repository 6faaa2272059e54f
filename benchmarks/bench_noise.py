"""The host noise, against numpy's generator, in one process, interleaved (issue 63).

Two figures, each against a baseline measured in the same run on the same threads:

* **the kernel**: ``ziggurat.fill`` turning words into float32 normals, one thread, each call on
  words it has not seen (a branch predictor learns a block's rejects when the same words come back,
  which flatters the kernel by 20-40%), against numpy's ``Generator(PCG64DXSM).standard_normal``
  (float32) filling as many. Both are numpy's ziggurat; the kernel's words come from elsewhere.
* **the draw**: ``GaussianNoise.add_`` of N(0, std²) to ``--numel`` float32 sums (124M: gpt2-small),
  on ``--threads`` threads, against the same draw made as 0.9 made it: numpy's generator in 16
  streams on the same threads, each piece scaled and added by torch (``mul_``, then ``add_``). Also
  printed: the memory floor, torch adding one tensor of that size to another (``add_``).

    python benchmarks/bench_noise.py --threads 2
    python benchmarks/bench_noise.py --quick      # 16M sums, 3 repetitions

Prints one JSON line: seconds (median of the repetitions, [min, max]) and the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor


def _median(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=124_000_000, help="sums the draw is added to")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7, help="interleaved repetitions")
    ap.add_argument("--quick", action="store_true", help="16M sums, 3 repetitions (benchmarks/run.py --quick)")
    a = ap.parse_args(argv)
    if a.quick:
        a.numel, a.reps = min(a.numel, 16_000_000), min(a.reps, 3)
    import numpy as np
    import torch

    from userdp.engine.noise import gaussian, ziggurat
    from userdp.engine.noise.flat import add_piece, flat_views

    torch.set_num_threads(a.threads)

    # ---------------------------------------------------------------- the kernel, one thread
    n = 1 << 16
    rng = np.random.default_rng(0)
    words = [rng.integers(0, 2**32, n + n // 16 + 64, dtype=np.uint32) for _ in range(64)]
    out = np.empty(n, np.float32)
    scratch = ziggurat.new_scratch()
    numpy_gen = np.random.Generator(np.random.PCG64DXSM(1))
    ziggurat.fill(words[0], out, scratch=scratch)  # compiled (or loaded from numba's cache)
    kernel, numpy_draw = [], []
    for _ in range(a.reps):
        t = time.perf_counter()
        for w in words:
            ziggurat.fill(w, out, scratch=scratch)
        kernel.append((time.perf_counter() - t) / (len(words) * n) * 1e9)
        t = time.perf_counter()
        for _ in words:
            numpy_gen.standard_normal(out=out, dtype=np.float32)
        numpy_draw.append((time.perf_counter() - t) / (len(words) * n) * 1e9)

    # ---------------------------------------------------------------- the draw, added to the sums
    sums = [torch.zeros(a.numel // 4) for _ in range(4)]
    flat = torch.cat([s.view(-1) for s in sums])  # one tensor as large, for the memory floor
    ones = torch.ones_like(flat)
    source = gaussian.GaussianNoise.from_seed(5)
    streams = [np.random.Generator(np.random.PCG64DXSM(s)) for s in np.random.SeedSequence(5).spawn(16)]
    total = sum(s.numel() for s in sums)
    bounds = np.linspace(0, total, 17).astype(np.int64)
    flats, offsets = flat_views(sums)
    pool = ThreadPoolExecutor(max_workers=a.threads) if a.threads > 1 else None

    def numpy_block(k: int) -> None:  # 0.9's draw: numpy's generator, torch's scale and add
        lo, hi = int(bounds[k]), int(bounds[k + 1])
        buf = np.empty(min(gaussian._PIECE, hi - lo), np.float32)
        while lo < hi:
            piece = buf[: min(gaussian._PIECE, hi - lo)]
            streams[k].standard_normal(out=piece, dtype=np.float32)
            add_piece(flats, offsets, torch.from_numpy(piece).mul_(0.5), lo)
            lo += piece.size

    def numpy_add() -> None:
        if pool is None:
            for k in range(16):
                numpy_block(k)
        else:
            list(pool.map(numpy_block, range(16)))

    source.add_(sums, 0.5)  # the kernels compiled, the streams' buffers made
    numpy_add()
    draw, baseline, floor = [], [], []
    for _ in range(a.reps):
        for fn, into in (
            (lambda: source.add_(sums, 0.5), draw),
            (numpy_add, baseline),
            (lambda: flat.add_(ones), floor),
        ):
            t = time.perf_counter()
            fn()
            into.append(time.perf_counter() - t)
    if pool is not None:
        pool.shutdown()
    print(
        json.dumps(
            {
                "kernel_ns_per_normal": _median(kernel),
                "numpy_ns_per_normal": _median(numpy_draw),
                "kernel_over_numpy": round(
                    statistics.median(k / b for k, b in zip(kernel, numpy_draw, strict=True)), 3
                ),
                "numel": total,
                "threads": a.threads,
                "draw_s": _median(draw),
                "numpy_draw_s": _median(baseline),
                "draw_over_numpy": round(statistics.median(d / b for d, b in zip(draw, baseline, strict=True)), 3),
                "memory_floor_s": _median(floor),
                "draw_over_floor": round(statistics.median(d / f for d, f in zip(draw, floor, strict=True)), 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
