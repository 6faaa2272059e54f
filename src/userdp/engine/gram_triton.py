"""A ghost norm's Gram-pair reductions in one pass on CUDA.

Why by hand: each pair of Gram matrices ``Gx``, ``Gy`` (``[m, Ta, Tb]`` float32) gives a unit's
squared norm ``Σ_ts Gx⊙Gy`` and, for its proven rounding bound, two quadratic forms of the
absolute Grams, ``raᵀ|Gy|rb`` and ``raᵀ|Gx|rb`` (and, with the rounded operand, ``|Gx|``'s row
sums): :func:`userdp.engine.ghost.grams.inner`. In torch that is a batched dot over the rows, two
``abs`` copies and two batched products: nine passes over Gram-sized arrays per pair, 3.7 ms of a
gpt2-small ghost chunk and 7 ms of a gpt2-medium one by the roofline count
(``benchmarks/bench_traffic.py``). This kernel reads each Gram once and writes, per row ``t``, the
four row sums; torch then takes the sums over rows (a few ``[m, Ta]`` kernels).

The rounding bound does not depend on the order of these float32 sums (any summation of n terms
moves each term through at most n - 1 additions), so the bound of docs/guarantee.md holds for the
kernel's sums as for torch's. :func:`userdp.engine.ghost.grams.inner` uses it on CUDA once it has matched
the torch passes on test inputs (once per process; else a warning and the torch passes); on a CPU,
tests run it under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

#: rows (t) and columns (s) of a Gram per program
BLOCK_T = 16
BLOCK_S = 256


@triton.jit
def _pair_kernel(
    gx_ptr,
    gy_ptr,
    rb_x_ptr,
    rb_y_ptr,
    v_ptr,
    qy_ptr,
    qx_ptr,
    sx_ptr,
    ta,
    tb,
    t_blocks,
    s_blocks,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
    ROW_SUMS: tl.constexpr,
):
    # one program: BLOCK_T rows x BLOCK_S columns of one unit's pair; its row sums go to column
    # program's s-block of the partial outputs [m, ta, s_blocks] (no atomics: one order every run)
    pid = tl.program_id(0).to(tl.int64)
    sb = pid % s_blocks
    rest = pid // s_blocks
    unit = rest // t_blocks
    ts = (rest % t_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    ss = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    t_in = ts < ta
    s_in = ss < tb
    mask = t_in[:, None] & s_in[None, :]
    at = unit * ta * tb + ts[:, None] * tb + ss[None, :]
    gx = tl.load(gx_ptr + at, mask=mask, other=0.0)
    gy = tl.load(gy_ptr + at, mask=mask, other=0.0)
    rbx = tl.load(rb_x_ptr + unit * tb + ss, mask=s_in, other=0.0)
    rby = tl.load(rb_y_ptr + unit * tb + ss, mask=s_in, other=0.0)
    out = (unit * ta + ts) * s_blocks + sb
    tl.store(v_ptr + out, tl.sum(gx * gy, axis=1), mask=t_in)
    tl.store(qy_ptr + out, tl.sum(tl.abs(gy) * rbx[None, :], axis=1), mask=t_in)
    tl.store(qx_ptr + out, tl.sum(tl.abs(gx) * rby[None, :], axis=1), mask=t_in)
    if ROW_SUMS:
        tl.store(sx_ptr + out, tl.sum(tl.abs(gx), axis=1), mask=t_in)


def pair_rows(
    gx: torch.Tensor, gy: torch.Tensor, rb_x: torch.Tensor, rb_y: torch.Tensor, row_sums: bool
) -> tuple | None:
    """``(v, qy, qx, sx)`` ``[m, Ta]`` float32, per row t: ``Σ_s Gx_ts Gy_ts``, ``Σ_s |Gy_ts| rb_x_s``,
    ``Σ_s |Gx_ts| rb_y_s`` and (``row_sums``; else None) ``Σ_s |Gx_ts|``. ``gx``, ``gy`` contiguous
    float32 ``[m, Ta, Tb]``, ``rb_x``, ``rb_y`` ``[m, Tb]``. None where the inputs are not so (the
    caller takes the torch passes)."""
    if not (
        gx.dtype == gy.dtype == torch.float32
        and gx.shape == gy.shape
        and gx.dim() == 3
        and gx.is_contiguous()
        and gy.is_contiguous()
    ):
        return None
    m, ta, tb = gx.shape
    if m * ta * tb == 0:
        return None
    rbx = rb_x.to(torch.float32).contiguous()
    rby = rb_y.to(torch.float32).contiguous()
    if rbx.shape != (m, tb) or rby.shape != (m, tb):
        return None
    t_blocks, s_blocks = triton.cdiv(ta, BLOCK_T), triton.cdiv(tb, BLOCK_S)
    parts = torch.empty(4 if row_sums else 3, m, ta, s_blocks, dtype=torch.float32, device=gx.device)
    sx = parts[3] if row_sums else parts[0]  # unwritten without ROW_SUMS
    with torch.cuda.device(gx.device) if gx.device.type == "cuda" else contextlib.nullcontext():
        _pair_kernel[(m * t_blocks * s_blocks,)](
            gx,
            gy,
            rbx,
            rby,
            parts[0],
            parts[1],
            parts[2],
            sx,
            ta,
            tb,
            t_blocks,
            s_blocks,
            BLOCK_T=BLOCK_T,
            BLOCK_S=BLOCK_S,
            ROW_SUMS=row_sums,
        )
    rows = parts[..., 0] if s_blocks == 1 else parts.sum(-1)
    return rows[0], rows[1], rows[2], (rows[3] if row_sums else None)
