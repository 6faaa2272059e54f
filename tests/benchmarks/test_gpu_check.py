"""The GPU check (benchmarks/gpu/run.sh -> benchmarks/gpu/check.py) cannot come back empty on the
bare GPU box (issue 35): these tests emulate the box on the CPU."""

import json
import os
import subprocess
import sys
import time

import pytest
from _paths import REPO

CHECK = REPO / "benchmarks" / "gpu" / "check.py"


def _run(args, tmp_path, env_extra=None, timeout=600):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(
        [sys.executable, str(CHECK), *args, "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


def _rows(tmp_path):
    p = tmp_path / "out" / "rows.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.is_file() else []


@pytest.mark.heavy(
    counterpart="tests/benchmarks/test_gpu_check.py::test_the_preparation_in_docs_names_the_command_and_the_wheels_the_box_lacks"
)
def test_a_missing_package_is_one_line_naming_the_wheel_within_seconds(tmp_path):
    """The box has no dp-accounting: the preflight says so and which wheel to carry, exit 3."""
    block = tmp_path / "block"
    block.mkdir()
    (block / "dp_accounting.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'dp_accounting'\", name='dp_accounting')\n"
    )
    t0 = time.time()
    res = _run(
        ["--device", "cpu", "--quick"],
        tmp_path,
        {"PYTHONPATH": str(block) + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    assert res.returncode == 3
    lines = [x for x in res.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "dp_accounting" in lines[0] and "dp-accounting==0.6.0" in lines[0], res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert time.time() - t0 < 120
    assert not _rows(tmp_path)


@pytest.mark.heavy(
    counterpart="tests/benchmarks/test_gpu_check.py::test_the_preparation_in_docs_names_the_command_and_the_wheels_the_box_lacks"
)
def test_a_failing_and_a_hanging_part_leave_the_other_rows_and_no_process(tmp_path):
    """env forced to fail, chacha forced to hang (with a child of its own): both recorded, the
    tests part still runs and writes its row, and the hung part's child is gone (process group)."""
    # 10 s a part: the hang's cost; the tests part needs ~3 s here (pytest skipping tests/benchmarks/test_cuda.py)
    res = _run(
        ["--device", "cpu", "--quick", "--parts", "env,chacha,tests", "--part-budget", "10"],
        tmp_path,
        {"USERDP_GPU_CHECK_FAULT": "env:fail,chacha:hang"},
    )
    assert res.returncode == 1, res.stdout + res.stderr
    rows = _rows(tmp_path)
    status = {r["part"]: r["status"] for r in rows if "status" in r}
    assert status["env"].startswith("failed") and "forced failure" in status["env"]
    assert status["chacha"].startswith("timeout")
    assert status["tests"] == "ok"
    assert any(r.get("part") == "tests" and "summary" in r for r in rows)
    child = next(r["hang_child"] for r in rows if "hang_child" in r)
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


def test_the_preparation_in_docs_names_the_command_and_the_wheels_the_box_lacks():
    """docs/gpus.md's preparation is what the check needs: the one command, the carried folder, and
    a download line for every package the box lacks (dp-accounting; the rest is on its image)."""
    sys.path.insert(0, str(CHECK.parent))
    try:
        import check as gc
    finally:
        sys.path.pop(0)
    doc = (REPO / "docs" / "gpus.md").read_text()
    assert "bash benchmarks/gpu/run.sh" in doc and 'carry=[".whl"]' in doc
    on_the_box = {
        "torch",
        "numpy",
        "scipy",
        "transformers",
        "peft",
        "safetensors",
        "tokenizers",
        "yaml",
        "absl",
        "attr",
        "mpmath",
    }  # the device image's package list (KINDS.md)
    for mod, wheel in gc.REQUIRED.items():
        if mod not in on_the_box:
            assert wheel and f"-d .whl {wheel}" in doc, mod
    assert "/.whl/" in (REPO / ".gitignore").read_text()


@pytest.mark.heavy(
    counterpart="tests/benchmarks/test_bench_scale.py::test_the_in_process_comparison_runs_a_checkout_and_leaves_the_noise_out"
)
@pytest.mark.slow
def test_the_whole_check_runs_end_to_end_on_the_cpu(tmp_path):
    # every part but steps-medium, which is steps-small's code on a larger model (its processes are
    # ~25 s of start-up on this CPU and prove nothing steps-small does not), and tests, whose "ok" row
    # the failing-and-hanging test above already asserts; --parts is honoured
    parts = ["env", "chacha", "steps-small", "lora", "fsdp"]
    res = _run(["--device", "cpu", "--quick", "--parts", ",".join(parts)], tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    rows = _rows(tmp_path)
    status = {r["part"]: r["status"] for r in rows if "status" in r}
    assert set(status) == set(parts)
    assert all(v == "ok" for v in status.values()), status
    steps = {r["algorithm"]: r for r in rows if r.get("part") == "steps-small" and "algorithm" in r}
    assert set(steps) == {"nonprivate", "uls", "els", "uls:split"}  # the last: the tensor cores' exact split operand
    for alg in ("uls", "els", "uls:split"):
        assert steps[alg]["time_ratio"] > 0 and steps[alg]["per_unit"] == "ghost"
        assert steps[alg]["syncs_per_step"] in (0, None)  # the split row is not profiled
    assert steps["uls"]["syncs_per_step"] == 0 and steps["els"]["syncs_per_step"] == 0
    lora = [r for r in rows if r.get("part") == "lora" and "s_per_step" in r]
    assert {r["model"] for r in lora} == {"tiny", "llama-tiny"}
    assert any(r.get("kernel", "").startswith("eager (cpu") for r in rows if r.get("part") == "chacha")
    fsdp = {r["sharding"]: r for r in rows if r.get("part") == "fsdp" and "sharding" in r}
    assert set(fsdp) == {"none", "fsdp"} and fsdp["fsdp"]["backend"] == "gloo"  # W = 1, a process group of one
    assert fsdp["fsdp"]["state_bytes_per_rank"] == fsdp["none"]["state_bytes_per_rank"]  # 1/W of it at W = 1
    assert "[" in res.stdout and "done: 5/5 parts ok" in res.stdout  # progress printed as it goes
