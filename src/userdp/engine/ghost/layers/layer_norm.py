"""``nn.LayerNorm``: materialized (a unit's gradients are d-vectors)."""

from __future__ import annotations

import torch
from torch import nn

from userdp.engine.ghost.layers.registry import register_ghost_layer
from userdp.engine.layer_norm_grads import LayerNormSpec, per_unit_grads


@register_ghost_layer(nn.LayerNorm)
def _layer_norm(mod: nn.LayerNorm, inputs: tuple, gout: torch.Tensor, m: int, dtype: torch.dtype) -> dict:
    # materialized: a unit's gradients are d-vectors (engine/layer_norm_grads.py: torch's passes, or one
    # Triton pass on CUDA)
    got = per_unit_grads(inputs[0], gout, m, LayerNormSpec.of(mod), dtype)
    return {name: [v] for name, v in got.items()}
