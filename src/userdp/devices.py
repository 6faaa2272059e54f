"""Where a job runs: ``model.device`` (``auto | cpu | cuda | cuda:i``) and ``training.precision``
(``auto | float32 | bfloat16 | float16``) resolved against the machine.

``auto`` means the first CUDA device when one is available, else the CPU; precision ``auto``
means bfloat16 autocast on a GPU that supports it and float32 elsewhere (CPUs without AMX run
bf16 matmuls slower than float32). Norms, clipped sums, noise and master weights are float32
whatever is chosen (:mod:`userdp.engine.precision`).
"""

from __future__ import annotations

import torch

from userdp.engine.precision import PRECISIONS, Precision
from userdp.errors import UserError
from userdp.validation import DEVICE_SPEC


def resolve_device(spec: str, *, name: str = "model.device"):
    """The ``torch.device`` ``spec`` names.

    Raises:
        UserError: a malformed spec, or CUDA asked for where none (or not that index) exists.
    """
    spec = str(spec).strip().lower()
    if not DEVICE_SPEC.match(spec):
        raise UserError(f"{name} must be auto, cpu, cuda or cuda:<index> (got {spec!r})")
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError(
            f"{name}: {spec} was asked for but this machine has no CUDA device available to torch "
            f"(torch {torch.__version__}; a CPU-only build or no driver): use auto or cpu"
        )
    dev = torch.device(spec)
    index = torch.cuda.current_device() if dev.index is None else dev.index  # torchrun sets it per process
    if index >= torch.cuda.device_count():
        raise UserError(f"{name}: {spec} does not exist (this machine has {torch.cuda.device_count()} CUDA device(s))")
    return torch.device("cuda", index)


def resolve_precision(spec: str, device) -> str:
    """``float32``, ``bfloat16`` or ``float16`` for ``device`` (``auto``: see the module docstring).

    Raises:
        UserError: an unknown value, or float16 on a CPU (:meth:`Precision.check_device`).
    """
    spec = str(spec).strip().lower()
    if spec != "auto" and spec not in PRECISIONS:
        raise UserError(
            f"training.precision must be auto, {', '.join(list(PRECISIONS)[:-1])} or "
            f"{list(PRECISIONS)[-1]} (got {spec!r})"
        )
    if spec == "auto":
        return "bfloat16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"
    Precision(spec).check_device(device)
    return spec


def describe(device) -> str:
    """A one-line name of the device for logs and reports (the GPU's name on CUDA)."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return "cpu"
