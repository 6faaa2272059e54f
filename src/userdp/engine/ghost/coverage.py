"""The coverage check's part: which parameters a chunk compares with autograd's batch gradient, and
with respect to which tensors that gradient is taken (:class:`Coverage`).

The ghost strategy forms each unit's gradient from what the hooks of the layers that own a
parameter saw; a parameter used outside them (a functional call in a parent module) would be
missing from both its norm and its sum. So the first chunks compare, per parameter, the units'
summed gradients with autograd's batch gradient (:meth:`GhostPerUnit._verify`). How that batch
gradient is reached depends on how the model is held, which the distribution part decides and
hands to the strategy: :class:`Coverage` is the whole-parameter check (every parameter at once,
gradients with respect to the parameters themselves); a distribution whose parameters are not
the tensors the forward uses overrides it (:class:`userdp.engine.distributed.sharding.GatheredCoverage`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Check:
    """One chunk's check: the parameters compared (``group``, indices) and the tensors autograd
    differentiates with respect to (``wrt``; :meth:`Coverage.batch_grads` maps their gradients back)."""

    group: set
    wrt: list
    owners: list = field(default_factory=list)  # per wrt tensor, the parameter index it stands for


class Coverage:
    """Every parameter compared on the first chunk, each with respect to itself.

    Args:
        params: the strategy's trainable parameters, in its order.
        layers: the modules that own one of them (the hooks' modules).
    """

    def __init__(self, params: list, layers: list):
        self.params = params
        self.unchecked: list[int] = list(range(len(params)))

    @property
    def verified(self) -> bool:
        """Whether every parameter has been compared (the check runs no more)."""
        return not self.unchecked

    def saw(self, module) -> None:
        """A checked forward's hook saw ``module`` run (kept where the tensors in use are not the
        parameters themselves)."""

    def start(self, weights: torch.Tensor) -> Check | None:
        """This chunk's check, or None (``weights``: the chunk's unit weights)."""
        if self.verified:
            return None
        group = set(self.unchecked)
        order = sorted(group)
        return Check(group, [self.params[j] for j in order], order)

    def batch_grads(self, check: Check | None, grads) -> list:
        """Per parameter its batch gradient from autograd's ``grads`` of ``check.wrt`` (None where
        not compared on this chunk)."""
        out: list = [None] * len(self.params)
        if check is not None:
            for j, g in zip(check.owners, grads, strict=True):
                if g is not None:
                    out[j] = g if out[j] is None else out[j] + g
        return out

    def unseen(self, name: str) -> None:
        """No hook saw parameter ``name`` in this chunk: fine here (the comparison with autograd's
        gradient decides); a distribution with no gradient to compare refuses it."""

    def finish(self, check: Check, complete: bool) -> None:
        """Record a check's outcome: its group is done where every comparison was conclusive."""
        if complete:
            self.unchecked = [j for j in self.unchecked if j not in check.group]
