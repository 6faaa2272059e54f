"""The ``batch`` per-unit strategy: the non-private baseline's sum from one ordinary backward.

A non-private step with nothing clipped (``lm`` runs it with ``FlatClip(1e12)``) releases
``Σ_u w_u · mean-gradient_u``: the gradient of ``Σ_u w_u · mean-loss_u``, one forward and one
backward of the chunk, as any training loop takes them. The ghost and vmap strategies compute the
same sum through per-unit norms that the baseline then ignores (the ghost ones cost about as much
as the rest of its step on a CPU), so ``per_unit: auto`` takes this strategy for an algorithm that
is not private.

It computes no per-unit norm, so it cannot serve a private algorithm: the constructor refuses one
(the sensitivity of a release rests on those norms). Where its one backward would not give the
per-unit strategies' sum it hands the chunk to them (``auto``: ghost, or vmap for a model ghost
cannot serve): a clipping that could bind (a clip norm below :data:`UNCLIPPED`, per-layer,
normalized or adaptive clipping: an engine caller may give the baseline one), and a chunk whose sum or losses
are not finite (the per-unit strategies zero the units at fault). That check reads one flag from
the device per chunk; the non-private baseline is its only user.
"""

from __future__ import annotations

import torch
from torch import nn

from userdp.engine.clipping import FlatClip, StepClipping
from userdp.engine.model_lint import lint_model, trainable_parameters
from userdp.engine.per_unit import PER_UNIT_STRATEGIES, AutoPerUnit
from userdp.engine.precision import Precision
from userdp.errors import UserError

#: a flat clip norm at or above this binds no unit (lm's non-private runs clip at 1e12)
UNCLIPPED = 1e12


class BatchPerUnit:
    """One weighted backward per chunk for non-private training (see the module docstring).

    Raises:
        UserError: a private algorithm, an update that is not a gradient, a model that mixes
            records, or no trainable parameters.
    """

    name = "batch"

    def __init__(self, model: nn.Module, loss_fn, algorithm, precision: Precision | None = None):
        if getattr(algorithm, "private", True):
            raise UserError(
                f"training.per_unit: batch computes no per-unit norm, so nothing bounds one unit's "
                f"share of the sum: it serves training.algorithm: nonprivate only, not "
                f"{getattr(algorithm, 'name', type(algorithm).__name__)}"
            )
        if algorithm.update != "gradient":
            raise UserError(
                f"training.per_unit: batch sums gradients; the update of "
                f"{getattr(algorithm, 'name', type(algorithm).__name__)} is {algorithm.update}"
            )
        lint_model(model)
        self.model, self.loss_fn, self.algorithm = model, loss_fn, algorithm
        self.precision = precision or Precision()
        self.names, self.params = trainable_parameters(model)
        self._args = (model, loss_fn, algorithm, precision)
        self._fallback = None  # the per-unit strategy (auto), built the first time a chunk needs it

    def _per_unit(self):
        if self._fallback is None:
            self._fallback = AutoPerUnit(*self._args)
        return self._fallback

    def clipped_sum(self, batch: dict, mask: torch.Tensor, weights: torch.Tensor, clip: StepClipping):
        """(sums, norms, losses, bad) as :meth:`userdp.engine.per_unit.PerUnit.clipped_sum`, with
        nothing clipped: ``sums = Σ_u w_u · mean-gradient_u``; ``norms`` are 0 (none computed),
        ``bad`` all False (a chunk with a non-finite unit is the per-unit strategy's)."""
        args = (batch, mask, weights, clip)
        clipping, clip_state, acc_dtype = clip.clipping, clip.state, clip.acc_dtype
        if not (
            type(clipping) is FlatClip
            and not clipping.adaptive
            and not clipping.normalized
            and float(clip_state["clip_norm"]) >= UNCLIPPED
        ):
            return self._per_unit().clipped_sum(*args)  # a clipping that could bind: norms are needed
        m, g_cap = mask.shape
        n = m * g_cap
        flat = {k: v.reshape(n, *v.shape[2:]) for k, v in batch.items()}
        with self.precision.autocast(self.params[0].device):
            losses = self.loss_fn(self.model, flat)
        if losses.shape != (n,):
            raise UserError(f"loss_fn must return one loss per record (shape ({n},)), got {tuple(losses.shape)}")
        mk = mask.to(acc_dtype)
        unit_loss = (losses.to(acc_dtype).reshape(m, g_cap) * mk).sum(1) / mk.sum(1).clamp(min=1.0)
        scale = self.precision.loss_scale
        grads = torch.autograd.grad((unit_loss * weights.to(acc_dtype)).sum() * scale, self.params, allow_unused=True)
        sums = [
            torch.zeros_like(p, dtype=acc_dtype)
            if g is None
            else g.to(acc_dtype) / scale
            if scale != 1.0
            else g.to(acc_dtype)
            for g, p in zip(grads, self.params, strict=True)
        ]
        finite = torch.stack([torch.isfinite(unit_loss).all()] + [torch.isfinite(s).all() for s in sums]).all()
        if not bool(finite):  # the per-unit strategy finds and zeroes the units at fault
            return self._per_unit().clipped_sum(*args)
        zeros = torch.zeros(m, dtype=acc_dtype, device=mask.device)
        return sums, zeros, unit_loss.detach(), zeros.bool()


PER_UNIT_STRATEGIES.register(BatchPerUnit)
