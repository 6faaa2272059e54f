"""A LayerNorm's per-unit weight and bias gradients in one pass on CUDA.

Why by hand: unit u's LayerNorm gradients are ``Σ_t g_t ⊙ x̂_t`` (weight) and ``Σ_t g_t`` (bias),
``x̂_t = (x_t - μ_t) · r_t`` the normalized input. In torch that is the normalization recomputed
(a float32 copy of the input), the product (another) and two reductions over each unit's tokens:
six passes over ``[tokens, d]`` float32 arrays a layer, 6.6 ms of a gpt2-medium ghost chunk by the
roofline count (``benchmarks/bench_traffic.py``). Opacus computes them the same way. This kernel
reads ``x`` and ``g`` once, with ``μ`` and ``r`` from one ``var_mean`` before it, and accumulates
each unit's sums in float32 registers.

Only the clipped sum's utility rests on it, not the guarantee: the per-unit vectors it returns
are the ones whose norms are taken and whose clipped sum is formed, whatever their values.
:func:`userdp.engine.layer_norm_grads.per_unit_grads` uses it on CUDA once it has matched the torch
path on a test input (once per process); on a CPU, tests run it under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

#: feature columns and tokens per program
BLOCK_D = 128
BLOCK_T = 64


@triton.jit
def _grads_kernel(
    x_ptr,
    g_ptr,
    mean_ptr,
    rstd_ptr,
    w_ptr,
    b_ptr,
    t_per_unit,
    blocks_per_unit,
    width,
    x_stride,
    g_stride,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # one program: BLOCK_T tokens of one unit x BLOCK_D features; its two partial sums go to row
    # program_id(0) of the partial outputs (no atomics: the same sums in the same order every run)
    part = tl.program_id(0).to(tl.int64)
    unit = part // blocks_per_unit
    ts = (part % blocks_per_unit) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    inside = cols < width
    live = ts < t_per_unit
    rows = unit * t_per_unit + ts
    mask = live[:, None] & inside[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows[:, None] * g_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mu = tl.load(mean_ptr + rows, mask=live, other=0.0)
    r = tl.load(rstd_ptr + rows, mask=live, other=0.0)
    tl.store(w_ptr + part * width + cols, tl.sum(g * ((x - mu[:, None]) * r[:, None]), axis=0), mask=inside)
    tl.store(b_ptr + part * width + cols, tl.sum(g, axis=0), mask=inside)


def unit_grads(x: torch.Tensor, g: torch.Tensor, m: int, eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``([m, d], [m, d])`` float32: per unit ``Σ_t g_t ⊙ x̂_t`` and ``Σ_t g_t`` over its tokens
    (``x``, ``g`` ``[..., d]``, a unit's tokens consecutive, the same count each): partial sums over
    blocks of ``BLOCK_T`` tokens in the kernel, then their sum. None when a layout is not one strided
    matrix with unit-stride features (the caller takes the torch path)."""
    d = int(x.shape[-1])
    rows = x.numel() // d if d else 0
    if d == 0 or rows == 0 or rows % m or g.shape != x.shape:
        return None
    x2, g2 = _matrix(x, d), _matrix(g, d)
    if x2 is None or g2 is None:
        return None
    t = rows // m
    var, mean = torch.var_mean(x2.float(), dim=1, correction=0)
    rstd = torch.rsqrt(var + eps)
    blocks = triton.cdiv(t, BLOCK_T)
    w = torch.empty(m * blocks, d, dtype=torch.float32, device=x.device)
    b = torch.empty_like(w)
    grid = (m * blocks, triton.cdiv(d, BLOCK_D))
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        _grads_kernel[grid](
            x2, g2, mean, rstd, w, b, t, blocks, d, x2.stride(0), g2.stride(0), BLOCK_D=BLOCK_D, BLOCK_T=BLOCK_T
        )
    if blocks == 1:
        return w, b
    return w.view(m, blocks, d).sum(1), b.view(m, blocks, d).sum(1)


def _matrix(t: torch.Tensor, d: int) -> torch.Tensor | None:
    """``t`` as one ``[rows, d]`` strided matrix (a view), or None."""
    if t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, d)
    except RuntimeError:
        return None
