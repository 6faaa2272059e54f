"""Everything userdp needs to show on a GPU, in one command that installs nothing (issue 27).

    python benchmarks/gpu_check.py                      # on one H100/H200: under 9 minutes
    python benchmarks/gpu_check.py --device cpu --quick # the same path on a CPU, small (CI keeps it alive)

It prints progress as it goes and writes one JSON file (``--out``, default ``gpu_check.json``):

1. ``environment``: torch, the device, CUDA.
2. ``cuda_tests``: ``pytest tests/test_cuda.py`` plus the CPU proofs of the same properties
   (tensor-core arithmetic, device discipline, ChaCha), with their pass/fail counts.
3. ``chacha``: the noise kernel's status (``compiled`` or ``eager (reason)``) and the time of one
   draw of 124M and 355M normals (gpt2-small's and gpt2-medium's parameter counts).
4. ``steps``: ``bench_scale`` workers, each in its own process, for gpt2-small and gpt2-medium in
   bf16 with 64 users x 64 tokens a step: non-private, ULS G = 4 and ELS; time and peak-memory
   ratios against the non-private step of the same run, and a ``torch.profiler`` pass (top ops,
   ``cudaStreamSynchronize`` and ``cudaMemcpy`` calls per step).
5. ``tf32_ceiling``: the ULS step with its norms and sums in TF32 — labelled NOT PRIVATE-SAFE, a
   ceiling on speed, never a mode of userdp.
6. ``fit``: ``bench_scale --fit 80 --fit-check`` (the auto chunk's memory model against a measured
   peak).
7. ``distributed``: ``bench_distributed`` at W = 1.

A step that fails is recorded with its error and the check goes on; the exit status is 1 when any
failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
T0 = time.time()


def _say(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f} s] {msg}", flush=True)


def _run(cmd: list[str], timeout: int) -> tuple[int, str, str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                             env=dict(os.environ, PYTHONWARNINGS="ignore"))
        return out.returncode, out.stdout, out.stderr
    except subprocess.TimeoutExpired as exc:
        return 124, exc.stdout or "", f"timed out after {timeout} s"


def _environment(device: str) -> dict:
    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(), "device": device,
           "machine": platform.machine(), "cpu_count": os.cpu_count()}
    if device.startswith("cuda"):
        env.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                   memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    return env


def _tests(timeout: int) -> dict:
    files = ["tests/test_cuda.py", "tests/test_engine_tensor_cores.py", "tests/test_engine_device_discipline.py",
             "tests/test_engine_chacha.py"]
    rc, out, err = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files], timeout)
    tail = (out.strip().splitlines() or [err.strip()])[-1]
    return {"files": files, "exit": rc, "summary": tail}


def _chacha(device: str, counts: list[int]) -> dict:
    import torch

    from userdp.engine.chacha import ChaChaNoise

    dev = torch.device(device)
    src = ChaChaNoise(12345, seeded=True)
    status = src.prepare(dev)
    out = {"kernel": status, "draws": []}
    for n in counts:
        z = [torch.zeros(n, device=dev)]
        src.add_(z, 1.0)  # once untimed
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        src.add_(z, 1.0)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        out["draws"].append({"normals": n, "s": round(time.perf_counter() - t0, 4)})
        del z
    return out


def _worker(args: list[str], timeout: int) -> dict:
    rc, out, err = _run([sys.executable, os.path.join(HERE, "bench_scale.py"), "--worker", *args], timeout)
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": (err.strip().splitlines() or [f"exit {rc}, no output"])[-1][:300]}


def _steps(a, models: list[str]) -> tuple[list[dict], dict]:
    rows, ceiling = [], {}
    common = ["--device", a.device, "--dtype", a.dtype, "--users", str(a.users), "--seq-len", str(a.seq_len),
              "--vocab", str(a.vocab), "--reps", str(a.reps), "--warmup", str(a.warmup), "--threads",
              str(os.cpu_count() or 1), "--profile"]
    for model in models:
        base = None
        for alg in ("nonprivate", "uls", "els"):
            _say(f"steps: {model} {alg} ({a.dtype}, {a.users} users x G = 4 x {a.seq_len} tokens) ...")
            res = _worker(["--model", model, "--algorithm", alg, "--group-size", "4", *common], a.timeout)
            row = {"model": model, "algorithm": alg, "group_size": 4, **res}
            if alg == "nonprivate":
                base = res
            if base and "s_per_step" in res and "s_per_step" in base:
                row["time_ratio"] = res["s_per_step"] / base["s_per_step"]
                row["memory_ratio"] = res["peak_bytes"] / base["peak_bytes"]
            rows.append(row)
            _say(f"  -> {row.get('s_per_step', float('nan')):.4f} s/step, time x{row.get('time_ratio', float('nan')):.2f}, "
                 f"memory x{row.get('memory_ratio', float('nan')):.2f}, syncs "
                 f"{(row.get('profile') or {}).get('stream_synchronize')} {row.get('error') or ''}")
        if model == models[0]:
            _say(f"tf32 ceiling (NOT PRIVATE-SAFE): {model} uls ...")
            res = _worker(["--model", model, "--algorithm", "uls", "--group-size", "4", "--tf32-ceiling", *common],
                          a.timeout)
            ceiling = {"label": "NOT PRIVATE-SAFE: norms and clipped sums in TF32 (a speed ceiling only)",
                       "model": model, **res}
            if base and "s_per_step" in res and "s_per_step" in base:
                ceiling["time_ratio"] = res["s_per_step"] / base["s_per_step"]
    return rows, ceiling


def _fit(a) -> dict:
    cap = "80" if a.device.startswith("cuda") else "8"
    _say(f"fit: bench_scale --fit {cap} --fit-check ...")
    rc, out, err = _run([sys.executable, os.path.join(HERE, "bench_scale.py"), "--fit", cap, "--fit-check", "--json",
                         "--device", a.device, "--dtype", a.dtype, "--seq-len", str(a.seq_len)], a.timeout)
    try:
        rows = json.loads(out.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": (err.strip().splitlines() or [f"exit {rc}"])[-1][:300]}
    return {"cap_gib": float(cap), "check": [r for r in rows if r.get("fit_check")],
            "chunks": [{k: r.get(k) for k in ("model", "mode", "algorithm", "chunk")} for r in rows
                       if not r.get("fit_check")]}


def _distributed(a) -> dict:
    _say("distributed: bench_distributed W = 1 ...")
    args = ["--nproc", "1", "--device", "cuda" if a.device.startswith("cuda") else "cpu", "--dtype", a.dtype,
            "--json", "--steps", "3" if a.quick else "5"]
    if a.quick:
        args.append("--quick")
    rc, out, err = _run([sys.executable, os.path.join(HERE, "bench_distributed.py"), *args], a.timeout)
    try:
        return json.loads(out.strip().splitlines()[-1])[0]
    except (IndexError, json.JSONDecodeError, KeyError):
        return {"error": (err.strip().splitlines() or [f"exit {rc}"])[-1][:300]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="small sizes (a CPU run that keeps the script alive)")
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--timeout", type=int, default=240, help="seconds per sub-run")
    p.add_argument("--no-tests", action="store_true", help="skip step 2 (the test suite runs those files already)")
    a = p.parse_args(argv)
    gpu = a.device.startswith("cuda")
    if gpu:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here; run with --device cpu --quick", file=sys.stderr)
            return 2
    a.dtype = "bfloat16" if gpu else "float32"  # CPU autocast bf16 is slow and not what this checks
    a.users, a.seq_len = (64, 64) if not a.quick else (2, 16)
    a.vocab = 50257 if not a.quick else 512
    a.reps, a.warmup = (5, 2) if not a.quick else (1, 1)
    models = ["gpt2-small", "gpt2-medium"] if not a.quick else ["tiny"]
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _say("environment ...")
    report["environment"] = _environment(a.device)
    if a.no_tests:
        report["cuda_tests"] = {"exit": 5, "summary": "skipped (--no-tests)"}
    else:
        _say("tests (CUDA tests skip without a GPU) ...")
        report["cuda_tests"] = _tests(a.timeout * 2)
        _say(f"  -> {report['cuda_tests']['summary']}")
    _say("chacha: build and draw ...")
    report["chacha"] = _chacha(a.device, [124_000_000, 355_000_000] if not a.quick else [100_000, 300_000])
    _say(f"  -> {report['chacha']['kernel']}; " + ", ".join(f"{d['normals']:,} in {d['s']} s"
                                                          for d in report["chacha"]["draws"]))
    report["steps"], report["tf32_ceiling"] = _steps(a, models)
    report["fit"] = _fit(a) if not a.quick else {"skipped": "--quick"}
    report["distributed"] = _distributed(a)
    report["seconds"] = round(time.time() - T0, 1)
    failed = (report["cuda_tests"]["exit"] not in (0, 5) or any("error" in r for r in report["steps"])
              or "error" in report["distributed"] or "error" in report["fit"])
    report["ok"] = not failed
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    _say(f"wrote {a.out} ({'ok' if not failed else 'with failures'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
