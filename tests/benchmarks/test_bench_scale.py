"""bench_scale says how sure it is (issue 42): interleaved repetitions give the median and the
spread of each ratio, with the machine they were taken on. Nothing is timed here."""

import sys

from _paths import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
try:
    import bench_scale as B
finally:
    sys.path.pop(0)


def test_repetitions_give_the_median_and_the_spread_of_each_ratio():
    def row(alg, s, ratio):
        return {
            "model": "m",
            "mode": "full",
            "algorithm": alg,
            "group_size": 4,
            "s_per_step": s,
            "time_ratio": ratio,
            "memory_ratio": 1.0,
            "peak_bytes": 10,
            "error": None,
        }

    rounds = [
        [row("nonprivate", 1.0, 1.0), row("uls", 1.3, 1.3)],
        [row("nonprivate", 1.1, 1.0), row("uls", 1.7, 1.55)],
        [row("nonprivate", 0.9, 1.0), row("uls", 1.2, 1.33)],
    ]
    rows = B._aggregate(rounds, {"cpu": "x"})
    uls = rows[1]
    assert uls["repeats"] == 3 and uls["time_ratio"] == 1.33
    assert (uls["time_ratio_min"], uls["time_ratio_max"]) == (1.3, 1.55)
    assert uls["s_per_step"] == 1.3 and uls["machine"] == {"cpu": "x"}


def test_the_machine_is_described():
    m = B._machine(1)
    assert m["cpu"] and m["cores"] >= 1 and m["threads"] == 1 and len(m["load_average_start"]) == 3
    assert set(m["flags"]) <= {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}


def test_the_in_process_comparison_runs_a_checkout_and_leaves_the_noise_out(capsys, monkeypatch):
    """bench_cpu_step (issue 42's bisect): the non-private, ULS and ELS steps of one process, of the
    checkout it is pointed at; with --no-noise neither the draw nor its draw-ahead runs."""
    import json

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_cpu_step
    finally:
        sys.path.pop(0)
    import userdp.engine.noise.gaussian as noise_mod

    drawn = []
    monkeypatch.setattr(noise_mod.GaussianNoise, "add_", lambda self, t, std: drawn.append(1) or t)
    monkeypatch.setattr(noise_mod.GaussianNoise, "prefetch", lambda self, n, d: drawn.append(1) or False)
    argv = ["--model", "tiny", "--vocab", "64", "--seq-len", "8", "--reps", "2"]
    assert bench_cpu_step.main(argv + ["--no-noise"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert drawn == [] and out["noise"] is False and out["root"] == str(REPO)
    for alg in ("uls", "els"):
        lo, hi = out[alg]["time_range"]
        assert out[alg]["time"] > 0 and lo <= out[alg]["time"] <= hi
    assert bench_cpu_step.main(argv) == 0  # with the noise: drawn every DP step (3 untimed + 2 x 2 timed)
    assert len(drawn) >= 2 * 3


def test_the_peak_is_read_from_an_allocator_trace_by_allocation_site():
    """The GPU check's memory snapshot (one ULS step with CUDA's allocator history): replayed on the
    CPU, the live blocks at the peak are grouped by their first userdp frame, largest first."""

    def alloc(addr, size, filename, line, name="f"):
        return {
            "action": "alloc",
            "addr": addr,
            "size": size,
            "frames": [
                {"filename": "/torch/x.py", "line": 1, "name": "t"},
                {"filename": f"/src/userdp/engine/{filename}", "line": line, "name": name},
            ],
        }

    mib = 2**20
    trace = [
        alloc(1, 100 * mib, "ghost.py", 10, "split"),
        alloc(2, 50 * mib, "loop.py", 5),
        {"action": "free_completed", "addr": 1},
        alloc(3, 30 * mib, "ghost.py", 10, "split"),
        alloc(4, 40 * mib, "ghost.py", 10, "split"),
        alloc(5, 60 * mib, "noise.py", 7),
        {"action": "free_completed", "addr": 5},
        {"action": "free_requested", "addr": 4},
        alloc(6, 1 * mib, "loop.py", 9),
    ]
    out = B.peak_composition(trace)
    assert out["peak_traced_bytes"] == 180 * mib  # 50 + 30 + 40 + 60, not the 100 freed before
    assert out["peak_live"] == ["70.0 MiB x2 ghost.py:10 split", "60.0 MiB x1 noise.py:7 f", "50.0 MiB x1 loop.py:5 f"]
