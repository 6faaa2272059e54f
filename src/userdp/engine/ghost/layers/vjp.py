"""The fallback for a layer type with no handler: its own parameters' per-unit gradients by
``torch.func`` (vmap over units of the layer's VJP at the captured inputs), materialized."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap

from userdp.engine.distributed.sharding import whole
from userdp.engine.ghost.factors import GhostUnsupported
from userdp.engine.model_lint import BUFFER_CHANGED, mutates_captured
from userdp.errors import UserError


def per_unit_vjp(mod: nn.Module, inputs: tuple, gout: torch.Tensor, m: int, dtype: torch.dtype) -> dict:
    """Fallback for a layer type with no handler: its own parameters' per-unit gradients by
    ``torch.func`` (vmap over units of the layer's VJP at the captured inputs), materialized."""
    names = [n for n, p in mod.named_parameters(recurse=False) if p.requires_grad]
    n = gout.shape[0]
    # a parameter split over ranks (FSDP2: a DTensor once the forward has resharded it) is gathered for
    # the layer's VJP: an all-gather that every rank runs, the handlers going in the same order on each
    params = {k: whole(getattr(mod, k)).detach() for k in names}
    split = []
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != n:
            raise GhostUnsupported(
                f"per_unit=ghost: layer {type(mod).__name__} has no ghost handler and its input {i} is "
                f"not batch-first over the chunk's {n} records: use training.per_unit: vmap"
            )
        split.append(t.detach().reshape(m, n // m, *t.shape[1:]))
    go = gout.reshape(m, n // m, *gout.shape[1:])

    def one(p, ins, g):
        out, pull = vjp(lambda q: functional_call(mod, q, tuple(ins)), p)
        return pull(g.to(out.dtype))[0]

    try:
        grads = vmap(one, in_dims=(None, 0, 0))(params, split, go)
    except RuntimeError as exc:
        if mutates_captured(exc):
            raise UserError(BUFFER_CHANGED) from None
        raise
    return {k: [grads[k].to(dtype)] for k in names}
