"""``nn.Linear`` (and so peft's LoRA A and B): ``y = a Wᵀ + b``, the weight a ghost of (g, a)."""

from __future__ import annotations

import torch
from torch import nn

from userdp.engine.ghost.factors import Factored, by_units
from userdp.engine.ghost.layers.registry import register_ghost_layer


@register_ghost_layer(nn.Linear)
def _linear(mod: nn.Linear, inputs: tuple, gout: torch.Tensor, m: int, dtype: torch.dtype) -> dict:
    n = gout.shape[0]
    a = by_units(inputs[0], m, n, dtype, f"the input of {type(mod).__name__}", store=True)
    g = by_units(gout, m, n, dtype, f"the output of {type(mod).__name__}", store=True)
    out: dict[str, list] = {"weight": [Factored(g, a, mod.out_features, dtype=dtype)]}
    if mod.bias is not None:
        out["bias"] = [g.sum(1, dtype=dtype)]  # accumulated in dtype: no upcast copy of g
    return out
