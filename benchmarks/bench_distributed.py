"""Step time of a userdp ULS step on 1 and W processes (torchrun), measured in one run.

    python benchmarks/bench_distributed.py --quick --json        # CPU: W = 1, 2 (gloo), a small GPT
    python benchmarks/bench_distributed.py --quick --nproc 2 --sharding none,fsdp --optimizer adam
                                             # per-rank parameter + gradient + Adam bytes, FSDP2 vs replicated
    python benchmarks/bench_distributed.py --nproc 1,2,4,8 --device cuda --model gpt2-small   # NCCL

Every W runs the same job under ``torchrun --standalone --nproc_per_node=W``: the same model,
the same synthetic users (random tokens), the same seeded Poisson cohorts (ULS, G records per
user), clipping and noise (sigma = 1), through ``userdp.engine.train`` with the torch.distributed
combiner — the code path of ``torchrun -m userdp train``. Each row: the mean time of a step after
the warm-up steps (rank 0's clock; a step ends for every rank at its last all-reduce), the
speed-up against W = 1 of the same run, tokens per second, the bytes each step all-reduces
(the float32 clipped sums plus 7 float64 statistics), and the host-side noise draw's share of a
step (drawn once, on rank 0, while the other ranks wait), and the bytes of parameters, gradients and
optimizer state that rank 0 holds (``state_bytes_per_rank``; with ``--sharding fsdp`` its 1/W share,
and ``state_ratio_vs_replicated`` against the replicated run of the same W), and the peak memory rank 0
reaches above its built model (``peak_bytes_per_rank``: held state plus every transient buffer, the
clipped sums, the noise and the activations among them; CUDA's allocator peak, the CPU's peak resident
set) with its ratio to the replicated run's.

On CPU every process gets ``cores / W`` intra-op threads, so W = 2 on a 2-core machine compares
one process with two threads against two processes with one thread each: it measures the
overhead of the split (communication, the serial noise draw), not a gain from more hardware.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")

from bench_scale import _peak_rss, _reset_peak_rss  # noqa: E402  (this folder's: peak RSS since a reset)

from userdp.engine import RunOptions


def _worker(a) -> None:
    import numpy as np
    import torch

    from userdp import world as launch
    from userdp.engine import SGD, ULS, Adam, FlatClip, TensorUserData, TrainConfig, train
    from userdp.engine.distributed.processes import combiner_for
    from userdp.engine.noise.gaussian import source_for
    from userdp.engine.performance import Performance
    from userdp.engine.run import loop as engine_loop
    from userdp.lm import models

    world = launch.init_world(a.device)
    backend = world.backend
    if a.sharding == "fsdp" and not world.distributed:
        # FSDP2 needs a process group, even of one process (W = 1: one GPU's NCCL row of the GPU check)
        import torch.distributed as dist

        backend = "nccl" if a.device == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group(
            backend, rank=0, world_size=1, **({"device_id": torch.device("cuda", 0)} if backend == "nccl" else {})
        )
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cuda" if a.device == "cuda" else "cpu")
    )
    torch.manual_seed(0)
    model = models.build_preset(a.model, vocab_size=a.vocab, n_positions=max(a.seq_len, 128)).to(device).train()
    rng = np.random.default_rng(0)
    n = a.users * a.records
    ids = torch.from_numpy(rng.integers(0, a.vocab, (n, a.seq_len)))
    data = TensorUserData({"input_ids": ids, "labels": ids.clone()}, np.arange(0, n + 1, a.records))
    cfg = TrainConfig(
        algorithm=ULS(a.group_size, a.cohort / a.users),
        steps=a.warmup + a.steps,
        clipping=FlatClip(1.0),
        optimizer=SGD(1e-3),
        noise_multiplier=1.0,
        delta=1e-6,
        seed=1,
        accountant="rdp",
        performance=Performance(
            chunk_size=a.chunk, track_epsilon=False, per_unit=a.per_unit, precision=a.dtype, sharding=a.sharding
        ),
    )
    if a.optimizer == "adam":
        cfg = TrainConfig(**{**cfg.__dict__, "optimizer": Adam(1e-3)})
    start = _reset_peak(device)  # the peak the run adds above the built model: its transient buffers too
    runs = []  # the EngineRun, to count the optimizer state it holds after training
    init = engine_loop.EngineRun.__init__

    def keep(self, *args, **kw):
        init(self, *args, **kw)
        runs.append(self)

    engine_loop.EngineRun.__init__ = keep
    times, units = [], []

    def on_step(m):
        times.append(m["step_time"])
        units.append(m["units"])

    if device.type == "cuda":
        torch.cuda.synchronize()
    train(
        model,
        data,
        models.causal_lm_loss,
        cfg,
        RunOptions(callbacks=[on_step], combiner=combiner_for(backend is not None)),
    )

    peak = _peak(device) - start

    def local_bytes(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    held = sum(local_bytes(p) + (local_bytes(p.grad) if p.grad is not None else 0) for p in model.parameters())
    held += sum(
        local_bytes(v)
        for st in runs[-1].optimizer.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    if a.sharding == "fsdp":
        from torch.distributed.tensor import DTensor

        params = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters() if p.requires_grad]
    else:
        params = [p for p in model.parameters() if p.requires_grad]
    # the draw the run itself uses on this device (ChaCha20 on CUDA, numpy's PCG64 on the CPU),
    # once to build it, then timed
    src = source_for(device, 1, seeded=True)
    if hasattr(src, "prepare"):
        src.prepare(device)
    src.like(params, 1.0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    src.like(params, 1.0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    noise_s = time.perf_counter() - t0
    if world.is_main:
        timed = times[a.warmup :]
        step_s = float(np.mean(timed))
        n_params = sum(p.numel() for p in params)
        row = {
            "world_size": world.world_size,
            "backend": backend or "none",
            "device": str(device),
            "model": a.model,
            "dtype": a.dtype,
            "params": n_params,
            "group_size": a.group_size,
            "cohort": a.cohort,
            "seq_len": a.seq_len,
            "steps_timed": len(timed),
            "step_s": round(step_s, 4),
            "tokens_per_s": round(float(np.mean(units[a.warmup :])) * a.group_size * a.seq_len / step_s, 1),
            "allreduce_bytes_per_step": 4 * n_params + 8 * 7,
            "noise_draw_s": round(noise_s, 4),
            "threads_per_process": torch.get_num_threads(),
            "sharding": a.sharding,
            "optimizer": a.optimizer,
            "state_bytes_per_rank": held,
            "peak_bytes_per_rank": peak,
        }
        with open(a.out, "w") as f:
            json.dump(row, f)
    world.close()
    if backend is not None and not world.distributed:  # the one-process group made above
        import torch.distributed as dist

        dist.destroy_process_group()


def _reset_peak(device) -> int:
    """Reset this process's peak-memory mark; returns what is held now (CUDA: allocated bytes; CPU:
    the resident set, bench_scale's peak-RSS mark just reset)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    _reset_peak_rss()
    return _peak_rss()


def _peak(device) -> int:
    """The peak since :func:`_reset_peak` (CUDA: allocated bytes; CPU: VmHWM, the resident set's peak)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(device)
    return _peak_rss()


def _run(w: int, a, out: str) -> dict:
    threads = max(1, (os.cpu_count() or 1) // w) if a.device == "cpu" else 1
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    # torch's own launcher, by module: a bare box may hold torch without torchrun on PATH
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={w}",
        __file__,
        "--worker",
        "--out",
        out,
        "--device",
        a.device,
        "--model",
        a.model,
        "--users",
        str(a.users),
        "--records",
        str(a.records),
        "--group-size",
        str(a.group_size),
        "--cohort",
        str(a.cohort),
        "--seq-len",
        str(a.seq_len),
        "--vocab",
        str(a.vocab),
        "--steps",
        str(a.steps),
        "--warmup",
        str(a.warmup),
        "--chunk",
        str(a.chunk),
        "--per-unit",
        a.per_unit,
        "--dtype",
        a.dtype,
        "--sharding",
        a.sharding,
        "--optimizer",
        a.optimizer,
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"bench_distributed: W = {w} failed:\n{res.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="CPU-sized (a few minutes here)")
    p.add_argument("--json", action="store_true", help="print one JSON list of rows")
    p.add_argument("--nproc", default="1,2", help="world sizes to run (comma-separated)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default=None, help="preset (default: small on --quick, gpt2-small otherwise)")
    p.add_argument("--users", type=int, default=256)
    p.add_argument("--records", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--cohort", type=float, default=None, help="expected users per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--chunk", type=int, default=8)
    p.add_argument("--per-unit", default="auto", choices=["auto", "ghost", "vmap"])
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the forward's autocast precision (training.precision)",
    )
    p.add_argument("--sharding", default="none", help="none, fsdp or both (comma-separated): FSDP2 rows")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        _worker(a)
        return 0
    a.model = a.model or ("small" if a.quick else "gpt2-small")
    a.cohort = a.cohort or (16.0 if a.quick else 64.0)
    a.steps = a.steps or (6 if a.quick else 10)
    sizes = [int(x) for x in a.nproc.split(",")]
    rows = []
    shardings = [x for x in a.sharding.split(",") if x]
    with tempfile.TemporaryDirectory() as tmp:
        for w in sizes:
            for sh in shardings:
                a.sharding = sh
                rows.append(_run(w, a, os.path.join(tmp, f"w{w}-{sh}.json")))
    base = next((r for r in rows if r["world_size"] == 1 and r["sharding"] == "none"), rows[0])
    for r in rows:
        r["speedup_vs_1"] = round(base["step_s"] / r["step_s"], 3)
        rep = next((x for x in rows if x["world_size"] == r["world_size"] and x["sharding"] == "none"), None)
        if rep is not None:
            r["state_ratio_vs_replicated"] = round(r["state_bytes_per_rank"] / rep["state_bytes_per_rank"], 3)
            r["peak_ratio_vs_replicated"] = round(r["peak_bytes_per_rank"] / max(1, rep["peak_bytes_per_rank"]), 3)
        r["hardware"] = f"{platform.machine()}, {os.cpu_count()} cores" + (
            "" if a.device == "cpu" else f", {_gpu_name()}"
        )
    if a.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(
                f"W={r['world_size']} ({r['backend']}, {r['device']}, sharding {r['sharding']}): "
                f"{r['step_s'] * 1000:.0f} ms/step, "
                f"{r['tokens_per_s']:.0f} tokens/s, speed-up {r['speedup_vs_1']:.2f}x; all-reduce "
                f"{r['allreduce_bytes_per_step'] / 2**20:.1f} MiB/step; noise draw {r['noise_draw_s'] * 1000:.0f} ms; "
                f"rank 0 holds {r['state_bytes_per_rank'] / 2**20:.1f} MiB of parameters, gradients and optimizer "
                f"state ({r.get('state_ratio_vs_replicated', 1.0):.2f}x the replicated run); its peak above the "
                f"built model {r['peak_bytes_per_rank'] / 2**20:.1f} MiB ({r.get('peak_ratio_vs_replicated', 1.0):.2f}x)"
            )
    return 0


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"


if __name__ == "__main__":
    sys.exit(main())
