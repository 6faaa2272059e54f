"""userdp's GPU check: every figure a GPU session must bring back, in one command that cannot come
back empty (issue 35).

    bash benchmarks/gpu/run.sh                          # on the GPU box (carried wheels, then this)
    python benchmarks/gpu/check.py --device cpu --quick # the same path on a CPU, small (CI runs it)

How it is built so that a bare, offline box with a 10-minute limit still returns figures:

* **Preflight first** (seconds): the packages userdp imports are imported once in a child process;
  a missing one ends the check with one line naming it and the wheel to carry (docs/gpus.md,
  "The GPU check"), exit 3.
* **Parts, each in its own process group with its own budget** (``PARTS``): a part that fails or
  runs out of time is killed with everything it started and recorded as such; the next part
  still runs. The whole check stops starting parts when its budget (``--budget``, 480 s) is spent.
* **Rows as they come**: each part prints its rows as ``ROW {json}`` lines; this process appends
  each to ``rows.jsonl`` in the output folder the moment it arrives and prints the figure, so a
  kill at the box's limit loses at most the row being measured.

Rows: the environment (driver, torch, CUDA, triton, transformers, peft, dp-accounting); the noise
kernel's status and draw time at 124M / 355M normals; non-private / ULS G = 4 / ELS at
gpt2-small and gpt2-medium, bf16, 64 users x 64 tokens (time and peak memory ratios against the
non-private step measured in the same part, host syncs per step); LoRA r = 8 at gpt2-small and a
~1.1B Llama-shaped model; ``tests/benchmarks/test_cuda.py``; FSDP2 on the one GPU (NCCL, W = 1) against the
replicated run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SRC = os.path.join(ROOT, "src")

#: module -> the wheel to carry when it is missing on the box (pure-Python wheels, docs/gpus.md)
REQUIRED = {
    "torch": None,
    "numpy": None,
    "scipy": None,
    "transformers": None,
    "peft": None,
    "safetensors": None,
    "tokenizers": None,
    "yaml": "pyyaml",
    "dp_accounting": "dp-accounting==0.6.0",
    "absl": "absl-py",
    "attr": "attrs",
    "mpmath": "mpmath",
}

#: name -> (budget in seconds, what it measures); run in this order
PARTS = {
    "env": (30, "versions"),
    "chacha": (150, "the noise kernel: compile status, draws at 124M / 355M normals"),
    "steps-small": (
        170,
        "gpt2-small: non-private, ULS G=4, ELS, ULS with the split operand (bf16, 64 users x 64 tokens)",
    ),
    "tests": (90, "pytest tests/benchmarks/test_cuda.py"),
    "lora": (150, "LoRA r=8: gpt2-small and a 1.1B Llama shape, non-private and ULS"),
    "steps-medium": (180, "gpt2-medium: non-private, ULS G=4, ELS"),
    "fsdp": (150, "FSDP2 on one GPU (NCCL, W = 1) against the replicated run: step time, per-rank state"),
}


def _env() -> dict:
    return dict(
        os.environ,
        PYTHONPATH=SRC + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""),
        PYTHONUNBUFFERED="1",
        PYTHONWARNINGS="ignore",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )


def preflight(timeout: float = 60.0) -> str | None:
    """None when everything userdp needs imports here; else the one line to print."""
    code = (
        "import importlib, sys\n"
        f"for m in {list(REQUIRED)!r}:\n"
        "    try:\n        importlib.import_module(m)\n"
        "    except ImportError as e:\n        print('MISSING', m, e); sys.exit(3)\n"
        "import userdp.engine, userdp.lm.models\n"
    )
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=_env())
    except subprocess.TimeoutExpired:
        return f"gpu check: importing userdp's packages took over {timeout:.0f} s"
    if out.returncode == 0:
        return None
    line = next((x for x in out.stdout.splitlines() if x.startswith("MISSING")), None)
    if line is None:
        err = (out.stderr.strip().splitlines() or ["no message"])[-1]
        return f"gpu check: userdp does not import here: {err}"
    mod = line.split()[1]
    wheel = REQUIRED.get(mod) or mod
    return (
        f"gpu check: the package {mod!r} is missing on this machine: carry its wheel "
        f"(python3 -m pip download --no-deps --only-binary=:all: -d .whl {wheel}; docs/gpus.md, 'The GPU check')"
    )


# ------------------------------------------------------------------------------------------ parts
def _row(**kw) -> None:
    print("ROW " + json.dumps(kw, default=str), flush=True)


def _fault(name: str) -> None:
    """Test hook (USERDP_GPU_CHECK_FAULT=part:fail,part:hang): make a part fail or hang."""
    for item in filter(None, os.environ.get("USERDP_GPU_CHECK_FAULT", "").split(",")):
        part, _, kind = item.partition(":")
        if part == name and kind == "fail":
            raise RuntimeError(f"forced failure of part {name}")
        if part == name and kind == "hang":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
            _row(part=name, hang_child=child.pid)
            time.sleep(3600)


def part_env(a) -> None:
    import importlib.metadata as md
    import platform

    import torch

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": a.device,
        "cpu_count": os.cpu_count(),
    }
    for d in ("triton", "transformers", "peft", "dp-accounting", "numpy", "scipy"):
        try:
            out[d] = md.version(d)
        except md.PackageNotFoundError:
            out[d] = None
    if a.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, memory_gib=round(p.total_memory / 2**30, 1), sm=f"{p.major}{p.minor}")
        try:
            out["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            out["driver"] = None
    _row(part="env", **out)


def part_chacha(a) -> None:
    import torch

    from userdp.engine.noise.chacha import ChaChaNoise, compile_kernel

    dev = torch.device(a.device)
    t0 = time.perf_counter()
    status = compile_kernel(dev)[1]
    _row(part="chacha", kernel=status, build_s=round(time.perf_counter() - t0, 1))
    src = ChaChaNoise(12345, seeded=True)
    for n in (100_000, 300_000) if a.quick else (124_000_000, 355_000_000):
        z = [torch.zeros(n, device=dev)]
        src.add_(z, 1.0)  # once untimed
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        src.add_(z, 1.0)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        _row(part="chacha", normals=n, draw_s=round(time.perf_counter() - t0, 4), kernel=status)
        del z


def _worker(a, args: list[str]) -> dict:
    """One bench_scale configuration in its own process (its peak memory its own), forked from this
    part's process once it has imported torch and userdp (bench_scale.preload: ~6 s of imports
    saved per configuration); in this part's process group, so a timeout kills it with the part."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import bench_scale
    finally:
        sys.path.pop(0)
    return bench_scale._run_worker(args, fork=True)


def _common(a) -> list[str]:
    users, seq, vocab, reps, warm = (2, 16, 512, 1, 1) if a.quick else (64, 64, 50257, 5, 2)
    return [
        "--device",
        a.device,
        "--dtype",
        "bfloat16" if a.device == "cuda" else "float32",
        "--users",
        str(users),
        "--seq-len",
        str(seq),
        "--vocab",
        str(vocab),
        "--reps",
        str(reps),
        "--warmup",
        str(warm),
        "--threads",
        str(os.cpu_count() or 1),
        "--group-size",
        "4",
    ]


def _series(a, part: str, model: str, mode: str, algorithms, profile: bool) -> None:
    """Each of ``algorithms`` in its own process, ratios against the first (non-private); an entry
    "uls:split" is ULS with the exact split tensor-core operand (``contraction.SUM_OPERAND``; the default
    is the rounded one), unprofiled: what the rounded operand saves."""
    base = None
    for entry in algorithms:
        alg, _, operand = entry.partition(":")
        args = ["--model", model, "--mode", mode, "--lora-rank", "8", "--algorithm", alg, *_common(a)]
        if operand:
            args += ["--sum-operand", operand]
        if profile and not operand:
            args.append("--profile")
        if (
            profile and not operand and alg == "uls"
        ):  # what a DP step's peak holds, by allocation site (the memory model's check)
            args.append("--memory-snapshot")
        r = _worker(a, args)
        if alg == "nonprivate":
            base = r
        if base and "s_per_step" in r and "s_per_step" in base:
            r["time_ratio"] = r["s_per_step"] / base["s_per_step"]
            r["memory_ratio"] = r["peak_bytes"] / base["peak_bytes"]
        prof = r.pop("profile", None) or {}
        _row(
            part=part,
            model=model,
            mode=mode,
            algorithm=entry,
            **r,
            syncs_per_step=prof.get("stream_synchronize"),
            memcpy_per_step=prof.get("memcpy"),
            top_ops=[f"{o['ms']} ms x{o['count']} {o['name'][:90]}" for o in prof.get("top_ops", [])] or None,
            top_shapes=[f"{o['ms']} ms x{o['count']} {o['name'][:160]}" for o in prof.get("top_shapes", [])] or None,
        )


def part_steps_small(a) -> None:
    _series(
        a, "steps-small", "tiny" if a.quick else "gpt2-small", "full", ("nonprivate", "uls", "els", "uls:split"), True
    )


def part_steps_medium(a) -> None:
    _series(a, "steps-medium", "small" if a.quick else "gpt2-medium", "full", ("nonprivate", "uls", "els"), True)


def part_lora(a) -> None:
    _series(a, "lora", "tiny" if a.quick else "gpt2-small", "lora", ("nonprivate", "uls"), False)
    _series(a, "lora", "llama-tiny" if a.quick else "llama-1b", "lora", ("nonprivate", "uls"), False)


def part_tests(a) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rsf",
            "--tb=line",
            os.path.join(ROOT, "tests", "tests/benchmarks/test_cuda.py"),
        ],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
    )
    lines = out.stdout.strip().splitlines()
    tail = (lines or [out.stderr.strip()])[-1]
    # a failure names its test and its assertion (one line each): a summary alone cannot be acted on
    failed = [x[:300] for x in lines if x.startswith("FAILED") or (x.startswith("/") and "Error" in x)]
    _row(part="tests", exit=out.returncode, summary=tail, failed=failed or None)


def part_fsdp(a) -> None:
    """benchmarks/bench_distributed.py at W = 1 (a one-GPU box can hold no more: NCCL refuses two
    ranks on one device), sharded and not, Adam: the sharded path on NCCL, its overhead at W = 1."""
    size = (
        ["--model", "tiny", "--users", "32", "--cohort", "8", "--steps", "2", "--warmup", "1", "--vocab", "512"]
        if a.quick
        else [
            "--model",
            "gpt2-small",
            "--users",
            "256",
            "--cohort",
            "64",
            "--steps",
            "5",
            "--vocab",
            "50257",
            "--dtype",
            "bfloat16",
        ]
    )
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "bench_distributed.py"),
            "--json",
            "--nproc",
            "1",
            "--device",
            a.device,
            "--sharding",
            "none,fsdp",
            "--optimizer",
            "adam",
            "--chunk",
            "64" if not a.quick else "8",
            *size,
        ],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
    )
    if out.returncode != 0:
        raise SystemExit(f"bench_distributed failed: {(out.stderr.strip().splitlines() or ['no message'])[-1][:300]}")
    for r in json.loads(out.stdout.strip().splitlines()[-1]):
        _row(
            part="fsdp",
            model=r["model"],
            sharding=r["sharding"],
            backend=r["backend"],
            world_size=r["world_size"],
            s_per_step=r["step_s"],
            time_ratio=round(1 / r["speedup_vs_1"], 3),
            state_bytes_per_rank=r["state_bytes_per_rank"],
            noise_draw_s=r["noise_draw_s"],
        )


PART_FUNCS = {
    "env": part_env,
    "chacha": part_chacha,
    "steps-small": part_steps_small,
    "tests": part_tests,
    "lora": part_lora,
    "steps-medium": part_steps_medium,
    "fsdp": part_fsdp,
}


# ------------------------------------------------------------------------------------------ driver
def _say(t0: float, msg: str) -> None:
    print(f"[{time.time() - t0:6.1f} s] {msg}", flush=True)


def _figure(row: dict) -> str:
    keys = (
        "model",
        "mode",
        "algorithm",
        "sharding",
        "backend",
        "s_per_step",
        "time_ratio",
        "memory_ratio",
        "syncs_per_step",
        "noise_s",
        "kernel",
        "normals",
        "draw_s",
        "build_s",
        "summary",
        "error",
        "gpu",
        "torch",
        "dp-accounting",
    )
    return ", ".join(
        f"{k}={row[k]:.4g}" if isinstance(row[k], float) else f"{k}={row[k]}" for k in keys if row.get(k) is not None
    )


def run_part(name: str, a, budget: float, rows_path: str, t0: float) -> dict:
    """Run one part in its own process group for at most ``budget`` seconds, streaming its rows
    into ``rows_path``; returns the part's status row (also written)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--part", name, "--device", a.device] + (
        ["--quick"] if a.quick else []
    )
    start = time.time()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT, start_new_session=True
    )
    import selectors
    import threading

    err_tail: list[str] = []

    def drain_err():
        for line in proc.stderr:
            err_tail.append(line.rstrip())
            del err_tail[:-20]

    threading.Thread(target=drain_err, daemon=True).start()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    status = None
    n_rows = 0
    while True:
        left = budget - (time.time() - start)
        if left <= 0:
            status = f"timeout after {budget:.0f} s"
            break
        if not sel.select(timeout=min(left, 1.0)):
            if proc.poll() is not None:
                break
            continue
        line = proc.stdout.readline()
        if not line:
            proc.wait()
            break
        if line.startswith("ROW "):
            row = json.loads(line[4:])
            with open(rows_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            n_rows += 1
            _say(t0, f"  {name}: {_figure(row)}")
    if status is not None or proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the part and everything it started
        except ProcessLookupError:
            pass
        proc.wait()
        status = status or "killed"
    elif proc.returncode != 0:
        status = f"failed (exit {proc.returncode}): {(err_tail or ['no message'])[-1][:300]}"
    else:
        status = "ok"
    row = {"part": name, "status": status, "rows": n_rows, "seconds": round(time.time() - start, 1)}
    with open(rows_path, "a") as f:
        f.write(json.dumps(row) + "\n")
    _say(t0, f"{name}: {status} ({n_rows} rows, {row['seconds']} s)")
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="small sizes (the CPU run CI keeps alive)")
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_out", help="folder for rows.jsonl")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for the whole check (default 480)")
    p.add_argument("--parts", default=",".join(PARTS), help="which parts, in order (default: all)")
    p.add_argument("--part-budget", type=float, default=None, help="cap every part's budget (seconds)")
    p.add_argument("--part", help=argparse.SUPPRESS)  # internal: run one part in this process
    a = p.parse_args(argv)
    if a.part:
        sys.path.insert(0, SRC)
        _fault(a.part)
        PART_FUNCS[a.part](a)
        return 0
    t0 = time.time()
    unknown = [x for x in a.parts.split(",") if x not in PARTS]
    if unknown:
        print(f"gpu check: --parts: unknown part(s) {unknown} (choose from {', '.join(PARTS)})", file=sys.stderr)
        return 2
    msg = preflight()
    if msg:
        print(msg, file=sys.stderr)
        return 3
    os.makedirs(a.out, exist_ok=True)
    rows = os.path.join(a.out, "rows.jsonl")
    _say(t0, f"preflight ok; rows -> {rows}; budget {a.budget:.0f} s")
    statuses = []
    for name in a.parts.split(","):
        left = a.budget - (time.time() - t0)
        if left < 10:
            statuses.append(run_skip(name, rows, t0, f"skipped: {left:.0f} s of the budget left"))
            continue
        cap = PARTS[name][0] if a.part_budget is None else min(PARTS[name][0], a.part_budget)
        statuses.append(run_part(name, a, min(cap, left), rows, t0))
    ok = all(s["status"] == "ok" for s in statuses)
    _say(t0, f"done: {sum(s['status'] == 'ok' for s in statuses)}/{len(statuses)} parts ok; rows in {rows}")
    return 0 if ok else 1


def run_skip(name: str, rows: str, t0: float, why: str) -> dict:
    row = {"part": name, "status": why, "rows": 0, "seconds": 0.0}
    with open(rows, "a") as f:
        f.write(json.dumps(row) + "\n")
    _say(t0, f"{name}: {why}")
    return row


if __name__ == "__main__":
    sys.exit(main())
