"""What the forward's hooks keep of each layer call (:class:`Capture`), and the autocast rule that
makes a GEMM layer's captured input the operand its GEMM consumed (:func:`captured`)."""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

#: layer types whose input autocast casts to its low-precision dtype before the layer's GEMM
#: (aten linear and addmm are on autocast's lower-precision list): their captured input is rounded
#: the same way, before the layer, so the ghost factors are the GEMM's own operands (see :func:`captured`)
AUTOCAST_GEMM_LAYERS: set = {nn.Linear}


def autocast_operand_dtype(mod: nn.Module, device: torch.device) -> torch.dtype | None:
    """The dtype autocast gives this layer's GEMM operands here (None: no autocast, or a layer
    whose op autocast leaves alone)."""
    if type(mod) not in AUTOCAST_GEMM_LAYERS:
        return None
    kind = device.type if device.type in ("cuda", "cpu", "xpu", "mps") else None
    if kind is None or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def narrowable(a) -> bool:
    """A float32 tensor: what autocast casts to its low-precision dtype for a GEMM."""
    return isinstance(a, torch.Tensor) and a.dtype == torch.float32


def captured(a):
    """A captured layer input, detached. Under autocast the forward's pre-hook has already cast a
    float32 input of a GEMM layer to autocast's dtype (float32 LayerNorm outputs feed GPT-2's
    ``c_attn``, ``c_fc`` and its tied head): the capture is the tensor the GEMM consumed and autograd
    keeps, so the norm, the clipped sum and autograd's own gradient see the same numbers, no second
    copy is held, and on tensor cores the contraction takes the bf16 path (float32 accumulation)."""
    return a.detach() if isinstance(a, torch.Tensor) else a


class Capture:
    """A layer call seen in the forward: its module, its captured inputs, and where autograd will
    deliver its output's gradient: the output's gradient edge, not the output itself, so its storage
    is freed when the forward no longer needs it, as in a non-private step (the tied head's logits:
    1.5 GiB of bf16 at a 64-user gpt2-small chunk, held through the backward's peak before). None
    when the output does not require grad (the loss does not reach the layer's parameters there)."""

    __slots__ = ("edge", "inputs", "module")

    def __init__(self, module, inputs, output):
        self.module, self.inputs = module, inputs
        self.edge = get_gradient_edge(output) if output.requires_grad else None
