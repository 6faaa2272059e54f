"""A new per-unit strategy in one file: per-unit gradients by a plain loop over the units.

The built-in strategies vectorize: ``vmap`` materializes every unit's gradient of a chunk at
once, ``ghost`` forms the norms from activations. This one takes each unit in turn — one ordinary
backward pass per unit, clipped and added to the sum before the next — so it holds one gradient
at a time, runs any model autograd can differentiate, and is the easiest to read and check: a
reference for the other two. It serves gradient updates (ELS, ULS, non-private); it is slow.

    userdp train config.yaml --plugin examples/plugins/loop_per_unit.py --set training.per_unit=loop

The contract (docs/ARCHITECTURE.md, "per-unit strategy"): ``clipped_sum(batch, mask, weights, clip)``
(``clip``: a ``StepClipping`` — the clipping strategy, its state, the accumulation dtype and
FedAvg's reprojection) returns ``(sums, norms, losses, bad)``: per trainable
tensor the weighted sum of the clipped unit updates (fresh tensors), and per unit its norm (0 where
not finite), its loss, and whether its update was non-finite (it then contributes zero).
"""

from __future__ import annotations

import torch
from torch import nn

from userdp.engine.clipping import StepClipping, per_tensor_norms
from userdp.engine.model_lint import lint_model
from userdp.engine.per_unit import PER_UNIT_STRATEGIES
from userdp.engine.precision import Precision, exact_float32
from userdp.errors import UserError


class LoopPerUnit:
    """Per-unit gradients one unit at a time (see the module docstring)."""

    name = "loop"

    def __init__(self, model: nn.Module, loss_fn, algorithm, precision: Precision | None = None):
        lint_model(model)
        if algorithm.update != "gradient":
            raise UserError(
                f"training.per_unit: loop computes gradients; {algorithm.name}'s update is "
                f"{algorithm.update} (use vmap)"
            )
        self.model, self.loss_fn = model, loss_fn
        self.precision = precision or Precision()
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise UserError("the model has no trainable parameters (requires_grad=True)")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]

    def _gradient(self, batch: dict, mask: torch.Tensor):
        """One unit's masked mean gradient and loss (batch tensors [G, ...], mask [G])."""
        with self.precision.autocast(self.params[0].device):
            losses = self.loss_fn(self.model, batch)
        if losses.shape != mask.shape:
            raise UserError(
                f"loss_fn must return one loss per record (shape {tuple(mask.shape)}), got {tuple(losses.shape)}"
            )
        loss = (losses.float() * mask).sum() / mask.sum().clamp(min=1.0)
        scale = self.precision.loss_scale
        grads = torch.autograd.grad(loss * scale, self.params, allow_unused=True)
        return [
            torch.zeros_like(p) if g is None else g / scale for g, p in zip(grads, self.params, strict=True)
        ], loss.detach()

    def clipped_sum(self, batch: dict, mask: torch.Tensor, weights: torch.Tensor, clip: StepClipping):
        clipping, clip_state, acc_dtype = clip.clipping, clip.state, clip.acc_dtype  # (gradients: no reproject)
        m = mask.shape[0]
        sums = [torch.zeros(p.shape, dtype=acc_dtype, device=p.device) for p in self.params]
        norms, losses, bad = [], [], []
        for i in range(m):
            grads, loss = self._gradient({k: v[i] for k, v in batch.items()}, mask[i])
            with exact_float32():  # norms and sums in IEEE float32, as the built-in strategies
                factors, norm = clipping.factors_from_norms(
                    per_tensor_norms([g.unsqueeze(0) for g in grads]), clip_state
                )
                finite = torch.isfinite(norm[0])
                factors = torch.where(finite, factors[0], torch.zeros_like(factors[0])).to(acc_dtype) * weights[i]
                for j, g in enumerate(grads):
                    sums[j].add_(
                        torch.where(finite, g.to(acc_dtype), torch.zeros((), dtype=acc_dtype, device=g.device))
                        * factors[j]
                    )
            norms.append(torch.where(finite, norm[0], torch.zeros_like(norm[0])))
            losses.append(loss)
            bad.append(~finite)
        return sums, torch.stack(norms), torch.stack(losses), torch.stack(bad)


if LoopPerUnit.name not in PER_UNIT_STRATEGIES:  # importing this file twice registers it once
    PER_UNIT_STRATEGIES.register(LoopPerUnit)
