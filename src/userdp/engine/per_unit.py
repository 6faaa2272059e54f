"""Per-unit updates, vectorized with torch.func (functional_call + grad + vmap over units).

A unit's batch holds up to G records (ELS: G = 1) with a float mask (1 = real record); the
unit's loss is the masked mean of the per-record losses, so users with fewer than G records
and padding units (mask all 0, used to round a chunk up to a bucket size) are exact. The
caller processes the units of a step in chunks, so memory is bounded by the chunk size
whatever the cohort. There is no Python loop over units here: only over FedAvg's local steps.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from userdp.errors import UserError

LossFn = Callable[[nn.Module, dict], torch.Tensor]


class _LossModule(nn.Module):
    """``forward(batch) = loss_fn(model, batch)``, so functional_call swaps the model's params."""

    def __init__(self, model: nn.Module, loss_fn: LossFn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch):
        return self.loss_fn(self.model, batch)


def lint_model(model: nn.Module) -> None:
    """Refuse components that mix records within a batch (SPEC §8.4): BatchNorm in training mode."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.training:
            raise UserError(
                f"module {name or type(model).__name__!r} is {type(mod).__name__} in training mode: "
                "it mixes records of a batch, so per-unit clipping no longer bounds a user's "
                "influence. Use LayerNorm/GroupNorm, or freeze it (module.eval()) with statistics "
                "from public data"
            )
        if isinstance(mod, nn.modules.instancenorm._InstanceNorm) and mod.track_running_stats and mod.training:
            raise UserError(
                f"module {name!r} ({type(mod).__name__}) tracks running statistics in training mode; "
                "set track_running_stats=False or call .eval() on it"
            )


class PerUnit:
    """Vectorized per-unit updates of ``model`` under ``loss_fn`` for one algorithm."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, algorithm):
        lint_model(model)
        self.model = model
        self.algorithm = algorithm
        self._wrapper = _LossModule(model, loss_fn)
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        if not self.names:
            raise UserError("the model has no trainable parameters (requires_grad=True)")
        self.params = [p for n, p in model.named_parameters() if p.requires_grad]
        self._const = {"model." + n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
        self._const.update({"model." + n: b for n, b in model.named_buffers()})
        self._keys = ["model." + n for n in self.names]

    def _masked_loss(self, params, batch, mask):
        pb = dict(self._const)
        pb.update(zip(self._keys, params))
        losses = functional_call(self._wrapper, pb, (batch,))
        if losses.shape != mask.shape:
            raise UserError(
                f"loss_fn must return one loss per record (shape {tuple(mask.shape)}), got {tuple(losses.shape)}"
            )
        loss = (losses * mask).sum() / mask.sum().clamp(min=1.0)
        return loss, loss.detach()

    def _mean_gradient(self, params, batch, mask):
        g, loss = grad(self._masked_loss, has_aux=True)(params, batch, mask)
        return g, loss

    def _local_sgd(self, params, batch, mask):
        """FedAvg: batch tensors [E, G, ...] (already permuted per epoch, real records first)."""
        a = self.algorithm
        g_cap = mask.shape[-1]
        bsz = min(a.local_batch_size or g_cap, g_cap)
        steps = -(-g_cap // bsz)
        p = params
        first_loss = None
        for e in range(a.local_epochs):
            for s in range(steps):
                sl = slice(s * bsz, (s + 1) * bsz)
                b = {k: v[e, sl] for k, v in batch.items()}
                g, loss = grad(self._masked_loss, has_aux=True)(p, b, mask[e, sl])
                if first_loss is None:
                    first_loss = loss
                p = tuple(pi - a.local_lr * gi for pi, gi in zip(p, g))
                if self._reproject is not None:  # McMahan et al.: theta <- theta0 + clip(theta - theta0)
                    p = self._project(params, p)
        return tuple(p0 - pi for p0, pi in zip(params, p)), first_loss

    def _project(self, p0, p):
        bounds = self._reproject
        d = [pi - q for pi, q in zip(p, p0)]
        if len(bounds) == 1:  # flat
            n = torch.sqrt(sum((x * x).sum() for x in d))
            f = torch.clamp(bounds[0] / torch.clamp(n, min=1e-12), max=1.0)
            return tuple(q + x * f for q, x in zip(p0, d))
        out = []
        for q, x, b in zip(p0, d, bounds):  # per layer
            f = torch.clamp(b / torch.clamp(torch.linalg.vector_norm(x), min=1e-12), max=1.0)
            out.append(q + x * f)
        return tuple(out)

    _reproject = None  # FedAvg greedy re-projection bounds (one = flat, else per tensor)

    def __call__(self, batch: dict, mask: torch.Tensor, chunk_params=None, reproject=None):
        """Updates for a chunk of units: (list of [m, ...] tensors, per-unit losses [m]).

        ``reproject``: FedAvg only — clip bounds applied to ``theta - theta0`` after every local
        step (a list with one flat bound, or one bound per trainable tensor)."""
        self._reproject = reproject
        params = tuple(p.detach() for p in self.params) if chunk_params is None else chunk_params
        fn = self._local_sgd if self.algorithm.update_kind == "local_sgd" else self._mean_gradient
        updates, losses = vmap(fn, in_dims=(None, 0, 0), randomness="different")(params, batch, mask)
        return list(updates), losses


def fedavg_epoch_batches(batch: dict, mask: torch.Tensor, epochs: int, rng) -> tuple[dict, torch.Tensor]:
    """Per-user, per-epoch shuffles of the local records with real records first: [m, E, G, ...]."""
    m, g = mask.shape
    keys = torch.from_numpy(rng.random((m, epochs, g))) + 2.0 * (1.0 - mask.double()).unsqueeze(1)
    perm = torch.argsort(keys, dim=-1)  # [m, E, G]
    rows = torch.arange(m).view(m, 1, 1)
    out = {k: v[rows, perm] for k, v in batch.items()}
    return out, mask[rows, perm]
