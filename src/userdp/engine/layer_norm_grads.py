"""A LayerNorm's per-unit weight and bias gradients, as the ghost strategy materializes them.

Unit u's gradients are ``Σ_t g_t ⊙ x̂_t`` (weight) and ``Σ_t g_t`` (bias) over its tokens, ``x̂``
the normalized input. :func:`torch_grads` computes them with torch's passes (the reference, and
the CPU's path); on CUDA one Triton kernel (:mod:`userdp.engine.layer_norm_triton`) reads the input
and the gradient once instead, used once it has matched the torch passes on a test input on that
device (checked once per process; a mismatch or a failure is warned about once and the torch
passes are used). :data:`FUSED_LAYER_NORM` says where it may run; tests set it here.

The guarantee does not rest on either: the vectors returned are the ones whose norms are taken and
whose clipped sum is formed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from userdp.engine import kernel_gate

NO_TRITON: str | None = None  # why the Triton kernel cannot be imported here
try:  # CUDA builds of torch bring triton (the CPU wheel does not)
    from userdp.engine import layer_norm_triton
except Exception as exc:  # noqa: BLE001 - a missing or broken triton: the warning says why
    layer_norm_triton, NO_TRITON = None, f"no triton: {type(exc).__name__}: {str(exc)[:120]}"

#: "auto": the Triton kernel on CUDA; "on": on any device (tests, under Triton's interpreter); "off": never
FUSED_LAYER_NORM = "auto"
FUSED_CHECKED: dict = {}  # device type -> True, or why the kernel is not used
#: how far the kernel's sums may sit from the torch passes' in the check (float32, other summation orders)
CHECK_RTOL, CHECK_ATOL = 1e-4, 1e-5


@dataclass(frozen=True)
class LayerNormSpec:
    """What of a LayerNorm its gradients need: the normalized shape, eps, and which of its
    parameters (weight, bias) want a gradient."""

    shape: tuple
    eps: float
    weight: bool = True
    bias: bool = True

    @classmethod
    def of(cls, mod: torch.nn.LayerNorm) -> LayerNormSpec:
        return cls(tuple(mod.normalized_shape), float(mod.eps), mod.weight is not None, mod.bias is not None)


def per_unit_grads(x: torch.Tensor, g: torch.Tensor, m: int, spec: LayerNormSpec, dtype: torch.dtype) -> dict:
    """``{"weight": [m, *shape], "bias": [m, *shape]}`` (those ``spec`` asks for) in ``dtype``: the
    units' LayerNorm gradients from the layer's input ``x`` and its output's gradient ``g`` (a unit's
    records consecutive, batch-first)."""
    if (spec.weight or spec.bias) and len(spec.shape) == 1 and dtype == torch.float32 and _fused_allowed(x.device):
        got = layer_norm_triton.unit_grads(x, g, m, spec.eps)
        if got is not None:
            w, b = got
            return {**({"weight": w} if spec.weight else {}), **({"bias": b} if spec.bias else {})}
    return torch_grads(x, g, m, spec, dtype)


def torch_grads(x: torch.Tensor, g: torch.Tensor, m: int, spec: LayerNormSpec, dtype: torch.dtype) -> dict:
    """:func:`per_unit_grads` by torch's passes: the normalized input recomputed by one fused kernel
    (native layer_norm without affine), its product with ``g``, and the sums over each unit's tokens."""
    units = (m, -1, *spec.shape)
    out = {}
    if spec.weight:  # a narrow g times xhat promotes to dtype inside the one kernel
        xhat = F.layer_norm(x.to(dtype), spec.shape, eps=spec.eps)
        out["weight"] = torch.mul(g, xhat).to(dtype).reshape(units).sum(1)
    if spec.bias:
        out["bias"] = g.reshape(units).sum(1, dtype=dtype)
    return out


def _fused_allowed(device: torch.device) -> bool:
    return kernel_gate.allowed(
        FUSED_LAYER_NORM, FUSED_CHECKED, device, check_fused, "the fused LayerNorm-gradient kernel"
    )


def check_fused(device: torch.device) -> bool | str:
    """True when the Triton kernel's per-unit sums match :func:`torch_grads`' on test inputs (an odd
    width over several column tiles, token counts that are not a multiple of its block, a bf16
    gradient, a padded row stride), within float32's other summation orders; else why not."""
    if layer_norm_triton is None:
        return NO_TRITON
    gen = torch.Generator().manual_seed(0)
    for m, t, d, gdt, padded in (
        (3, 37, 200, torch.float32, False),
        (2, 70, 64, torch.bfloat16, False),
        (4, 5, 33, torch.float32, True),
    ):
        x = torch.randn(m * t, d, generator=gen) * 3 + 1
        if padded:  # rows of a wider buffer
            x = F.pad(x, (0, 7))[:, :d]
        g = torch.randn(m * t, d, generator=gen).to(gdt)
        x, g = x.to(device), g.to(device)
        got = layer_norm_triton.unit_grads(x, g, m, 1e-5)
        if got is None:
            return f"it refused a layout of shape {(m * t, d)}"
        want = torch_grads(x, g, m, LayerNormSpec((d,), 1e-5), torch.float32)
        for name, a in zip(("weight", "bias"), got, strict=True):
            b = want[name]
            if a.shape != b.shape or not torch.allclose(a, b, rtol=CHECK_RTOL, atol=CHECK_ATOL * float(b.abs().max())):
                return f"its {name} sums differ from torch's on {(m, t, d)}"
    return True
