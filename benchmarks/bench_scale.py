"""Step time and peak memory of userdp's DP steps on GPT-2-sized models, against a non-private step
on the same records and tokens and against Opacus 1.6 (per-sample hooks, and its ghost clipping)
on the ELS-equivalent job, all measured in this run.

    python benchmarks/bench_scale.py --quick --json   # CPU-sized: gpt2-small, ULS G=4 and ELS
    python benchmarks/bench_scale.py --quick --no-untied --threads 1 --repeat 3   # median and spread
    python benchmarks/bench_scale.py                  # + G=16, FedAvg, Opacus, LoRA r=8/32, gpt2-medium
    python benchmarks/bench_scale.py --device cuda --dtype bfloat16
    python benchmarks/bench_scale.py --fit 24,40,80 --json   # the largest chunk of each preset that fits
    python benchmarks/bench_scale.py --fit 8 --fit-check     # ... and one measured against its cap (CPU)

Every configuration runs in its own process (so peak memory is that job's alone; forked from this one
after the imports, see ``_run_worker``) and takes the
same records per step: ULS = M users x G records, ELS = M*G record units, FedAvg = M users x G
records (one local epoch), non-private and Opacus = one batch of M*G records. All DP steps clip
and add noise (sigma = 1). Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` during the
timed steps; on a CPU the process's peak resident set over the timed steps (Linux ``VmHWM`` after
a reset through ``/proc/self/clear_refs``: weights, optimizer state, activations, the sums and
the Python/torch runtime). Ratios are against the non-private
step of the same model and mode in the same run. ``noise_s`` is the noise draw alone
(one draw for all parameters), part of every DP step's time. ``estimated_bytes`` is the memory
model that ``chunk_size: auto`` uses (``userdp.engine.memory``) for the step's chunk, and
``estimate_over_measured`` divides it by the measured peak above what the process held before
the model was built (on a CPU the interpreter and torch's libraries; 0 on CUDA): above 1 the
model is conservative, below 1 an auto chunk could overrun its cap.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings

warnings.filterwarnings("ignore")


def _setup(model_name, mode, lora_rank, vocab, seq_len, n_users, recs, device, untied=False):
    import numpy as np
    import torch

    from userdp.engine import TensorUserData
    from userdp.lm import models

    if model_name in LLAMA_SHAPES:  # a Llama-shaped model from a config (RMSNorm, rotary, untied head)
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=vocab,
            max_position_embeddings=max(seq_len, 128),
            tie_word_embeddings=False,
            **LLAMA_SHAPES[model_name],
        )
        torch.manual_seed(0)
        with torch.device(device):  # built where it runs: a 1B model initialises in seconds on a GPU
            model = models._prepare(LlamaForCausalLM(cfg))
    else:
        model = models.build_preset(model_name, vocab_size=vocab, n_positions=max(seq_len, 128))
    if untied:  # Opacus's ghost clipping refuses tied parameters: compare on an untied copy
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.transformer.wte.weight.detach().clone())
    if mode == "lora":
        model = models.apply_lora(model, models.LoraSpec(rank=lora_rank, alpha=2.0 * lora_rank))
    model.to(device).train()
    rng = np.random.default_rng(0)
    n = n_users * recs
    ids = torch.from_numpy(rng.integers(0, vocab, (n, seq_len)))
    labels = ids.clone()
    lens = rng.integers(seq_len // 2, seq_len + 1, n)
    for i, ln in enumerate(lens):
        labels[i, ln:] = -100
    data = TensorUserData({"input_ids": ids, "labels": labels}, np.arange(0, n + 1, recs))
    return model, data


#: Llama-shaped models built from a config: ~1.1B parameters at a 32,000-token vocabulary (TinyLlama's
#: shape), and a tiny one that keeps the same path alive on a CPU
LLAMA_SHAPES = {
    "llama-1b": {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
    },
    "llama-tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
}


def _reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark of this process (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss() -> int:
    """Peak resident set since the last reset (VmHWM), else the lifetime peak (ru_maxrss)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _random_batch(data, B, rng):
    users = rng.integers(0, data.num_users, B)
    recs = (rng.random(B) * data.sizes()[users]).astype("int64")
    return data.gather(users, recs)


def _worker(a) -> dict:
    import numpy as np
    import torch

    from userdp.engine import ELS, SGD, ULS, FedAvg, FlatClip, TrainConfig
    from userdp.engine.performance import Performance
    from userdp.engine.precision import Precision
    from userdp.engine.run.step import EngineRun
    from userdp.lm.models import causal_lm_loss

    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    if a.sum_operand:  # the tensor-core clipped sum's operand (contraction.SUM_OPERAND; default: the engine's)
        import userdp.engine.contraction as contraction_mod

        contraction_mod.SUM_OPERAND = a.sum_operand
    if a.tf32_ceiling:  # NOT PRIVATE-SAFE: norms and sums in TF32 (a ceiling on speed, never a mode of userdp)
        import contextlib

        import userdp.engine.contraction as contraction_mod
        import userdp.engine.per_unit as per_unit_mod
        from userdp.engine.ghost import strategy as ghost_strategy
        from userdp.engine.precision import _fp32_handles

        ghost_strategy.exact_float32 = per_unit_mod.exact_float32 = contextlib.nullcontext
        contraction_mod.TENSOR_CORES = "off"
        for h in _fp32_handles():
            h.fp32_precision = "tf32"
    # what the process holds before the model exists (the CPU's peak RSS counts the interpreter and
    # torch's libraries; CUDA's allocator counts tensors only): the memory model is compared with
    # the peak above it
    base_bytes = 0 if device.type == "cuda" else _peak_rss()
    M, G = a.users, a.group_size
    B = M * G
    model, data = _setup(a.model, a.mode, a.lora_rank, a.vocab, a.seq_len, 4 * M, max(G, 2), device, a.untied)
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rng = np.random.default_rng(1)
    prec = Precision(a.dtype)
    chunk = a.chunk or M
    extra = {}
    if a.algorithm == "nonprivate":
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)

        def step():
            batch = _random_batch(data, B, rng)
            opt.zero_grad(set_to_none=True)
            with prec.autocast(device):
                loss = causal_lm_loss(model, batch).mean()
            loss.backward()
            opt.step()
    elif a.algorithm in ("opacus", "opacus_ghost"):
        from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping

        ce = torch.nn.CrossEntropyLoss(ignore_index=-100, reduction="mean")
        if a.algorithm == "opacus":
            from opacus import GradSampleModule

            gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean")
            opt = DPOptimizer(
                torch.optim.SGD(gsm.parameters(), lr=1e-4),
                noise_multiplier=1.0,
                max_grad_norm=1.0,
                expected_batch_size=B,
            )
        else:
            from opacus.grad_sample import GradSampleModuleFastGradientClipping
            from opacus.utils.fast_gradient_clipping_utils import (
                DPLossFastGradientClipping,
            )

            gsm = GradSampleModuleFastGradientClipping(
                model, batch_first=True, loss_reduction="mean", max_grad_norm=1.0, use_ghost_clipping=True
            )
            opt = DPOptimizerFastGradientClipping(
                torch.optim.SGD(gsm.parameters(), lr=1e-4),
                noise_multiplier=1.0,
                max_grad_norm=1.0,
                expected_batch_size=B,
                loss_reduction="mean",
            )
            crit = DPLossFastGradientClipping(gsm, opt, ce, loss_reduction="mean")

        def step():
            batch = _random_batch(data, B, rng)
            ids, lab = batch["input_ids"].to(device), batch["labels"].to(device)
            pos = torch.arange(ids.shape[1], device=device).expand(ids.shape)
            opt.zero_grad(set_to_none=True)
            with prec.autocast(device):
                logits = gsm(input_ids=ids, position_ids=pos).logits[:, :-1]
            tgt = lab[:, 1:]
            if a.algorithm == "opacus":
                tok = torch.nn.functional.cross_entropy(
                    logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1).clamp(min=0), reduction="none"
                ).view(tgt.shape)
                mask = (tgt != -100).float()
                ((tok * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean().backward()
            else:
                crit(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1), shape=logits.shape).backward()
            opt.step()
    else:
        n_units = data.num_users if a.algorithm != "els" else int(data.sizes().clip(max=G).sum())
        algo = {
            "uls": lambda: ULS(G, M / n_units),
            "els": lambda: ELS(G, B / n_units),
            "fedavg": lambda: FedAvg(G, M / n_units, local_epochs=1, local_lr=0.1),
        }[a.algorithm]()
        sampling, acc = ("shuffle", "pld") if a.algorithm == "els" else ("fixed_size", "rdp")
        cfg = TrainConfig(
            algorithm=algo,
            steps=10**6,
            clipping=FlatClip(1.0),
            optimizer=SGD(1e-4),
            noise_multiplier=1.0,
            delta=1e-5,
            seed=0,
            sampling=sampling,
            accountant=acc,
            performance=Performance(
                chunk_size=chunk if a.algorithm != "els" else chunk * G,
                track_epsilon=False,
                per_unit=a.per_unit,
                precision=a.dtype,
            ),
        )
        run = EngineRun(model, data, causal_lm_loss, cfg)
        step = run.run_step
        extra["per_unit"] = run.per_unit.name
        # the memory model that chunk_size: auto uses, for this step's chunk (one chunk: chunk = M)
        from userdp.engine.memory import fixed_bytes, unit_bytes

        recs, units = (1, chunk * G) if a.algorithm == "els" else (G, chunk)
        narrow = a.dtype != "float32"
        per = unit_bytes(model, recs, a.seq_len, strategy=run.per_unit.name, low_precision=narrow)
        if per is not None:
            extra["estimated_bytes"] = fixed_bytes(model, optimizer_states=0, low_precision=narrow) + units * per
        z = [torch.zeros_like(p, dtype=torch.float32) for p in run.params]
        run.noise.update(z, None, 1.0)  # once untimed (a compiled device generator compiles here)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run.noise.update(
            z, None, 1.0
        )  # the noise draw alone (part of every DP step): PCG64 on the host, ChaCha20 on CUDA
        if device.type == "cuda":
            torch.cuda.synchronize()
        extra["noise_s"] = time.perf_counter() - t0
        del z  # a model-sized buffer: not alive while the step's peak memory is measured
    try:
        for _ in range(a.warmup):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        else:
            _reset_peak_rss()  # steady state: the first step's one-time work (ghost's check) excluded
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        if device.type == "cuda":  # what the job needs on the device (weights, optimizer, activations)
            mem = torch.cuda.max_memory_allocated(device)
        else:
            mem = _peak_rss()
        if a.profile:
            extra.update(_profile(step, device))
        if a.memory_snapshot and device.type == "cuda":
            extra.update(_memory_at_peak(step, device))
    except (RuntimeError, torch.OutOfMemoryError) as exc:  # report, do not hide (OOM, unsupported layer)
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}", "params": params}
    s = statistics.median(times)
    extra["peak_above_start_bytes"] = mem - base_bytes
    if "estimated_bytes" in extra:
        extra["estimate_over_measured"] = extra["estimated_bytes"] / max(extra["peak_above_start_bytes"], 1)
    return {
        "params": params,
        "trainable": trainable,
        "s_per_step": s,
        "peak_bytes": mem,
        "tokens_per_s": B * a.seq_len / s,
        "records_per_step": B,
        **extra,
    }


def _profile(step, device) -> dict:
    """One more step under torch.profiler: the top ops by self device (else CPU) time, and the host
    syncs and copies it made (CUDA runtime calls named *Synchronize* or *Memcpy*; on a CPU the
    scalar reads that would be syncs on a GPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, record_shapes=True) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    names = [e.name for e in events]
    # self time (what the op itself spent, not its children): inclusive totals count a GEMM once in
    # aten::mm and again in every backward node and wrapper above it
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    avgs = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)
    return {
        "profile": {
            "top_ops": [
                {"name": e.key, "count": e.count, "ms": round(getattr(e, key, 0.0) / 1000, 3)} for e in avgs[:30]
            ],
            # the same by input shapes, aten ops only: which tensors the elementwise time goes to
            "top_shapes": [
                {"name": f"{e.key} {e.input_shapes}", "count": e.count, "ms": round(getattr(e, key, 0.0) / 1000, 3)}
                for e in sorted(
                    (e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::")),
                    key=lambda e: getattr(e, key, 0.0),
                    reverse=True,
                )[:30]
            ],
            "stream_synchronize": sum("Synchronize" in n for n in names),
            "memcpy": sum("Memcpy" in n for n in names),
            "scalar_reads": sum(n == "aten::_local_scalar_dense" for n in names),
            "ops": sum(n.startswith("aten::") for n in names),
        }
    }


def _memory_at_peak(step, device, top: int = 15) -> dict:
    """One more step with CUDA's allocator history recorded: what was allocated during the step
    and still alive at its peak, grouped by where it was allocated (:func:`peak_composition`)."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    try:
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    traces = snap.get("device_traces") or [[]]
    return peak_composition(traces[device.index or 0], top)


def peak_composition(trace: list, top: int = 15) -> dict:
    """Replay an allocator trace (``torch.cuda.memory._snapshot()["device_traces"][i]``: alloc and
    free events in order) and return the bytes allocated during it at their peak, and the blocks
    alive then grouped by allocation site (the first userdp frame, else the first frame), largest
    first: ``peak_live`` lines of "MiB xcount site"."""
    live: dict = {}
    total = best = 0
    at_best: dict = {}
    for ev in trace:
        action = ev.get("action")
        if action == "alloc":
            live[ev["addr"]] = ev
            total += int(ev["size"])
            if total > best:
                best, at_best = total, dict(live)
        elif action == "free_completed":
            gone = live.pop(ev["addr"], None)
            if gone is not None:
                total -= int(gone["size"])
    groups: dict = {}
    for ev in at_best.values():
        frames = ev.get("frames") or []
        mine = next((f for f in frames if "userdp" in f.get("filename", "")), frames[0] if frames else None)
        site = f"{os.path.basename(mine['filename'])}:{mine['line']} {mine['name']}" if mine else "?"
        g = groups.setdefault(site, [0, 0])
        g[0] += int(ev["size"])
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: kv[1][0], reverse=True)[:top]
    return {
        "peak_traced_bytes": best,
        "peak_live": [f"{size / 2**20:.1f} MiB x{n} {site}" for site, (size, n) in ranked],
    }


FIT_MODELS = ("gpt2-small", "gpt2-medium", "gpt2-large")


def _fit_rows(caps_gib, dtype: str, seq_len: int, vocab: int) -> list[dict]:
    """The largest chunk (units per per-unit call) of each preset that the memory model fits in
    each cap, for full fine-tuning and LoRA r = 8, ULS (G = 16) and ELS, Adam. Models are built on
    the meta device: nothing is allocated. Any cohort then runs by accumulating chunks."""
    import torch

    from userdp.engine.memory import RunShape, auto_chunk_size
    from userdp.errors import UserError
    from userdp.lm import models

    rows = []
    for name in FIT_MODELS:
        for mode in ("full", "lora-r8"):
            with torch.device("meta"):
                model = models.build_preset(name, vocab_size=vocab, n_positions=max(seq_len, 128))
                if mode != "full":
                    model = models.apply_lora(model, models.LoraSpec(rank=8, alpha=16.0))
            params = sum(p.numel() for p in model.parameters())
            for alg, g in (("uls", 16), ("els", 1)):
                for cap in caps_gib:
                    row = {
                        "fit": True,
                        "memory_cap_gib": cap,
                        "model": name,
                        "params": params,
                        "mode": mode,
                        "algorithm": alg,
                        "records_per_unit": g,
                        "seq_len": seq_len,
                        "dtype": dtype,
                        "optimizer": "adam",
                    }
                    try:
                        shape = RunShape(
                            g, seq_len, strategy="ghost", low_precision=dtype != "float32", optimizer_states=2
                        )
                        chunk, info = auto_chunk_size(
                            model, shape, device=torch.device("cpu"), memory_cap_bytes=int(cap * 2**30)
                        )
                        row.update(
                            chunk=chunk,
                            fixed_bytes=info["fixed_bytes"],
                            unit_bytes=info["unit_bytes"],
                            estimated_bytes=info["fixed_bytes"] + chunk * info["unit_bytes"],
                        )
                    except UserError:
                        row.update(chunk=0, note="one unit does not fit")
                    rows.append(row)
    return rows


def _run_worker(worker_args: list[str], *, fork: bool = False) -> dict:
    """One configuration in its own process (``--worker`` plus ``worker_args``): its JSON result,
    or ``{"error": ...}`` with the last line of its stderr.

    ``fork``: a child forked from this process once it has imported torch, userdp and the model
    classes (:func:`preload`), instead of a fresh interpreter: each configuration saves the ~6 s
    (CPU) of imports, and its peak memory is still its own (CUDA memory is per process; a CPU
    peak is measured above the worker's start). Used only while this process has not initialised
    CUDA (a CUDA context does not survive a fork); a forked worker that fails on CUDA is run again
    in a fresh interpreter, and the row says so."""
    if fork and hasattr(os, "fork") and not _cuda_initialised():
        res = _forked_worker(worker_args)
        if (
            "error" not in res
            or "--device" not in worker_args
            or not worker_args[worker_args.index("--device") + 1].startswith("cuda")
        ):
            return res
        return dict(_run_worker(worker_args), fork_fallback=res["error"])
    out = subprocess.run(
        [sys.executable, __file__, "--worker", *worker_args],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
        check=False,
    )
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1][:200]}


def preload() -> None:
    """Import what every worker imports (torch, userdp's engine and models, the transformers model
    classes), without touching CUDA: forked workers start from here."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() must not create a context
    import torch  # noqa: F401
    from transformers import GPT2LMHeadModel, LlamaForCausalLM  # noqa: F401  (lazy modules: loaded now)

    import userdp.engine.run.loop  # noqa: F401
    import userdp.lm.models  # noqa: F401


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def _forked_worker(worker_args: list[str]) -> dict:
    """:func:`_worker` in a forked child; its result comes back through a pipe."""
    preload()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure, write, and leave without running the parent's exit handlers
        code = 0
        try:
            os.close(read_end)
            res = _worker(parse_args(["--worker", *worker_args]))
        except BaseException as exc:  # noqa: BLE001  (reported in the row, as a subprocess's stderr is)
            res, code = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}, 1
        try:
            with os.fdopen(write_end, "w") as f:
                f.write(json.dumps(res))
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"error": f"forked worker ended without a result (wait status {status})"}


def _configs(quick: bool, device: str, untied: bool = True, lora: bool = False):
    models = [("gpt2-small", "full", 0)]
    if not quick or lora:
        models += [("gpt2-small", "lora", 8), ("gpt2-small", "lora", 32)]
    if not quick:  # where memory allows: 355M parameters fit a GPU and a CPU with ~16 GB free alike
        models += [("gpt2-medium", "full", 0)]
    for model, mode, r in models:
        algs = [("nonprivate", 4), ("uls", 4), ("els", 4)]
        if not quick:
            algs += [("uls", 16), ("fedavg", 4), ("opacus", 4)]
        for alg, g in algs:
            yield model, mode, r, alg, g
        if (
            mode == "full" and untied and model == "gpt2-small"
        ):  # Opacus's ghost clipping refuses GPT-2's tied wte/lm_head: untie both sides
            for alg in ("nonprivate", "els", "opacus_ghost"):
                yield model + "-untied", mode, r, alg, 4


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, with the size defaults that depend on the device filled in."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="CPU-sized: gpt2-small full, ULS G=4, ELS, Opacus ghost")
    ap.add_argument("--json", action="store_true", help="print one JSON list of rows")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--users", type=int, default=None, help="M: users (ULS/FedAvg) per step")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=50257, help="vocabulary (GPT-2's: 50,257)")
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    ap.add_argument("--per-unit", default="auto", choices=["auto", "ghost", "vmap"])
    ap.add_argument("--no-untied", action="store_true", help="skip the untied-GPT-2 rows (Opacus ghost comparison)")
    ap.add_argument("--lora", action="store_true", help="with --quick: add the LoRA r = 8 and r = 32 rows")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="N interleaved repetitions (non-private, ULS, ELS, non-private, ...): median and spread",
    )
    ap.add_argument(
        "--fit",
        default=None,
        metavar="GIB,...",
        help="instead: the largest chunk of gpt2-small/medium/large (full, LoRA r = 8; ULS G = 16, ELS; "
        "Adam) that the memory model fits in each cap, in GiB",
    )
    ap.add_argument(
        "--fit-check",
        action="store_true",
        help="with --fit CAP: run one ULS step (G = 4) of gpt2-medium at the chunk the model fits in "
        "CAP (SGD, --seq-len) and measure its peak above the process's start against the cap",
    )
    # worker mode (one configuration, in its own process)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="gpt2-small", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="full", help=argparse.SUPPRESS)
    ap.add_argument("--lora-rank", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--algorithm", default="nonprivate", help=argparse.SUPPRESS)
    ap.add_argument("--group-size", type=int, default=4, help=argparse.SUPPRESS)
    ap.add_argument("--chunk", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--untied", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=3, help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--memory-snapshot", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tf32-ceiling", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sum-operand", default=None, choices=["split", "rounded"], help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    gpu = a.device.startswith("cuda")
    if a.users is None:
        a.users = (16 if gpu else 2) if not a.quick or gpu else 2
    if a.seq_len is None and not a.fit:
        a.seq_len = 128 if gpu else 32
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    gpu = a.device.startswith("cuda")
    if a.fit:
        return _fit_main(a)
    if a.worker:
        print(json.dumps(_worker(a)))
        return 0
    hw = platform.processor() or platform.machine()
    machine = _machine(a.threads)
    rounds = [_one_round(a, gpu) for _ in range(max(1, a.repeat))]  # interleaved: every config once a round
    rows = _aggregate(rounds, machine)
    machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    for row in rows:
        if not a.json:
            tr, mr = row["time_ratio"], row["memory_ratio"]
            spread = (
                f" [{row['time_ratio_min']:.2f}-{row['time_ratio_max']:.2f}]"
                if row.get("time_ratio_min") is not None and a.repeat > 1
                else ""
            )
            print(
                f"{row['model']:12s} {row['mode']:8s} {row['algorithm']:13s} G={row['group_size']:<3d} "
                f"{row['s_per_step'] or float('nan'):8.3f} s {row['tokens_per_s'] or float('nan'):9.0f} tok/s  "
                f"time x{tr if tr else float('nan'):.2f}{spread}  mem x{mr if mr else float('nan'):.2f}  "
                f"{row['per_unit'] or ''} {row['error'] or ''}",
                flush=True,
            )
    if a.json:
        print(json.dumps(rows))
    else:
        print(
            f"device {a.device} ({hw}), dtype {a.dtype}, {a.users} users x G records of {a.seq_len} tokens; "
            f"{a.repeat} interleaved repetition(s) (median, [min-max] of the ratios)"
        )
        print(
            f"machine: {machine['cpu']}; flags {', '.join(machine['flags']) or 'none of avx2/avx512f/amx'}; "
            f"{machine['threads']} torch thread(s) of {machine['cores']} cores; load average "
            f"{machine['load_average_start']} at the start, {machine['load_average_end']} at the end"
        )
    return 0


def _machine(threads: int) -> dict:
    """What the ratios depend on beyond the code: the CPU, its vector extensions, threads, load."""
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and cpu in ("", platform.machine(), platform.processor()):
                    cpu = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {
        "cpu": cpu,
        "flags": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if f in flags],
        "cores": os.cpu_count(),
        "threads": threads,
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
    }


def _one_round(a, gpu: bool) -> list[dict]:
    """One measurement of every configuration, each in its own process, in order (non-private first,
    then its DP steps): ratios against the non-private step of the same round."""
    rows, base = [], {}
    for model, mode, r, alg, g in _configs(a.quick, a.device, untied=not a.no_untied, lora=a.lora):
        untied = model.endswith("-untied")
        res = _run_worker(
            [
                "--model",
                model.removesuffix("-untied"),
                "--mode",
                mode,
                "--lora-rank",
                str(r),
                "--algorithm",
                alg,
                "--group-size",
                str(g),
                "--device",
                a.device,
                "--dtype",
                a.dtype,
                "--users",
                str(a.users),
                "--seq-len",
                str(a.seq_len),
                "--vocab",
                str(a.vocab),
                "--threads",
                str(a.threads),
                "--per-unit",
                a.per_unit,
                "--reps",
                "3" if a.quick and not gpu else "10",
                "--warmup",
                "1" if not gpu else "3",
            ]
            + (["--untied"] if untied else []),
            fork=True,
        )
        if alg == "nonprivate":
            base[(model, mode, r)] = res
        b = base.get((model, mode, r), {})
        # non-private batches of the same records: B = M*G; the G=16 rows compare with a G=16 batch
        row = {
            "model": model,
            "params": res.get("params"),
            "mode": mode if not r else f"lora-r{r}",
            "algorithm": alg,
            "group_size": g,
            "device": a.device,
            "dtype": a.dtype,
            "records_per_step": a.users * g,
            "seq_len": a.seq_len,
            "per_unit": res.get("per_unit"),
            "s_per_step": res.get("s_per_step"),
            "tokens_per_s": res.get("tokens_per_s"),
            "peak_bytes": res.get("peak_bytes"),
            "noise_s": res.get("noise_s"),
            "estimated_bytes": res.get("estimated_bytes"),
            "estimate_over_measured": res.get("estimate_over_measured"),
            "error": res.get("error"),
        }
        if "s_per_step" in res and "s_per_step" in b and g == 4:
            row["time_ratio"] = res["s_per_step"] / b["s_per_step"]
            row["memory_ratio"] = res["peak_bytes"] / b["peak_bytes"]
            if res.get("noise_s"):  # diagnostic: the step without its host-side noise draw
                row["time_ratio_excluding_host_noise"] = (res["s_per_step"] - res["noise_s"]) / b["s_per_step"]
        else:
            row["time_ratio"] = row["memory_ratio"] = None
        if alg in ("uls", "fedavg") and g != 4 and "s_per_step" in res and "s_per_step" in b:
            # a G=16 step holds 4x the records of the G=4 non-private batch: per-token ratio
            row["time_ratio_per_token"] = (res["s_per_step"] / (g / 4)) / b["s_per_step"]
        rows.append(row)
    return rows


def _aggregate(rounds: list[list[dict]], machine: dict) -> list[dict]:
    """Per configuration: the median of each figure over the rounds, and the spread (min, max) of
    the time ratio; the machine the figures were taken on."""
    out = []
    for i, first in enumerate(rounds[0]):
        runs = [r[i] for r in rounds]
        row = dict(first, repeats=len(runs), machine=machine)
        for key in (
            "s_per_step",
            "tokens_per_s",
            "peak_bytes",
            "noise_s",
            "time_ratio",
            "memory_ratio",
            "time_ratio_excluding_host_noise",
            "time_ratio_per_token",
        ):
            vals = [x.get(key) for x in runs if x.get(key) is not None]
            row[key] = statistics.median(vals) if vals else None
        ratios = [x["time_ratio"] for x in runs if x.get("time_ratio") is not None]
        row["time_ratio_min"] = min(ratios) if ratios else None
        row["time_ratio_max"] = max(ratios) if ratios else None
        row["error"] = next((x["error"] for x in runs if x.get("error")), None)
        out.append(row)
    return out


def _fit_main(a) -> int:
    caps = [float(x) for x in a.fit.split(",")]
    rows = _fit_rows(caps, a.dtype, a.seq_len or 128, a.vocab)
    a.seq_len = a.seq_len or 64  # the check's step: gpt2-medium on a CPU at 128 tokens is slow
    if a.fit_check:  # the model's chunk for the first cap, run, and its measured peak against the cap
        import torch

        from userdp.engine.memory import RunShape, auto_chunk_size
        from userdp.lm import models

        with torch.device("meta"):
            model = models.build_preset("gpt2-medium", vocab_size=a.vocab, n_positions=max(a.seq_len, 128))
        cap = int(caps[0] * 2**30)
        shape = RunShape(4, a.seq_len, strategy="ghost", low_precision=a.dtype != "float32", optimizer_states=0)
        chunk, _ = auto_chunk_size(model, shape, device=torch.device("cpu"), memory_cap_bytes=cap)
        res = _run_worker(
            [
                "--model",
                "gpt2-medium",
                "--mode",
                "full",
                "--algorithm",
                "uls",
                "--group-size",
                "4",
                "--device",
                a.device,
                "--dtype",
                a.dtype,
                "--users",
                str(chunk),
                "--seq-len",
                str(a.seq_len),
                "--vocab",
                str(a.vocab),
                "--threads",
                str(a.threads),
                "--reps",
                "1",
                "--warmup",
                "1",
            ]
        )
        measured = res.get("peak_above_start_bytes")
        rows.append(
            {
                "fit_check": True,
                "memory_cap_gib": caps[0],
                "model": "gpt2-medium",
                "mode": "full",
                "algorithm": "uls",
                "records_per_unit": 4,
                "seq_len": a.seq_len,
                "dtype": a.dtype,
                "optimizer": "sgd",
                "chunk": chunk,
                "estimated_bytes": res.get("estimated_bytes"),
                "measured_bytes": measured,
                "within_cap": measured is not None and measured <= cap,
                "s_per_step": res.get("s_per_step"),
                "device": a.device,
                "error": res.get("error"),
            }
        )
    if a.json:
        print(json.dumps(rows))
        return 0
    for r in rows:
        if r.get("fit_check"):
            m = r["measured_bytes"]
            print(
                f"check: gpt2-medium full ULS G=4 x {r['seq_len']} tokens, cap {r['memory_cap_gib']} GiB -> chunk "
                f"{r['chunk']}: estimated {r['estimated_bytes'] / 2**30:.2f} GiB, measured "
                f"{(m or float('nan')) / 2**30:.2f} GiB above the start ({'within' if r['within_cap'] else 'OVER'} the cap)"
                f" {r['error'] or ''}"
            )
        else:
            est = r.get("estimated_bytes")
            print(
                f"{r['memory_cap_gib']:5g} GiB  {r['model']:11s} {r['mode']:7s} {r['algorithm']} G={r['records_per_unit']:<2d} "
                f"x {r['seq_len']} tokens {r['dtype']}: chunk {r['chunk']:3d} units"
                + (f" ({est / 2**30:.1f} GiB estimated)" if est else f" ({r.get('note', '')})")
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
