"""bench_scale says how sure it is (issue 42): interleaved repetitions give the median and the
spread of each ratio, with the machine they were taken on. Nothing is timed here."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
try:
    import bench_scale as B
finally:
    sys.path.pop(0)


def test_repetitions_give_the_median_and_the_spread_of_each_ratio():
    def row(alg, s, ratio):
        return {"model": "m", "mode": "full", "algorithm": alg, "group_size": 4, "s_per_step": s,
                "time_ratio": ratio, "memory_ratio": 1.0, "peak_bytes": 10, "error": None}
    rounds = [[row("nonprivate", 1.0, 1.0), row("uls", 1.3, 1.3)],
              [row("nonprivate", 1.1, 1.0), row("uls", 1.7, 1.55)],
              [row("nonprivate", 0.9, 1.0), row("uls", 1.2, 1.33)]]
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

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import bench_cpu_step
    finally:
        sys.path.pop(0)
    import userdp.engine.noise as noise_mod

    drawn = []
    monkeypatch.setattr(noise_mod.GaussianNoise, "add_", lambda self, t, std: drawn.append(1) or t)
    monkeypatch.setattr(noise_mod.GaussianNoise, "prefetch", lambda self, n, d: drawn.append(1) or False)
    argv = ["--model", "tiny", "--vocab", "64", "--seq-len", "8", "--reps", "2"]
    assert bench_cpu_step.main(argv + ["--no-noise"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert drawn == [] and out["noise"] is False and out["root"] == str(Path(__file__).resolve().parents[1])
    for alg in ("uls", "els"):
        lo, hi = out[alg]["time_range"]
        assert out[alg]["time"] > 0 and lo <= out[alg]["time"] <= hi
    assert bench_cpu_step.main(argv) == 0  # with the noise: drawn every DP step (3 untimed + 2 x 2 timed)
    assert len(drawn) >= 2 * 3
