"""The layer registry (Opacus-style, keyed by layer type): a handler turns a layer call's captured
inputs and output gradient into its parameters' per-unit parts; a layer type with no handler gets
:func:`~userdp.engine.ghost.layers.vjp.per_unit_vjp`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# handler(module, inputs, output_grad, m, dtype) -> {parameter attribute: [Factored | Tensor[m, *shape]]}
LayerHandler = Callable[[nn.Module, tuple, torch.Tensor, int, torch.dtype], dict]

#: layer type -> handler (Opacus-style registry); other layers with parameters use :func:`per_unit_vjp`
GHOST_LAYERS: dict[type, LayerHandler] = {}


def register_ghost_layer(*types: type):
    """Decorator: register a handler for layers of ``types`` (see :data:`LayerHandler`)."""

    def deco(fn: LayerHandler) -> LayerHandler:
        for t in types:
            GHOST_LAYERS[t] = fn
        return fn

    return deco
