"""The clipped sum's contraction, and the arithmetic it runs on: bf16 tensor cores or float32.

Ghost clipping (:mod:`userdp.engine.ghost`) forms each unit's norm from Gram matrices and the chunk's
clipped sum as one product ``Σ_u c_u Σ_t x_t ⊗ y_t`` (:func:`clipped_contraction`). This module holds
how those products are computed, and nothing of what they mean:

* where bf16 factors are contracted on tensor cores (:data:`TENSOR_CORES`: bf16 inputs, float32
  accumulation, aten ``mm.dtype``/``bmm.dtype``, :func:`mm32`) and how the CPU emulates them;
* the clip factor rounded down to bf16 (:func:`round_down_bf16`), so ``c_u · y`` is exact in float32;
* the clipped sum's operand (:data:`SUM_OPERAND`): ``[hi | lo]``, ``c_u · y`` split exactly into two
  bf16 pieces (:func:`split_operand`), or ``c_u · y`` rounded to bf16 (:func:`rounded_operand`,
  whose rounding the norm's bound takes in: :func:`operand_roundoff`), each also built by one Triton
  kernel (:mod:`userdp.engine.split_triton`) once it has matched torch's passes bit for bit
  (:func:`fused_operand`);
* the rows of a wide factor stored aligned for the tensor cores' fast GEMMs (:func:`aligned_rows`),
  and the bad units' rows zeroed in their own layout (:func:`zero_rows`, :func:`must_zero`), or
  left to a redo of the step where it zeroes lazily (:func:`defers_zeroing`).

(A ghost norm's Gram-pair row sums and their kernel are the Gram stage's:
:func:`userdp.engine.ghost.grams.gram_pair_rows`.) The switches (:data:`TENSOR_CORES`,
:data:`FUSED_SPLIT`, :data:`SUM_OPERAND`) are read at each call, so tests and benchmarks set them here.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from userdp.engine import kernel_gate

NO_TRITON: str | None = None  # why the Triton kernel cannot be imported here
try:  # the CUDA kernels are written in Triton, which CUDA builds of torch bring (the CPU wheel does not)
    from userdp.engine import split_triton
except Exception as exc:  # noqa: BLE001 - a missing or broken triton: the warning says why
    split_triton = None
    NO_TRITON = f"no triton: {type(exc).__name__}: {str(exc)[:120]}"


#: where bf16 factors are contracted on tensor cores (bf16 inputs, float32 accumulation and
#: output: aten ``mm.dtype``/``bmm.dtype``); elsewhere (the CPU) the reference path upcasts first.
#: "auto" follows the device; tests force "on" to run the same arithmetic on the CPU (emulated).
TENSOR_CORES = "auto"
TC_DEVICES = ("cuda", "meta")


#: where the clipped sum's ``[hi | lo]`` operand is built by one Triton kernel
#: (:mod:`userdp.engine.split_triton`) instead of four torch passes: "auto" on CUDA, "off" never,
#: "on" on any device (tests, under Triton's interpreter). Either way the same bits (checked).
FUSED_SPLIT = "auto"
FUSED_CHECKED: dict = {}  # device type -> True, or why the kernel is not used

#: the clipped sum's operand on tensor cores. "rounded" (the default): ``c_u · y`` rounded to bf16, one
#: bf16 GEMM (a weight gradient's FLOPs); each entry's rounding, at most 2^-8 of it, moves the unit's sum
#: by at most 2^-8 · c_u · spread (:func:`userdp.engine.ghost.grams.spread`), which the clip factor's
#: bound adds (``ghost.bound.bounded_norms``), so a unit still adds at most C; the price, a clip factor ~0.65%
#: lower for a clipped unit (``benchmarks/bench_operand.py``). "split": ``[hi | lo]``, which is
#: ``c_u · y`` exactly, at twice the FLOPs (the roofline count, ``benchmarks/bench_traffic.py``: a
#: gpt2-small ghost chunk 1.35x a non-private forward and backward with it, 1.26x rounded).
SUM_OPERAND = "rounded"
#: the relative error of rounding a float32 number to bf16 (8 significand bits, to nearest)
ROUNDED_OPERAND_U = 2.0**-8


def defers_zeroing(device: torch.device) -> bool:
    """Whether knowing if any unit is bad would wait for ``device`` (every device but the CPU): there a
    step may leave the bad units' rows unzeroed and, where one turns out bad, be computed again
    with them zeroed (:attr:`~userdp.engine.clipping.StepClipping.lazy_zeroing`)."""
    return device.type != "cpu"


def must_zero(bad: torch.Tensor, lazy: bool = False) -> bool:
    """Whether the bad units' factors must be zeroed before the clipped sum (their clip factor is
    already 0, but 0 times Inf is NaN). On a CPU reading ``bad.any()`` costs nothing, so the masked
    copies of every factor are made only when a unit is bad. On a device (:func:`defers_zeroing`)
    that read would wait for it: the copies are made always (zeroing no unit changes no value),
    unless ``lazy``, where none is made."""
    if not defers_zeroing(bad.device):
        return bool(bad.any())
    return not lazy


def tensor_cores(device: torch.device) -> bool:
    return TENSOR_CORES == "on" or (TENSOR_CORES == "auto" and device.type in TC_DEVICES)


def mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two bf16 tensors (2-D or batched 3-D) with float32 accumulation and output.

    On CUDA one tensor-core GEMM (aten ``mm.dtype``/``bmm.dtype``); on the CPU the same numbers by
    upcasting first (a product of two bf16 numbers is exact in float32, so the two differ only in
    the order of the float32 sums)."""
    if a.device.type in TC_DEVICES:
        return (torch.bmm if a.dim() == 3 else torch.mm)(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def round_down_bf16(c: torch.Tensor) -> torch.Tensor:
    """The largest bf16 values <= ``c`` (float32, >= 0): the float32 mantissa truncated to bf16's
    7 bits, which for non-negative numbers rounds down. Exact: the result is a bf16 number."""
    return (c.float().contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)


def split_bf16(
    p: torch.Tensor, hi: torch.Tensor | None = None, lo: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)`` bf16 with ``hi + lo == p`` exactly, for ``p`` a float32 product of two bf16
    numbers (at most 16 significant bits: hi holds the leading 8, lo the rest). Written into
    ``hi``/``lo`` when given (bf16 views of p's shape, e.g. the two halves of one GEMM operand):
    hi is p rounded to nearest, lo = p - hi taken in float32 (exact) and stored as bf16 (exact)."""
    hi = torch.empty(p.shape, dtype=torch.bfloat16, device=p.device) if hi is None else hi
    lo = torch.empty_like(hi) if lo is None else lo
    hi.copy_(p)
    torch.sub(p, hi, out=lo)
    return hi, lo


def clipped_contraction(
    x: torch.Tensor, y: torch.Tensor, c: torch.Tensor, narrow: bool, dtype: torch.dtype, bad: torch.Tensor | None = None
) -> torch.Tensor:
    """``Σ_u c_u Σ_t x[..., u, t] ⊗ y[..., u, t]``: ``x [..., m, T, X]``, ``y [..., m, T, Y]``,
    ``c [..., m]`` -> ``[..., X, Y]`` (one use, or a stack of uses with a leading dimension).
    ``bad`` (bool ``[m]``): units whose rows of ``y`` count as zero (``x``'s must be zero already;
    ``c`` is 0 there, but 0 times Inf is NaN).

    ``narrow`` (tensor cores): ``c`` holds bf16 numbers, so each ``c_u · y`` is exact in float32. With
    :data:`SUM_OPERAND` "rounded" it is rounded to bf16 and ``xᵀ (c·y)`` is one bf16 GEMM with float32
    accumulation (the rounding is in the clip factor's bound); with "split" it splits exactly into
    bf16 ``hi + lo`` and ``xᵀ [hi lo]`` is one GEMM of twice the width.
    Otherwise both factors in ``dtype``, one GEMM."""
    lead, (m, t, wx), wy = x.shape[:-3], x.shape[-3:], y.shape[-1]
    xt = x.reshape(*lead, m * t, wx).transpose(-1, -2)
    if narrow:
        # the operand's rows (each half's, split) start on aligned columns, so the GEMM keeps the
        # tensor cores' fast layouts whatever the width (GPT-2's 50,257 is odd)
        wp = aligned_width(wy)
        split = SUM_OPERAND == "split"
        buf = fused_operand(y, c, bad, wp, split)
        if buf is None:
            buf = split_operand(y, c, bad, wp) if split else rounded_operand(y, c, bad, wp)
        out = mm32(xt, buf)
        return out[..., :wy] + out[..., wp : wp + wy] if split else out[..., :wy]
    if bad is not None:
        y = zero_rows(y, bad.view(*([1] * len(lead)), -1, 1, 1))
    return xt.to(dtype) @ (y.to(dtype) * c.view(*lead, m, 1, 1)).reshape(*lead, m * t, wy)


def split_operand(y: torch.Tensor, c: torch.Tensor, bad: torch.Tensor | None, wp: int) -> torch.Tensor:
    """``[..., m·T, 2·wp]`` bf16: ``[hi | lo]`` of ``c_u · y`` (exact in float32), split in place into
    one buffer (no float32 copy of y beyond the product), the pad columns zero and the units
    ``bad`` zeroed; torch's passes (:func:`fused_operand` is the same bits in one kernel)."""
    lead, (m, t, wy) = y.shape[:-3], y.shape[-3:]
    if bad is not None:
        y = zero_rows(y, bad.view(*([1] * len(lead)), -1, 1, 1))
    p = torch.mul(y, c.view(*lead, m, 1, 1).float()).reshape(*lead, m * t, wy)  # bf16 x float32 -> float32
    buf = torch.empty(*lead, m * t, 2 * wp, dtype=torch.bfloat16, device=y.device)
    split_bf16(p, buf[..., :wy], buf[..., wp : wp + wy])
    del p
    if wp != wy:  # the pad columns reach only the output columns that are dropped; zeroed anyway
        buf[..., wy:wp].zero_()
        buf[..., wp + wy :].zero_()
    return buf


def rounded_operand(y: torch.Tensor, c: torch.Tensor, bad: torch.Tensor | None, wp: int) -> torch.Tensor:
    """``[..., m·T, wp]`` bf16: ``c_u · y`` rounded to nearest bf16 (the product of two bf16 numbers is
    exact in float32 and rounded once: torch's bf16 multiply), the pad columns zero and the units
    ``bad`` zeroed; torch's passes (:func:`fused_operand` is the same bits in one kernel)."""
    lead, (m, t, wy) = y.shape[:-3], y.shape[-3:]
    if bad is not None:
        y = zero_rows(y, bad.view(*([1] * len(lead)), -1, 1, 1))
    buf = torch.empty(*lead, m * t, wp, dtype=torch.bfloat16, device=y.device)
    torch.mul(y, c.view(*lead, m, 1, 1).to(torch.bfloat16), out=buf[..., :wy].view(*lead, m, t, wy))
    if wp != wy:
        buf[..., wy:].zero_()
    return buf


def fused_operand(
    y: torch.Tensor, c: torch.Tensor, bad: torch.Tensor | None, wp: int, split: bool = True
) -> torch.Tensor | None:
    """:func:`split_operand`'s buffer (``split``) or :func:`rounded_operand`'s from one Triton kernel
    (:mod:`userdp.engine.split_triton`) where :data:`FUSED_SPLIT` allows it and the kernel has matched
    both bit for bit on this device type (checked once per process; a mismatch or a failure is warned
    about once and the torch passes are used); else None."""
    if not kernel_gate.allowed(
        FUSED_SPLIT, FUSED_CHECKED, y.device, check_fused_operand, "the fused clipped-sum operand kernel"
    ):
        return None
    return split_triton.scale_split(y, c, bad, wp, split)


def check_fused_operand(device: torch.device) -> bool | str:
    """True when the Triton kernel builds ``[hi | lo]`` and the rounded operand bit for bit as
    :func:`split_operand` and :func:`rounded_operand` on a test input: odd and aligned widths, a
    stack, rows with a padded stride, a bad unit holding Inf and NaN; else why not."""
    if split_triton is None:
        return NO_TRITON
    g = torch.Generator().manual_seed(0)
    for shape, aligned in (
        ((3, 5, 37), False),
        ((2, 3, 4, 64), False),
        ((3, 5, 37), True),
        ((3, 2, 2500), True),
    ):  # several column tiles
        y = (torch.randn(shape, generator=g) * 3).to(torch.bfloat16)
        y[..., 1, 1, :5] = float("inf")
        y[..., 1, 1, 7] = float("nan")
        if aligned:  # rows padded to an aligned stride, as aligned_rows stores them
            pad = aligned_width(shape[-1] + 1) - shape[-1]
            y = F.pad(y, (0, pad))[..., : shape[-1]]
        c = round_down_bf16(torch.rand(shape[:-2], generator=g)).float()
        bad = torch.tensor([False, True, False])
        c[..., 1] = 0.0
        y, c, bad = y.to(device), c.to(device), bad.to(device)
        wp = aligned_width(shape[-1])
        for split, torch_passes in ((True, split_operand), (False, rounded_operand)):
            got = split_triton.scale_split(y, c, bad, wp, split)
            if got is None or not torch.equal(got.view(torch.int16), torch_passes(y, c, bad, wp).view(torch.int16)):
                return f"its {'split' if split else 'rounded'} buffer differs from torch's on {tuple(shape)}"
    return True


def zero_rows(t: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """``t`` with the units ``drop`` zeroed (written, not multiplied), in ``t``'s own layout: a factor
    stored with aligned rows (:func:`aligned_rows`) keeps them (masked_fill would make it dense)."""
    if t.is_contiguous():
        return t.masked_fill(drop, 0)
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return torch.where(drop, torch.zeros((), dtype=t.dtype, device=t.device), t, out=out)


#: rows of a narrow factor start on 16-byte boundaries (8 bf16 elements) on tensor-core devices:
#: cuBLAS's Hopper GEMMs need aligned leading dimensions, and a factor as wide as GPT-2's vocabulary
#: (50,257) otherwise falls back to Turing-era kernels (seen on an H200: the tied head's GEMMs)
ALIGN_ELEMENTS = 8


def aligned_width(w: int) -> int:
    return -(-int(w) // ALIGN_ELEMENTS) * ALIGN_ELEMENTS


def aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[m, T, d]`` itself when its rows are aligned (or off a tensor-core device), else the
    same values as a view of a buffer whose rows are padded to :func:`aligned_width` (one copy;
    the values are unchanged, only the row stride moves)."""
    w = int(t.shape[-1])
    if not tensor_cores(t.device) or w % ALIGN_ELEMENTS == 0 or w < 64:
        return t
    buf = torch.empty(*t.shape[:-1], aligned_width(w), dtype=t.dtype, device=t.device)
    view = buf[..., :w]
    view.copy_(t)
    return view


def operand_roundoff(narrow: bool) -> float:
    """The relative rounding of a dense use's clipped-sum operand entries: :data:`ROUNDED_OPERAND_U`
    on tensor cores with the rounded operand, else 0 (the split operand and the float paths are
    exact products; an embedding's sum adds ``c_u · y`` in float32, exactly)."""
    return ROUNDED_OPERAND_U if narrow and SUM_OPERAND == "rounded" else 0.0
