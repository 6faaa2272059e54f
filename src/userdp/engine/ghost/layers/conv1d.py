"""transformers' ``Conv1D`` (GPT-2), registered when transformers is importable (it is a
dependency): ``y = a W + b`` with ``W`` stored ``[in, out]``; its forward is an addmm, so autocast
casts its input as it does a Linear's."""

from __future__ import annotations

import torch

from userdp.engine.ghost import capture
from userdp.engine.ghost.factors import Factored, by_units
from userdp.engine.ghost.layers.registry import GHOST_LAYERS


def _conv1d(mod, inputs: tuple, gout: torch.Tensor, m: int, dtype: torch.dtype) -> dict:
    """transformers' ``Conv1D`` (GPT-2): ``y = a W + b`` with ``W`` stored ``[in, out]``."""
    n = gout.shape[0]
    a = by_units(inputs[0], m, n, dtype, "the input of Conv1D", store=True)
    g = by_units(gout, m, n, dtype, "the output of Conv1D", store=True)
    return {"weight": [Factored(a, g, a.shape[2], dtype=dtype)], "bias": [g.sum(1, dtype=dtype)]}


def register_transformers_layers() -> None:
    """GPT-2's Conv1D, registered when transformers is importable (it is a dependency)."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    GHOST_LAYERS.setdefault(Conv1D, _conv1d)
    capture.AUTOCAST_GEMM_LAYERS.add(Conv1D)  # its forward is torch.addmm
