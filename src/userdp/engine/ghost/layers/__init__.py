"""The ghost layer handlers, one file a layer type, each registered by decorator in
:data:`~userdp.engine.ghost.layers.registry.GHOST_LAYERS` (``handler(module, inputs, output_grad, m,
dtype) -> {parameter attribute: [Factored | Tensor[m, *shape]]}``). A new layer type is one file here
plus its import below; a type with no handler falls back to :func:`~.vjp.per_unit_vjp`."""

from userdp.engine.ghost.layers import embedding, layer_norm, linear
from userdp.engine.ghost.layers.conv1d import register_transformers_layers
from userdp.engine.ghost.layers.registry import GHOST_LAYERS, LayerHandler, register_ghost_layer
from userdp.engine.ghost.layers.vjp import per_unit_vjp

__all__ = [
    "GHOST_LAYERS",
    "LayerHandler",
    "embedding",
    "layer_norm",
    "linear",
    "per_unit_vjp",
    "register_ghost_layer",
    "register_transformers_layers",
]
