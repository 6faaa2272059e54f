"""The clipped sum's operand in one pass on CUDA: ``c_u · y`` rounded to bf16 (the rounded operand,
the default), or ``[hi | lo] = split(c_u · y)`` (exact), bad units zeroed.

Why by hand: on tensor cores the clipped sum of a layer is ``xᵀ [hi | lo]`` where ``hi + lo`` is
exactly ``c_u · y`` (:func:`userdp.engine.contraction.split_bf16`). In torch that is a masked copy of
``y`` (a non-finite unit's rows zeroed), the product in float32, its rounding to bf16 and the
remainder: four passes over the factor and a float32 copy of it. On an H100 they were the largest
part of the DP step's elementwise time (``masked_fill_``, ``mul``, ``copy_``, ``sub`` on the
``[64, 256, 3072]`` factors; benchmarks/README.md). This kernel reads ``y`` once and writes the
bf16 buffer once, with the same arithmetic: ``p = c_u · y`` in float32 (exact: both are bf16
numbers), ``hi`` = p rounded to bf16, ``lo`` = ``p - hi`` (exact in float32, and exactly a bf16
number), zeros for a bad unit and in the pad columns.

It is used only after :func:`userdp.engine.contraction.fused_operand` finds it bit-equal to the torch
path on a test input on that device, once per process. Importing this module needs ``triton``;
on a CPU, tests run it under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

#: columns per program
BLOCK_COLUMNS = 1024


@triton.jit
def _split_kernel(
    y_ptr,
    c_ptr,
    bad_ptr,
    out_ptr,
    width,
    padded,
    t_per_unit,
    y_row_stride,
    BLOCK: tl.constexpr,
    HAS_BAD: tl.constexpr,
    SPLIT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    unit = row // t_per_unit
    inside = cols < width
    v = tl.load(y_ptr + row * y_row_stride + cols, mask=inside, other=0.0).to(tl.float32)
    p = v * tl.load(c_ptr + unit).to(tl.float32)
    if HAS_BAD:
        p = tl.where(tl.load(bad_ptr + unit) != 0, 0.0, p)
    p = tl.where(inside, p, 0.0)
    # p rounded to bf16 to nearest, ties to even, as torch's copy_ rounds: on the bits, so that the
    # cast after it is exact whatever rounding the cast does (Triton's interpreter truncates)
    bits = p.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    hi32 = bits.to(tl.float32, bitcast=True)
    hi = hi32.to(tl.bfloat16)
    keep = cols < padded
    if SPLIT:
        lo = (p - hi32).to(tl.bfloat16)
        base = out_ptr + row * (2 * padded)
        tl.store(base + cols, hi, mask=keep)
        tl.store(base + padded + cols, lo, mask=keep)
    else:
        tl.store(out_ptr + row * padded + cols, hi, mask=keep)


def scale_split(
    y: torch.Tensor, c: torch.Tensor, bad: torch.Tensor | None, padded: int, split: bool = True
) -> torch.Tensor | None:
    """``[..., m·T, 2·padded]`` bf16: ``[hi | lo]`` of ``c_u · y`` as contraction.clipped_contraction
    builds it (each half ``padded`` columns, the pad zero), units ``bad`` zeroed; ``y`` bf16
    ``[..., m, T, Y]`` with unit-stride columns and one row stride; ``c`` ``[..., m]`` bf16 numbers
    (any float dtype); ``bad`` bool ``[m]`` or None. With ``split`` False, ``[..., m·T, padded]``:
    ``hi`` alone, ``c_u · y`` rounded to bf16 (the rounded operand). None when ``y``'s layout does
    not allow one row stride (the caller takes the torch path)."""
    lead, (m, t, width) = y.shape[:-3], y.shape[-3:]
    if width == 0 or y.stride(-1) != 1 or not _one_row_stride(y):
        return None
    rows = y.numel() // width
    flat = y.as_strided((rows, width), (y.stride(-2), 1))  # y's own storage offset
    out = torch.empty(*lead, m * t, (2 if split else 1) * padded, dtype=torch.bfloat16, device=y.device)
    if rows == 0:
        return out
    cf = c.reshape(-1).contiguous()
    has_bad = bad is not None
    bad_arg = bad.reshape(-1).to(torch.uint8).contiguous() if has_bad else cf  # unread when has_bad is False
    if has_bad and bad_arg.numel() != cf.numel():  # one bad flag per unit, repeated over the lead dimensions
        bad_arg = bad_arg.repeat(cf.numel() // bad_arg.numel())
    grid = (rows, triton.cdiv(padded, BLOCK_COLUMNS))
    # Triton launches on the current device: make it the tensors' (cuda:1 in a one-process run, ...)
    with torch.cuda.device(y.device) if y.device.type == "cuda" else contextlib.nullcontext():
        _split_kernel[grid](
            flat, cf, bad_arg, out, width, padded, t, flat.stride(0), BLOCK=BLOCK_COLUMNS, HAS_BAD=has_bad, SPLIT=split
        )
    return out


def _one_row_stride(y: torch.Tensor) -> bool:
    """Every row of ``y`` (all dimensions but the last) is ``stride(-2)`` elements after the one
    before it: the whole tensor is one strided ``[rows, width]`` matrix."""
    expect = y.stride(-2)
    for size, stride in zip(reversed(y.shape[:-1]), reversed(y.stride()[:-1]), strict=True):
        if size != 1 and stride != expect:
            return False
        expect *= size
    return True
