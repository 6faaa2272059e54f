"""Per-unit strategies: how a chunk of units becomes its clipped, weighted sum.

The contract (docs/ARCHITECTURE.md, "Per-unit strategy"): a strategy is built from the model,
the loss and the algorithm, and :meth:`clipped_sum` takes a chunk's batch (tensors
``[m, ...]`` whose second axis holds a unit's records), its float mask (1 = real record),
per-unit weights (0 for padding units) and the clipping strategy with its state; it returns the
chunk's clipped sum (one tensor per trainable tensor, in the accumulation dtype), the units'
flat norms, losses and a flag of the units whose update was not finite (they contribute zero).
How the per-unit norms are obtained is the strategy's business: :class:`VmapPerUnit`
materializes each unit's update with torch.func (functional_call + grad + vmap over units); a
ghost-norm strategy computes norms from activations and output gradients instead. Strategies are
registered by name in :data:`PER_UNIT_STRATEGIES` and chosen by ``Performance.per_unit``.

A unit's loss is the masked mean of its per-record losses, so users with fewer than G records
and padding units (mask all 0, used to round a chunk up to a bucket size) are exact. The
caller processes the units of a step in chunks, so memory is bounded by the chunk size
whatever the cohort. There is no Python loop over units here: only over FedAvg's local steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from userdp.engine.clipping import StepClipping
from userdp.engine.ghost import GhostPerUnit, GhostUnsupported
from userdp.engine.model_lint import BUFFER_CHANGED, lint_model, mutates_captured, trainable_parameters
from userdp.engine.precision import Precision, exact_float32
from userdp.engine.rounding import gamma, round_down_to, unit_roundoff
from userdp.errors import UserError
from userdp.registry import Registry

LossFn = Callable[[nn.Module, dict], torch.Tensor]


class _LossModule(nn.Module):
    """``forward(batch) = loss_fn(model, batch)``, so functional_call swaps the model's params."""

    def __init__(self, model: nn.Module, loss_fn: LossFn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch):
        return self.loss_fn(self.model, batch)


class PerUnitStrategy(Protocol):
    """The per-unit seam (see the module docstring)."""

    name: str
    names: list[str]  # trainable parameter names, in order
    params: list[torch.Tensor]  # the trainable tensors (the model's own)

    def clipped_sum(self, batch: dict, mask: torch.Tensor, weights: torch.Tensor, clip: StepClipping):
        """(sums, norms [m], losses [m], bad [m]) of one chunk, its units clipped as ``clip`` says;
        see the module docstring. The sums must be fresh tensors the caller owns (the loop
        accumulates into them in place)."""
        ...


class PerUnit:
    """Vectorized per-unit updates of ``model`` under ``loss_fn`` for one algorithm.

    The unit's update is the algorithm's ``update``: ``"gradient"`` (the masked mean gradient)
    or ``"local_sgd"`` (FedAvg: ``theta0 - theta_local`` after local SGD).

    ``precision``: the :class:`~userdp.engine.precision.Precision` of the forward and backward
    (autocast); norms and sums stay float32.

    Raises:
        UserError: a model that mixes records (see :func:`lint_model`), no trainable parameters,
            or an unknown update kind.
    """

    name = "vmap"

    def __init__(self, model: nn.Module, loss_fn: LossFn, algorithm, precision: Precision | None = None):
        lint_model(model)
        self.model = model
        self.algorithm = algorithm
        self.precision = precision or Precision()
        self._wrapper = _LossModule(model, loss_fn)
        self.names, self.params = trainable_parameters(model)
        self._const = {"model." + n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
        self._const.update({"model." + n: b for n, b in model.named_buffers()})
        self._keys = ["model." + n for n in self.names]
        updates = {"gradient": self._mean_gradient, "local_sgd": self._local_sgd}
        if algorithm.update not in updates:
            raise UserError(
                f"the vmap per-unit strategy has no update {algorithm.update!r}; it has {', '.join(updates)}"
            )
        self._update = updates[algorithm.update]

    def _masked_loss(self, params, batch, mask):
        pb = dict(self._const)
        pb.update(zip(self._keys, params, strict=True))
        with self.precision.autocast(self.params[0].device):
            losses = functional_call(self._wrapper, pb, (batch,))
        if losses.shape != mask.shape:
            raise UserError(
                f"loss_fn must return one loss per record (shape {tuple(mask.shape)}), got {tuple(losses.shape)}"
            )
        losses = losses.float() if losses.dtype in (torch.float16, torch.bfloat16) else losses
        loss = (losses * mask).sum() / mask.sum().clamp(min=1.0)
        return loss * self.precision.loss_scale, loss.detach()

    def _mean_gradient(self, params, batch, mask):
        g, loss = grad(self._masked_loss, has_aux=True)(params, batch, mask)
        s = self.precision.loss_scale
        return (tuple(x / s for x in g) if s != 1.0 else g), loss

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
                p = tuple(pi - a.local_lr * gi for pi, gi in zip(p, g, strict=True))
                if self._reproject is not None:  # McMahan et al.: theta <- theta0 + clip(theta - theta0)
                    p = self._project(params, p)
        return tuple(p0 - pi for p0, pi in zip(params, p, strict=True)), first_loss

    def _project(self, p0, p):
        bounds = self._reproject
        d = [pi - q for pi, q in zip(p, p0, strict=True)]
        if len(bounds) == 1:  # flat
            n = torch.sqrt(sum((x * x).sum() for x in d))
            f = torch.clamp(bounds[0] / torch.clamp(n, min=1e-12), max=1.0)
            return tuple(q + x * f for q, x in zip(p0, d, strict=True))
        out = []
        for q, x, b in zip(p0, d, bounds, strict=True):  # per layer
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
        with eager_attention(self.model):
            try:
                updates, losses = vmap(self._update, in_dims=(None, 0, 0), randomness="different")(params, batch, mask)
            except RuntimeError as exc:  # torch.func refuses a forward that writes into a captured buffer
                if mutates_captured(exc):
                    raise UserError(BUFFER_CHANGED) from None
                raise
        return list(updates), losses

    def clipped_sum(self, batch: dict, mask: torch.Tensor, weights: torch.Tensor, clip: StepClipping):
        """Materialize the chunk's updates, clip them by ``clip``'s strategy's factors, and sum.

        Returns:
            (sums, norms, losses, bad): ``sums`` one ``acc_dtype`` tensor per trainable tensor,
            ``sum_i weights_i * factor_i * update_i``; ``norms`` the units' flat norms (0 where
            not finite); ``losses`` the units' losses; ``bad`` True where the update was Inf/NaN.
        """
        clipping, clip_state, acc_dtype = clip.clipping, clip.state, clip.acc_dtype
        updates, losses = self(batch, mask, reproject=clip.reproject)
        with exact_float32():  # norms and sums in IEEE float32 whatever the caller's TF32 setting
            # the norms of what is summed, squares summed in float64; the factor is taken from them
            # inflated by the bound on the rounding of each unit's own terms in the m-term sum
            tn = torch.stack(
                [torch.linalg.vector_norm(u.reshape(u.shape[0], -1), dim=1, dtype=torch.float64) for u in updates],
                dim=1,
            )
            m = tn.shape[0]
            uround = unit_roundoff(acc_dtype, False)
            f, _ = clipping.factors_from_norms(tn * (1.0 + gamma(max(m, 1), uround) + 2.0 * uround), clip_state)
            _, norms = clipping.factors_from_norms(tn, clip_state)
            norms = norms.to(acc_dtype)
            updates, f, bad = zero_nonfinite(updates, f, norms)
            norms = torch.where(bad, 0.0, norms)
            f = round_down_to(f * weights.to(f.dtype).unsqueeze(1), acc_dtype)
            sums = [torch.tensordot(f[:, j], u.to(acc_dtype), dims=1) for j, u in enumerate(updates)]
        return sums, norms, losses, bad


@contextlib.contextmanager
def eager_attention(model: nn.Module):
    """A transformers model with fused attention (SDPA, flash) runs eager attention inside: fused
    kernels have no vmap batching rule (a slow per-unit loop, or an error), and the math is the
    same. Restored on the way out, so the ghost strategy and evaluation keep the fused kernels."""
    cfg = getattr(model, "config", None)
    impl = getattr(cfg, "_attn_implementation", None)
    if impl in (None, "eager") or not hasattr(model, "set_attn_implementation"):
        yield
        return
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(impl)


def zero_nonfinite(
    updates: list[torch.Tensor], factors: torch.Tensor, norms: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Units whose update holds Inf/NaN (their norm is then Inf/NaN, or it overflowed) contribute
    zero: their clipped update would otherwise poison every coordinate of the sum, exactly when
    they are sampled. ``norms`` are the clipping strategy's per-unit norms (no second pass).

    Returns the updates (bad units' rows zeroed), the factors (0 for bad units) and a boolean [m]
    flag of the zeroed units.
    """
    bad = ~torch.isfinite(norms)
    # unconditionally (no `if bad.any()`: that would wait for the device once per chunk)
    updates = [
        torch.where(bad.view(-1, *([1] * (u.dim() - 1))), torch.zeros((), dtype=u.dtype, device=u.device), u)
        for u in updates
    ]
    factors = torch.where(bad.unsqueeze(1), torch.zeros((), dtype=factors.dtype, device=factors.device), factors)
    return updates, factors, bad


VmapPerUnit = PerUnit


#: name -> strategy class; ``Performance.per_unit`` picks one ("auto": see :func:`resolve_per_unit`)
PER_UNIT_STRATEGIES: Registry = Registry("per_unit", {"vmap": VmapPerUnit, "ghost": GhostPerUnit})


def resolve_per_unit(name: str, algorithm) -> str:
    """The strategy ``name`` stands for: ``auto`` is ``batch`` for a non-private algorithm whose
    update is a gradient (one ordinary backward: nothing is clipped; ``engine/batch_unit.py``),
    ``ghost`` for a private one (ELS, ULS: no per-unit gradient copies) and ``vmap`` otherwise
    (FedAvg's local SGD); a model the ghost strategy cannot serve falls back to vmap at its first
    chunk (:class:`AutoPerUnit`)."""
    if name == "auto":
        if algorithm.update != "gradient":
            return "vmap"
        return "ghost" if getattr(algorithm, "private", True) else "batch"
    return name


class AutoPerUnit:
    """``per_unit: auto`` for gradient updates: the ghost strategy, or vmap for a model it cannot
    serve (a parameter used outside the layers that own it, a layer that is not batch-first, ...).

    The ghost strategy refuses such a model before any sum is used (the coverage check runs on
    its first chunk), so the switch never mixes a wrong norm into a step. ``name`` is the strategy
    in use and ``fallback_reason`` why vmap was chosen (None while ghost serves).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, algorithm, precision: Precision | None = None, coverage=None):
        self._args = (model, loss_fn, algorithm, precision)
        self._inner = GhostPerUnit(model, loss_fn, algorithm, precision, coverage)
        self.names, self.params = self._inner.names, self._inner.params
        self.fallback_reason: str | None = None

    @property
    def name(self) -> str:
        return self._inner.name

    def clipped_sum(self, batch: dict, mask: torch.Tensor, weights: torch.Tensor, clip: StepClipping, sink=None):
        """The inner strategy's clipped sum (see :class:`PerUnitStrategy`); ``sink`` as the ghost
        strategy's (each parameter's sum handed over in order; vmap's handed over once formed)."""
        try:
            if self._inner.name == "ghost":
                return self._inner.clipped_sum(batch, mask, weights, clip, sink=sink)
        except GhostUnsupported as exc:
            self.fallback_reason = str(exc)
            self._inner = VmapPerUnit(*self._args)
        out = self._inner.clipped_sum(batch, mask, weights, clip)
        if sink is None:
            return out
        for j, x in enumerate(out[0]):
            sink(j, x)
        return (None, *out[1:])


def make_per_unit(
    name: str, model: nn.Module, loss_fn: LossFn, algorithm, precision: Precision | None = None, coverage=None
) -> PerUnitStrategy:
    """The per-unit strategy called ``name`` (``auto``: :func:`resolve_per_unit`). ``coverage``: the
    ghost strategy's coverage-check part, as the distribution holds the model (None: the whole
    parameters', :class:`userdp.engine.ghost.coverage.Coverage`).

    Raises:
        UserError: an unknown name (the message lists the registered ones), or a strategy that
            cannot serve the algorithm (ghost with FedAvg).
    """
    if resolve_per_unit(name, algorithm) == "ghost" and name == "auto":
        return AutoPerUnit(model, loss_fn, algorithm, precision, coverage)
    name = resolve_per_unit(name, algorithm)
    if name == "ghost":
        return GhostPerUnit(model, loss_fn, algorithm, precision, coverage)
    return PER_UNIT_STRATEGIES.lookup(name)(model, loss_fn, algorithm, precision)


def fedavg_epoch_batches(batch: dict, mask: torch.Tensor, epochs: int, rng) -> tuple[dict, torch.Tensor]:
    """Per-user, per-epoch shuffles of the local records with real records first: [m, E, G, ...]."""
    m, g = mask.shape
    keys = torch.from_numpy(rng.random((m, epochs, g))) + 2.0 * (1.0 - mask.double()).unsqueeze(1)
    perm = torch.argsort(keys, dim=-1)  # [m, E, G]
    rows = torch.arange(m).view(m, 1, 1)
    out = {k: v[rows, perm] for k, v in batch.items()}
    return out, mask[rows, perm]
