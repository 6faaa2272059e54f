"""benchmarks/gpu_check.py runs end to end on the CPU (``--device cpu --quick``), so the one
command a GPU session runs cannot rot between the sessions that have a GPU (issue 27)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_runs_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "gc.json"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--quick",
                          "--no-tests", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["ok"] and rep["environment"]["device"] == "cpu"
    assert rep["chacha"]["kernel"].startswith("eager (cpu") and len(rep["chacha"]["draws"]) == 2
    steps = {r["algorithm"]: r for r in rep["steps"]}
    assert set(steps) == {"nonprivate", "uls", "els"}
    for alg in ("uls", "els"):
        r = steps[alg]
        assert r["time_ratio"] > 0 and r["memory_ratio"] > 0 and r["per_unit"] == "ghost"
        assert r["profile"]["ops"] > 0 and r["profile"]["stream_synchronize"] == 0
    assert "NOT PRIVATE-SAFE" in rep["tf32_ceiling"]["label"] and rep["tf32_ceiling"]["s_per_step"] > 0
    assert rep["distributed"]["world_size"] == 1
    assert "[" in res.stdout and "wrote" in res.stdout  # progress printed as it goes
