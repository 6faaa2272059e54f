"""The ChaCha20 noise slab as one hand-written Triton kernel (CUDA): blocks -> float64 normals.

Why by hand: ``torch.compile`` of the tensor-level block function (:mod:`userdp.engine.noise.chacha`)
realizes dozens of int64 intermediates a slab and splits it into five kernels; on an H100 that
was 0.020 s per 124M normals and 0.055 s per 355M (the noise was a quarter of gpt2-medium's DP
overhead; benchmarks/README.md). Here each program lane holds one block's 16 state words as
uint32 registers through the 20 rounds and writes the block's eight normals, the same
arithmetic as :func:`userdp.engine.noise.chacha._normals_from_blocks` step for step: nothing but the
normals touches memory. No maintained library offers this (docs/engine.md, "Noise").

It is used only after :func:`userdp.engine.noise.chacha._check_compiled` finds its normals within
``NORMALS_ULPS`` of the eager tensor code on 65,536 blocks (libdevice's log/sin/cos against
libm: an ulp or two; a wrong bit in the integer part moves a block's normals by O(1)). Importing
this module needs ``triton`` (it comes with CUDA builds of torch); on a CPU, tests run the same
kernel under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

#: blocks per program (each lane one block; 8 float64 normals out per lane)
BLOCKS_PER_PROGRAM = 256
_PI: dict = {}  # device -> pi as a float64 tensor (a Python float argument would reach Triton as float32)


@triton.jit
def _rotl(x, n: tl.constexpr):
    return (x << n) | (x >> (32 - n))


@triton.jit
def _quarter(a, b, c, d):
    a = a + b
    d = _rotl(d ^ a, 16)
    c = c + d
    b = _rotl(b ^ c, 12)
    a = a + b
    d = _rotl(d ^ a, 8)
    c = c + d
    b = _rotl(b ^ c, 7)
    return a, b, c, d


@triton.jit
def _pair(wa, wb, wc, wd, pi, out_ptr, base, mask):
    """Two normals from four words, exactly as ``_normals_from_blocks``: u1 from 85 bits, the
    angle from 32 (the multiplications by 2^26 and the divisions by powers of two are exact)."""
    hi = (wa >> 5).to(tl.float64) * 67108864.0 + (wb >> 6).to(tl.float64)
    lo = (wc.to(tl.float64) + 0.5) / 4294967296.0
    u1 = (hi + lo) / 9007199254740992.0
    r = tl.sqrt(-2.0 * tl.log(u1))
    # eager: fl(2 pi / 2^32) * (w + 0.5); pi * 2^-31 is the same double, and scaling by 2^-31 is exact
    theta = ((wd.to(tl.float64) + 0.5) * pi) / 2147483648.0
    tl.store(out_ptr + base, r * tl.cos(theta), mask=mask)
    tl.store(out_ptr + base + 1, r * tl.sin(theta), mask=mask)


@triton.jit
def _words_out(
    x0,
    x1,
    x2,
    x3,
    x4,
    x5,
    x6,
    x7,
    x8,
    x9,
    x10,
    x11,
    x12,
    x13,
    x14,
    x15,
    i0,
    i1,
    i2,
    i3,
    i4,
    i5,
    i6,
    i7,
    i8,
    i9,
    i10,
    i11,
    i12,
    i13,
    i14,
    i15,
    out_ptr,
    base,
    mask,
):
    tl.store(out_ptr + base, (x0 + i0).to(tl.int64), mask=mask)
    tl.store(out_ptr + base + 1, (x1 + i1).to(tl.int64), mask=mask)
    tl.store(out_ptr + base + 2, (x2 + i2).to(tl.int64), mask=mask)
    tl.store(out_ptr + base + 3, (x3 + i3).to(tl.int64), mask=mask)
    tl.store(out_ptr + base + 4, (x4 + i4).to(tl.int64), mask=mask)
    tl.store(out_ptr + base + 5, (x5 + i5).to(tl.int64), mask=mask)
    tl.store(out_ptr + base + 6, (x6 + i6).to(tl.int64), mask=mask)
    tl.store(out_ptr + base + 7, (x7 + i7).to(tl.int64), mask=mask)
    tl.store(out_ptr + base + 8, (x8 + i8).to(tl.int64), mask=mask)
    tl.store(out_ptr + base + 9, (x9 + i9).to(tl.int64), mask=mask)
    tl.store(out_ptr + base + 10, (x10 + i10).to(tl.int64), mask=mask)
    tl.store(out_ptr + base + 11, (x11 + i11).to(tl.int64), mask=mask)
    tl.store(out_ptr + base + 12, (x12 + i12).to(tl.int64), mask=mask)
    tl.store(out_ptr + base + 13, (x13 + i13).to(tl.int64), mask=mask)
    tl.store(out_ptr + base + 14, (x14 + i14).to(tl.int64), mask=mask)
    tl.store(out_ptr + base + 15, (x15 + i15).to(tl.int64), mask=mask)


@triton.jit
def _slab_kernel(ctr_ptr, fixed_ptr, pi_ptr, out_ptr, n, BLOCK: tl.constexpr, WORDS: tl.constexpr):
    lane = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = lane < n
    c12 = tl.load(ctr_ptr + lane, mask=mask, other=0).to(tl.uint32)
    zero = tl.zeros([BLOCK], dtype=tl.uint32)
    i0 = zero + tl.load(fixed_ptr + 0).to(tl.uint32)
    i1 = zero + tl.load(fixed_ptr + 1).to(tl.uint32)
    i2 = zero + tl.load(fixed_ptr + 2).to(tl.uint32)
    i3 = zero + tl.load(fixed_ptr + 3).to(tl.uint32)
    i4 = zero + tl.load(fixed_ptr + 4).to(tl.uint32)
    i5 = zero + tl.load(fixed_ptr + 5).to(tl.uint32)
    i6 = zero + tl.load(fixed_ptr + 6).to(tl.uint32)
    i7 = zero + tl.load(fixed_ptr + 7).to(tl.uint32)
    i8 = zero + tl.load(fixed_ptr + 8).to(tl.uint32)
    i9 = zero + tl.load(fixed_ptr + 9).to(tl.uint32)
    i10 = zero + tl.load(fixed_ptr + 10).to(tl.uint32)
    i11 = zero + tl.load(fixed_ptr + 11).to(tl.uint32)
    i13 = zero + tl.load(fixed_ptr + 13).to(tl.uint32)
    i14 = zero + tl.load(fixed_ptr + 14).to(tl.uint32)
    i15 = zero + tl.load(fixed_ptr + 15).to(tl.uint32)
    x0, x1, x2, x3, x4, x5, x6, x7 = i0, i1, i2, i3, i4, i5, i6, i7
    x8, x9, x10, x11, x12, x13, x14, x15 = i8, i9, i10, i11, c12, i13, i14, i15
    for _ in tl.static_range(10):
        x0, x4, x8, x12 = _quarter(x0, x4, x8, x12)
        x1, x5, x9, x13 = _quarter(x1, x5, x9, x13)
        x2, x6, x10, x14 = _quarter(x2, x6, x10, x14)
        x3, x7, x11, x15 = _quarter(x3, x7, x11, x15)
        x0, x5, x10, x15 = _quarter(x0, x5, x10, x15)
        x1, x6, x11, x12 = _quarter(x1, x6, x11, x12)
        x2, x7, x8, x13 = _quarter(x2, x7, x8, x13)
        x3, x4, x9, x14 = _quarter(x3, x4, x9, x14)
    if WORDS:  # the keystream itself (tests: RFC 8439, bit for bit)
        base = lane.to(tl.int64) * 16
        _words_out(
            x0,
            x1,
            x2,
            x3,
            x4,
            x5,
            x6,
            x7,
            x8,
            x9,
            x10,
            x11,
            x12,
            x13,
            x14,
            x15,
            i0,
            i1,
            i2,
            i3,
            i4,
            i5,
            i6,
            i7,
            i8,
            i9,
            i10,
            i11,
            c12,
            i13,
            i14,
            i15,
            out_ptr,
            base,
            mask,
        )
    else:
        pi = tl.load(pi_ptr)
        base = lane.to(tl.int64) * 8
        _pair(x0 + i0, x1 + i1, x2 + i2, x3 + i3, pi, out_ptr, base, mask)
        _pair(x4 + i4, x5 + i5, x6 + i6, x7 + i7, pi, out_ptr, base + 2, mask)
        _pair(x8 + i8, x9 + i9, x10 + i10, x11 + i11, pi, out_ptr, base + 4, mask)
        _pair(x12 + c12, x13 + i13, x14 + i14, x15 + i15, pi, out_ptr, base + 6, mask)


def _launch(ctr: torch.Tensor, fixed: torch.Tensor, words: bool) -> torch.Tensor:
    ctr = ctr.contiguous()
    n = ctr.numel()
    out = torch.empty(16 * n if words else 8 * n, dtype=torch.int64 if words else torch.float64, device=ctr.device)
    if n:
        pi = _PI.get(ctr.device)
        if pi is None:  # once per device (a fill kernel, no copy), not once per slab
            pi = _PI[ctr.device] = torch.full((1,), math.pi, dtype=torch.float64, device=ctr.device)
        grid = (triton.cdiv(n, BLOCKS_PER_PROGRAM),)
        with _on(ctr.device):  # Triton launches on the current device: make it the tensors' (cuda:1, ...)
            _slab_kernel[grid](ctr, fixed.contiguous(), pi, out, n, BLOCK=BLOCKS_PER_PROGRAM, WORDS=words)
    return out


def _on(device: torch.device):
    """The context that makes ``device`` current for a launch (nothing to do off CUDA)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def slab(ctr: torch.Tensor, fixed: torch.Tensor) -> torch.Tensor:
    """The kernel behind :func:`userdp.engine.noise.chacha._slab_eager`'s signature: ``ctr`` the block
    counters (int64, below 2^32), ``fixed`` the 16 input words (int64); returns
    ``8 * len(ctr)`` float64 normals on ``ctr``'s device."""
    return _launch(ctr, fixed, False)


def blocks(ctr: torch.Tensor, fixed: torch.Tensor) -> torch.Tensor:
    """The same kernel's keystream: ``[len(ctr), 16]`` int64 words, as
    :func:`userdp.engine.noise.chacha._words` returns them (tests)."""
    return _launch(ctr, fixed, True).view(-1, 16)
