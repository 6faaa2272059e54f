"""``nn.Embedding``: a one-hot factor (token ids), so its Gram entries are id equalities."""

from __future__ import annotations

import torch
from torch import nn

from userdp.engine.ghost.factors import Factored, GhostUnsupported, by_units
from userdp.engine.ghost.layers.registry import register_ghost_layer


@register_ghost_layer(nn.Embedding)
def _embedding(mod: nn.Embedding, inputs: tuple, gout: torch.Tensor, m: int, dtype: torch.dtype) -> dict:
    if mod.max_norm is not None or mod.scale_grad_by_freq or mod.sparse:
        raise GhostUnsupported(
            "per_unit=ghost: nn.Embedding with max_norm, scale_grad_by_freq or sparse gradients "
            "is not supported: use training.per_unit: vmap"
        )
    ids = inputs[0]
    n = gout.shape[0]
    if ids.shape[0] != n:
        raise GhostUnsupported(
            f"per_unit=ghost: embedding ids have shape {tuple(ids.shape)}, expected {n} records first"
        )
    ids = ids.reshape(m, -1)
    g = by_units(gout, m, n, dtype, "the output of nn.Embedding", store=True)
    if mod.padding_idx is not None:  # PyTorch gives the padding row no gradient (x 0/1: exact in any dtype)
        g = g * (ids != mod.padding_idx).unsqueeze(2).to(g.dtype)
    return {"weight": [Factored(ids.long(), g, mod.num_embeddings, index=True, dtype=dtype)]}
