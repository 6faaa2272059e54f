"""Where a ghost chunk's time goes on a GPU, read on a CPU: every op's memory traffic and GEMM
FLOPs, counted op by op on fake tensors, against a non-private forward and backward of the same
records, with a roofline time per op.

How. The model and batch are :mod:`bench_memory`'s (fake tensors, float32 weights under bf16
autocast, the ghost strategy's device path). :class:`Traffic` charges each aten op the bytes of its
tensor arguments (read) and results (written), views none, and its FLOPs where it is a GEMM
(``mm``, ``bmm``, ``addmm``, ``linear``, with the float32 ``out_dtype`` contractions on the tensor
cores) or an attention kernel; the clipped sum's operand, the ghost norms' Gram-pair reductions
and the LayerNorms' per-unit gradients are charged as the CUDA Triton kernels make them (one read of what they read, one write of what
they write), not as the CPU's torch passes.
Each op's time is ``max(bytes / bandwidth, flops / rate) + launch``: a roofline, at rates taken
as fractions of an H100's peaks (``--bandwidth``, ``--bf16``, ``--fp32``, ``--launch``).

What it is for: which DP-only ops cost what, by op and shape, and how a change moves them,
before a GPU can measure it. The absolute times are a model; the H100's own rows
(benchmarks/README.md) are the measurement (stop 51's profile put the DP step's excess at
54 ms at gpt2-small, ULS).

    python benchmarks/bench_traffic.py                        # gpt2-small, ULS and ELS, 64 users x G = 4 x 64 tokens
    python benchmarks/bench_traffic.py --models gpt2-medium --top 20
    python benchmarks/bench_traffic.py --json
    python benchmarks/bench_traffic.py --operand split --zero-always --without gram,layer_norm   # 9bc2cd5's step
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import sys
import time
import traceback
from pathlib import Path
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import bench_memory  # noqa: E402
from bench_ops import VIEW_OPS  # noqa: E402

import userdp.engine.contraction as contraction  # noqa: E402
import userdp.engine.ghost.grams as grams  # noqa: E402
import userdp.engine.layer_norm_grads as layer_norm_grads  # noqa: E402

#: H100 SXM peaks: HBM3 bytes/s, bf16 tensor-core and float32 SIMT FLOP/s (dense)
H100 = {"bandwidth": 3.35e12, "bf16": 989e12, "fp32": 67e12}
#: ops that allocate without writing
NO_WRITE = frozenset(
    {
        "empty.memory_format",
        "empty_strided.default",
        "empty_like.default",
        "new_empty.default",
        "new_empty_strided.default",
    }
)
GEMMS = frozenset({"mm", "bmm", "addmm", "baddbmm", "addbmm"})
#: ops that read only the elements their index picks from their first argument
GATHERS = frozenset({"gather", "index_select", "embedding", "index"})


def _bytes(t: torch.Tensor) -> int:
    """The bytes an op touches in ``t``: its elements, at most its storage (a broadcast reads little)."""
    n = t.numel() * t.element_size()
    try:
        return min(n, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return n


def _distinct(ts: list) -> list:
    """``ts`` with the second and later views of one storage left out."""
    seen, out = set(), []
    for t in ts:
        try:
            key = id(t.untyped_storage())
        except (RuntimeError, NotImplementedError):
            key = id(t)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def gemm_flops(name: str, args: tuple) -> float:
    """2 x multiply-adds of a GEMM op (``name`` without overload), from its argument shapes."""
    if name in ("mm", "bmm"):
        a, b = args[0], args[1]
    elif name in ("addmm", "baddbmm", "addbmm"):
        a, b = args[1], args[2]
    else:
        return 0.0
    batch = a.shape[0] if a.dim() == 3 else 1
    return 2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


def attention_flops(name: str, args: tuple) -> float:
    """An SDPA kernel's FLOPs: ``4 B H L S D`` forward, 2.5 times that backward (five GEMMs to two)."""
    q, k = args[0], args[1]
    fwd = 4.0 * math.prod(q.shape[:-1]) * k.shape[-2] * q.shape[-1]
    return fwd * (2.5 if "backward" in name else 1.0)


class Traffic(TorchDispatchMode):
    """Per op: bytes read and written, FLOPs and the roofline time, grouped by (op, argument shapes,
    the userdp function that called it)."""

    def __init__(self, rates: dict, frames: tuple[str, ...] = ("ghost.py", "contraction.py", "models.py")):
        super().__init__()
        self.rates, self._frames = rates, frames
        self.rows: dict = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])  # key -> [calls, bytes, flops, s]

    def _where(self) -> str:
        frames = [f for f in traceback.extract_stack() if any(w in f.filename for w in self._frames)]
        return f"{frames[-1].name}" if frames else "-"

    def charge(self, key: tuple, nbytes: float, flops: float, narrow: bool) -> None:
        r = self.rates
        t = max(nbytes / r["bandwidth"], flops / (r["bf16"] if narrow else r["fp32"])) + r["launch"]
        row = self.rows[key]
        row[0] += 1
        row[1] += nbytes
        row[2] += flops
        row[3] += t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__
        if name in VIEW_OPS:
            return out
        base = name.split(".")[0]
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outs:  # a metadata query (prim.device, sym sizes) or a scalar read: no kernel
            return out
        if base in ("copy_", "fill_", "zero_") or "out" in kwargs:
            ins = ins[1:] if base in ("copy_", "fill_", "zero_") else [t for t in ins if t is not kwargs.get("out")]
        if base in GATHERS:  # reads what it picks, a 32-byte sector each at worst, and its index
            read = sum(_bytes(t) for t in ins[1:]) + min(_bytes(ins[0]), 32 * sum(t.numel() for t in outs))
        else:
            read = sum(_bytes(t) for t in _distinct(ins))  # a Gram's two operands are one tensor: read once
        written = 0 if name in NO_WRITE else sum(_bytes(t) for t in outs)
        flops, narrow = 0.0, True
        if base in GEMMS:
            flops = gemm_flops(base, args)
            a = args[0] if base in ("mm", "bmm") else args[1]
            narrow = a.dtype in (torch.bfloat16, torch.float16)
        elif "scaled_dot_product" in base:
            flops = attention_flops(base, args)
            narrow = args[0].dtype in (torch.bfloat16, torch.float16)
        if read + written + flops == 0:
            return out
        shapes = tuple(tuple(t.shape) for t in ins[:2])
        self.charge((base, shapes, self._where()), read + written, flops, narrow)
        return out

    def total(self) -> float:
        return sum(r[3] for r in self.rows.values())


def _triton_operand(traffic: Traffic):
    """:func:`contraction.fused_operand` as the CUDA kernel makes it: the buffer, charged one read of
    ``y`` and one write of the buffer."""

    def fused(y, c, bad, wp, split=True):
        lead, (m, t, _) = y.shape[:-3], y.shape[-3:]
        buf = torch.empty(*lead, m * t, (2 if split else 1) * wp, dtype=torch.bfloat16, device=y.device)
        traffic.charge(
            ("triton_operand", (tuple(y.shape),), "fused_operand"),
            y.numel() * y.element_size() + buf.numel() * 2,
            0.0,
            True,
        )
        return buf

    return fused


class _LayerNormKernel:
    """:mod:`userdp.engine.layer_norm_triton`'s kernel as CUDA runs it: each launch charged one read of
    the input and the gradient, its statistics and its partial sums' write (the torch ops around it,
    ``var_mean`` and the partials' sum, are counted as they run)."""

    def __init__(self, traffic: Traffic):
        self.traffic = traffic

    def __getitem__(self, grid):
        def launch(x2, g2, mean, rstd, w, b, *args, **kwargs):
            nbytes = sum(t.numel() * t.element_size() for t in (x2, g2, mean, rstd, w, b))
            self.traffic.charge(("triton_layer_norm", (tuple(x2.shape),), "unit_grads"), nbytes, 0.0, True)

        return launch


class _GramKernel:
    """:mod:`userdp.engine.gram_triton`'s kernel as CUDA runs it: each launch charged one read of the
    two Grams and their row vectors and the write of its row sums."""

    def __init__(self, traffic: Traffic):
        self.traffic = traffic

    def __getitem__(self, grid):
        def launch(gx, gy, rbx, rby, v, qy, qx, sx, *args, ROW_SUMS=False, **kwargs):
            outs = (v, qy, qx, sx) if ROW_SUMS else (v, qy, qx)
            nbytes = sum(t.numel() * t.element_size() for t in (gx, gy, rbx, rby, *outs))
            self.traffic.charge(("triton_gram_pair", (tuple(gx.shape),), "pair_rows"), nbytes, 0.0, True)

        return launch


def _on_cuda(traffic: Traffic, without: tuple = ()):
    """The CUDA kernels in place of the CPU's torch passes: the clipped sum's operand, the ghost
    norms' Gram-pair reductions and the LayerNorms' per-unit gradients (where triton imports here;
    ``without``: "gram", "layer_norm" left to the torch passes)."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(contraction, "fused_operand", _triton_operand(traffic)))
    if "gram" in without:
        stack.enter_context(mock.patch.object(grams, "FUSED_GRAMS", "off"))
    if "layer_norm" in without:
        stack.enter_context(mock.patch.object(layer_norm_grads, "FUSED_LAYER_NORM", "off"))
    if grams.gram_triton is not None and "gram" not in without:
        stack.enter_context(mock.patch.object(grams, "_grams_kernel_allowed", lambda device: True))
        stack.enter_context(mock.patch.object(grams.gram_triton, "_pair_kernel", _GramKernel(traffic)))
    if layer_norm_grads.layer_norm_triton is not None and "layer_norm" not in without:
        stack.enter_context(mock.patch.object(layer_norm_grads, "_fused_allowed", lambda device: True))
        stack.enter_context(
            mock.patch.object(layer_norm_grads.layer_norm_triton, "_grads_kernel", _LayerNormKernel(traffic))
        )
    return stack


def profile(
    mode: FakeTensorMode,
    model,
    algorithm: str,
    users: int,
    group: int,
    seq: int,
    rates: dict,
    lazy: bool = True,
    without: tuple = (),
) -> dict:
    """Traffic and roofline time of a non-private forward and backward and of one ghost chunk (its bad
    units' rows zeroed lazily, as the loop runs it on a device, or always: ``lazy`` False)."""
    _, nonprivate, ghost = bench_memory.sides(model, algorithm, users, group, seq, lazy)
    seen = {}
    with mode, bench_memory.device_path():
        for side, fn in (("nonprivate", nonprivate), ("ghost", ghost)):
            tr = Traffic(rates)
            with _on_cuda(tr, without), tr:
                fn()
            seen[side] = tr
    a, b = seen["nonprivate"], seen["ghost"]
    return {"algorithm": algorithm, "nonprivate": a, "ghost": b}


def excess(a: Traffic, b: Traffic) -> list:
    """(key, calls, bytes, flops, seconds) of the ghost chunk's rows minus the same op on as many
    elements of the non-private side (any caller), largest time first."""

    def same(op: str, shapes: tuple) -> tuple:  # [n, L, d] and [n·L, d] are the same op on the same data
        return op, tuple((math.prod(s), s[-1] if s else 1) for s in shapes)

    plain = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for (op, shapes, _), r in a.rows.items():
        for i in range(4):
            plain[same(op, shapes)][i] += r[i]
    by_shape = collections.defaultdict(list)
    for key, r in b.rows.items():
        by_shape[same(*key[:2])].append((key, r))
    out = []
    for k, rows in by_shape.items():
        total = sum(r[3] for _, r in rows)
        left = plain.get(k, [0, 0.0, 0.0, 0.0])
        if total - left[3] <= 0:
            continue
        share = (total - left[3]) / total
        for key, r in rows:
            out.append((key, r[0], r[1] * share, r[2] * share, r[3] * share))
    return sorted(out, key=lambda x: -x[4])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["gpt2-small"], choices=list(bench_memory.SHAPES))
    p.add_argument("--algorithms", nargs="+", default=["uls", "els"], choices=["uls", "els"])
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--bandwidth", type=float, default=0.8, help="fraction of the H100's HBM bandwidth reached")
    p.add_argument("--bf16", type=float, default=0.6, help="fraction of the bf16 tensor-core peak reached")
    p.add_argument("--fp32", type=float, default=0.7, help="fraction of the float32 SIMT peak reached")
    p.add_argument("--launch", type=float, default=3e-6, help="seconds an op adds whatever its size")
    p.add_argument("--operand", choices=["split", "rounded"], default=contraction.SUM_OPERAND)
    p.add_argument(
        "--zero-always",
        action="store_true",
        help="zero the bad units' rows in every chunk (a sharded step; the code before lazy zeroing)",
    )
    p.add_argument(
        "--without",
        default="",
        help="kernels left to the torch passes, comma-separated: gram, layer_norm (the code before them)",
    )
    p.add_argument("--top", type=int, default=12, help="the DP-only rows to list")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rates = {
        "bandwidth": H100["bandwidth"] * args.bandwidth,
        "bf16": H100["bf16"] * args.bf16,
        "fp32": H100["fp32"] * args.fp32,
        "launch": args.launch,
    }
    for name in args.models:
        mode = FakeTensorMode()
        model = bench_memory.fake_gpt2(mode, **bench_memory.SHAPES[name])
        for algorithm in args.algorithms:
            t0 = time.perf_counter()
            with mock.patch.object(contraction, "SUM_OPERAND", args.operand):
                res = profile(
                    mode,
                    model,
                    algorithm,
                    args.users,
                    args.group_size,
                    args.seq_len,
                    rates,
                    lazy=not args.zero_always,
                    without=tuple(filter(None, args.without.split(","))),
                )
            a, b = res["nonprivate"], res["ghost"]
            rows = excess(a, b)
            row = {
                "model": name,
                "algorithm": algorithm,
                "operand": args.operand,
                "users": args.users,
                "group_size": args.group_size,
                "seq_len": args.seq_len,
                "nonprivate_s": a.total(),
                "ghost_s": b.total(),
                "ratio": b.total() / a.total(),
                "nonprivate_gb": sum(r[1] for r in a.rows.values()) / 1e9,
                "ghost_gb": sum(r[1] for r in b.rows.values()) / 1e9,
                "nonprivate_ops": sum(r[0] for r in a.rows.values()),
                "ghost_ops": sum(r[0] for r in b.rows.values()),
                "top": [
                    {
                        "op": k[0],
                        "shapes": k[1],
                        "in": k[2],
                        "calls": n,
                        "gb": by / 1e9,
                        "gflop": fl / 1e9,
                        "ms": s * 1e3,
                    }
                    for k, n, by, fl, s in rows[: args.top]
                ],
                "seconds": round(time.perf_counter() - t0, 1),
            }
            if args.json:
                print(json.dumps(row), flush=True)
                continue
            print(
                f"{name} {algorithm.upper()} ({args.operand} operand): non-private {row['nonprivate_s'] * 1e3:.1f} ms "
                f"({row['nonprivate_gb']:.1f} GB, {row['nonprivate_ops']} ops), ghost chunk "
                f"{row['ghost_s'] * 1e3:.1f} ms ({row['ghost_gb']:.1f} GB, {row['ghost_ops']} ops): "
                f"{row['ratio']:.3f}x",
                flush=True,
            )
            for t in row["top"]:
                print(
                    f"  {t['ms']:7.2f} ms {t['gb']:7.2f} GB {t['gflop']:9.1f} GFLOP  x{t['calls']:<4d} {t['op']} "
                    f"{t['shapes']} in {t['in']}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
