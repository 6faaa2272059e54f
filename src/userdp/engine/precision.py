"""Mixed precision: what runs in low precision and what never does.

The forward and backward may run under ``torch.autocast`` in bfloat16 or float16. Everything the
guarantee depends on stays float32 (float64 for a float64 model): per-unit norms, clip factors,
the clipped sum, the noise, the denominator and the master weights the optimizer steps. A bf16
norm can be off by ~0.4%, enough to let a unit past its clip bound; noise drawn or added in bf16
loses its low-order bits, which is the mechanism itself (Mironov 2012 on floating-point noise).

float16 has a narrow exponent range: the loss is multiplied by a fixed ``loss_scale`` (2^10)
before the backward and the captured gradients are divided by it in float32. A unit whose
gradient still overflows has a non-finite norm and contributes zero (it is counted, as any
non-finite unit). The scale is fixed, not dynamic: a dynamic scale would skip or redo steps
depending on the private data.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from userdp.errors import UserError
from userdp.validation import check_choice

#: the backends whose float32 contractions may silently run in TF32 (10-bit mantissas) when a
#: caller enabled it (HF's ``tf32=True``, Lightning, ``set_float32_matmul_precision("high")``)
_FP32_BACKENDS = (
    ("cuda", "matmul"),
    ("cudnn", "conv"),
    ("cudnn", "rnn"),
    ("mkldnn", "matmul"),
    ("mkldnn", "conv"),
    ("mkldnn", "rnn"),
)

#: what the privacy record says about the float32 contractions of norms and sums
EXACT_FLOAT32 = "IEEE float32 (TF32 and other reduced float32 modes pinned off inside norms and clipped sums)"


def _fp32_handles() -> list:
    out = []
    for backend, leaf in _FP32_BACKENDS:
        h = getattr(getattr(torch.backends, backend, None), leaf, None)
        if h is not None and hasattr(h, "fp32_precision"):
            out.append(h)
    return out


@contextlib.contextmanager
def exact_float32():
    """Inside: every float32 matmul and convolution is IEEE float32, whatever the caller set
    (TF32 would round the norms and the clipped sums to 10-bit mantissas, and a norm off by 0.1%
    lets a unit past its clip bound). The caller's settings are restored on the way out. Uses
    torch's per-backend ``fp32_precision`` (reading the legacy ``allow_tf32`` after a mix of the
    two APIs is an error in torch)."""
    handles = _fp32_handles()
    before = [h.fp32_precision for h in handles]
    try:
        for h in handles:
            h.fp32_precision = "ieee"
        yield
    finally:
        for h, v in zip(handles, before, strict=True):
            h.fp32_precision = v


#: ``training.precision`` values -> the autocast dtype (None: no autocast)
PRECISIONS = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Precision:
    """The compute precision of the per-unit forward and backward.

    Args:
        name: ``float32`` (no autocast), ``bfloat16`` or ``float16``.

    Raises:
        UserError: an unknown name.
    """

    name: str = "float32"

    def __post_init__(self):
        check_choice(self.name, "training.precision", PRECISIONS)

    @property
    def dtype(self):
        """The autocast dtype, or None."""
        return PRECISIONS[self.name]

    @property
    def loss_scale(self) -> float:
        """The fixed loss scale (2^10 for float16, else 1)."""
        return 1024.0 if self.name == "float16" else 1.0

    @property
    def verify_tolerance(self) -> float:
        """Relative tolerance of the ghost strategy's first-chunk coverage check."""
        return 1e-4 if self.dtype is None else 5e-2

    def check_device(self, device: torch.device) -> None:
        """Refuse float16 autocast on a CPU (bfloat16 is the CPU's low precision).

        Raises:
            UserError: naming training.precision.
        """
        if self.name == "float16" and torch.device(device).type == "cpu":
            raise UserError("training.precision: float16 autocast needs a GPU; on a CPU use bfloat16 or float32")

    def autocast(self, device) -> contextlib.AbstractContextManager:
        """The autocast context for ``device`` (a no-op for float32)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(device).type, dtype=self.dtype)
