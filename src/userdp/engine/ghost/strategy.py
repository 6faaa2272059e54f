"""The ghost strategy itself (:class:`GhostPerUnit`): the forward with its hooks, the backward to
the layers' outputs, then the parts of this package in turn: the layer handlers, the stacks, the
norms and their bound, the clip factors, the sums."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from userdp.engine import contraction as cx
from userdp.engine.clipping import StepClipping
from userdp.engine.ghost import bound, grams, layers, stacks
from userdp.engine.ghost.capture import Capture, autocast_operand_dtype, captured, narrowable
from userdp.engine.ghost.coverage import Check, Coverage
from userdp.engine.ghost.factors import Factored, GhostUnsupported
from userdp.engine.ghost.layers import GHOST_LAYERS, LayerHandler, per_unit_vjp
from userdp.engine.ghost.sums import weighted_sum
from userdp.engine.model_lint import lint_model, trainable_parameters
from userdp.engine.precision import Precision, exact_float32
from userdp.engine.rounding import round_down_to, unit_roundoff
from userdp.errors import UserError


@dataclass
class _Chunk:
    """What the capture stage leaves for the others: the chunk's record count, its per-unit losses,
    the layer calls and their outputs' gradients (taken, and released, by the layers' stage), and the
    first chunk's coverage check (the checked group's batch gradients)."""

    n: int
    unit_loss: torch.Tensor
    captures: list | None
    out_grads: list | None
    batch_grads: list | None
    check: Check | None
    scale: float


@dataclass
class _Parts:
    """Per parameter its materialized part (``[m, *shape]`` or None) and its uses kept factored, and
    the stacks that hold some of them: ``blocks`` (materialized-only vectors of one size, stacked
    ``[m, k, size]``) and ``stacks`` (single-use dense ghosts of one factor shape)."""

    dense: list
    factored: list
    seen: list
    blocks: list
    stacks: list

    @classmethod
    def stacked(cls, dense: list, factored: list, seen: list, m: int, stack: bool) -> _Parts:
        blocks = [
            (g, torch.stack([dense[j].reshape(m, -1) for j in g], dim=1))
            for g in (stacks.vector_groups(dense, factored, m) if stack else [])
        ]
        grouped = stacks.factor_groups(dense, factored, m) if stack else []
        return cls(dense, factored, seen, blocks, [stacks.FactorStack(g, factored) for g in grouped])

    def release_stacked(self) -> None:
        """The stacks hold their members' tensors now: the per-parameter lists let go of them."""
        for g in [g for g, _ in self.blocks] + [st.members for st in self.stacks]:
            for j in g:
                self.dense[j] = self.factored[j] = None


@dataclass
class _ClipFactors:
    """The clip factors' stage: each unit's factor from its proven upper bound (what it can add), its
    reported norm from the estimate; ``c`` ``[m, L]`` the factors times the weights, rounded down,
    ``c_narrow`` the same as bf16 numbers (<= c) for the tensor cores' contractions (None off them),
    ``bad`` the units whose norm or factor is not finite (added as zeros; ``zero``: they must be
    written as zeros, :func:`~userdp.engine.contraction.must_zero`)."""

    c: torch.Tensor
    c_narrow: torch.Tensor | None
    norms: torch.Tensor
    bad: torch.Tensor
    zero: bool

    @classmethod
    def of(cls, est, upper, weights: torch.Tensor, clip: StepClipping, tc: bool) -> _ClipFactors:
        f, _ = clip.clipping.factors_from_norms(upper, clip.state)
        _, norms = clip.clipping.factors_from_norms(est, clip.state)
        norms = norms.to(clip.acc_dtype)
        bad = ~torch.isfinite(norms) | ~torch.isfinite(f).all(1)
        c = round_down_to(torch.where(bad.unsqueeze(1), 0.0, f) * weights.to(f.dtype).unsqueeze(1), clip.acc_dtype)
        c_narrow = cx.round_down_bf16(c).float() if tc else None
        return cls(c, c_narrow, torch.where(bad, 0.0, norms), bad, cx.must_zero(bad, clip.lazy_zeroing))


class GhostPerUnit:
    """Per-unit clipping from activations and output gradients (see the module docstring).

    Args:
        model: the model (its trainable parameters are the update); BatchNorm in training mode is
            refused as for every strategy.
        loss_fn: ``loss_fn(model, batch) -> Tensor[n]``, one loss per record, batch-first.
        algorithm: an algorithm whose unit update is the ``"gradient"`` (ELS, ULS).
        precision: the :class:`~userdp.engine.precision.Precision` of the forward and backward.

    Raises:
        UserError: an update that is not a gradient (FedAvg), no trainable parameters, or a model
            the linter refuses.
    """

    name = "ghost"

    def __init__(self, model: nn.Module, loss_fn, algorithm, precision: Precision | None = None, coverage=None):
        lint_model(model)
        if algorithm.update != "gradient":
            raise GhostUnsupported(
                f"per_unit=ghost clips gradients; {type(algorithm).__name__}'s unit update is "
                f"{algorithm.update!r}: use training.per_unit: vmap (or auto)"
            )
        layers.register_transformers_layers()
        self.model, self.loss_fn, self.algorithm = model, loss_fn, algorithm
        self.precision = precision or Precision()
        self.names, self.params = trainable_parameters(model)
        self._index = {id(p): j for j, p in enumerate(self.params)}
        self._layers = [mod for mod in model.modules() if any(p.requires_grad for p in mod.parameters(recurse=False))]
        self.fallback_layers = sorted({type(mod).__name__ for mod in self._layers if type(mod) not in GHOST_LAYERS})
        self._mismatches = 0  # first-chunk checks whose sums differed from autograd's (_verify)
        # the coverage check's part (the distribution's: it knows which tensors the forward uses)
        self.coverage = (coverage or Coverage)(self.params, self._layers)
        self.last_choice: dict[str, str] = {}  # parameter -> "ghost" | "materialized" (last chunk)
        #: parameter -> for each dense (GEMM) use in the last chunk, whether it took the bf16 tensor-core path
        self.last_narrow: dict[str, list[bool]] = {}

    def _handler(self, mod) -> LayerHandler:
        return GHOST_LAYERS.get(type(mod), per_unit_vjp)

    def _forward(self, flat: dict):
        """Forward with hooks: (per-unit losses [m] in the accumulation dtype, captures)."""
        captures: list[Capture] = []
        device = self.params[0].device

        def hook(mod, args, out):
            if not isinstance(out, torch.Tensor):
                raise GhostUnsupported(
                    f"per_unit=ghost: layer {type(mod).__name__} returns {type(out).__name__}, "
                    "not a tensor: use training.per_unit: vmap"
                )
            captures.append(Capture(mod, tuple(captured(a) for a in args), out))
            self.coverage.saw(mod)

        def cast_first(mod, args):
            # a float32 input of an autocast GEMM layer is cast here, as autocast would cast it inside the
            # layer (the same rounding), so the layer's GEMM, autograd's saved operand and the capture
            # (the hook above sees these args) share one bf16 tensor
            cast = autocast_operand_dtype(mod, device)
            if cast is None or not any(narrowable(a) for a in args):
                return None
            return tuple(a.to(cast) if narrowable(a) else a for a in args)

        handles = [mod.register_forward_hook(hook) for mod in self._layers]
        handles += [mod.register_forward_pre_hook(cast_first) for mod in self._layers]
        try:
            with self.precision.autocast(self.params[0].device):
                losses = self.loss_fn(self.model, flat)
        finally:
            for h in handles:
                h.remove()
        return losses, captures

    def clipped_sum(self, batch: dict, mask: torch.Tensor, weights: torch.Tensor, clip: StepClipping, sink=None):
        """One chunk's clipped, weighted sum from one forward and one backward (module docstring),
        its units clipped as ``clip`` says (FedAvg's ``reproject`` does not apply: ghost serves
        gradient updates only).

        ``sink``: None, or ``sink(j, s)`` called with each parameter's sum ``s`` as soon as it is
        formed, in the order of the parameters, one at a time (no stacked groups): a distribution that
        splits the model reduce-scatters it there, so no rank holds more than one parameter's whole sum at a time
        (:mod:`userdp.engine.distributed.sharding`). The returned sums are then None.

        Returns:
            (sums, norms, losses, bad) as :meth:`userdp.engine.per_unit.PerUnit.clipped_sum`.

        Raises:
            UserError: a layer whose input is not batch-first, or (first chunk) a parameter used
                outside the layers that own it.
        """
        m = mask.shape[0]
        acc_dtype = clip.acc_dtype
        tc = cx.tensor_cores(self.params[0].device)  # one choice for the chunk's factors and its clip factors
        chunk = self._backward(batch, mask, weights, acc_dtype)
        # every contraction of norms and sums in IEEE float32, whatever the caller's TF32 setting
        with exact_float32():
            parts = self._factor(chunk, m, acc_dtype, tc=tc, stack=sink is None)
            est, upper = self._bounds(parts, m, acc_dtype)
            if chunk.check is not None:
                self._verify(parts.seen, parts.dense, parts.factored, chunk.batch_grads, chunk.scale, chunk.check)
            chunk.batch_grads = None
            parts.release_stacked()
            factors = _ClipFactors.of(est, upper, weights, clip, tc)
            sums = self._sums(parts, factors, sink)
            return sums, factors.norms, chunk.unit_loss, factors.bad

    def _backward(self, batch: dict, mask: torch.Tensor, weights: torch.Tensor, acc_dtype) -> _Chunk:
        """The capture stage: the forward with hooks and one backward to the layers' outputs (and, on
        a first chunk, to the parameters the coverage check compares)."""
        m, g_cap = mask.shape
        n = m * g_cap
        flat = {k: v.reshape(n, *v.shape[2:]) for k, v in batch.items()}
        losses, captures = self._forward(flat)
        if losses.shape != (n,):
            raise UserError(f"loss_fn must return one loss per record (shape ({n},)), got {tuple(losses.shape)}")
        lm = losses.to(acc_dtype).reshape(m, g_cap)
        mk = mask.to(acc_dtype)
        unit_loss = (lm * mk).sum(1) / mk.sum(1).clamp(min=1.0)
        scale = self.precision.loss_scale
        outs = [c.edge for c in captures if c.edge is not None]
        check = self.coverage.start(weights)  # the first chunks compare the units' sums with autograd's
        wrt = check.wrt if check is not None else []
        grads = torch.autograd.grad(unit_loss.sum() * scale, outs + wrt, allow_unused=True)
        delivered = iter(grads[: len(outs)])
        out_grads = [None if c.edge is None else next(delivered) for c in captures]
        del delivered
        batch_grads = self.coverage.batch_grads(check, grads[len(outs) :])
        return _Chunk(n, unit_loss.detach(), captures, out_grads, batch_grads, check, scale)

    def _factor(self, chunk: _Chunk, m: int, acc_dtype, *, tc: bool, stack: bool) -> _Parts:
        """The layers' stage: each captured call's handler turns its inputs and output gradient into its
        parameters' parts (factored uses, materialized gradients); then per parameter the materialized
        part and the uses kept as ghosts (:meth:`_arrange`), and the same-shaped ones stacked
        (``stack``: a sink takes the sums one parameter at a time, in order: no groups). ``tc``: the
        factored uses are contracted on tensor cores."""
        n, scale = chunk.n, chunk.scale
        contrib: list[list] = [[] for _ in self.params]
        self.last_narrow = {}
        captures, out_grads = chunk.captures, chunk.out_grads
        chunk.captures = chunk.out_grads = None
        assert captures is not None and out_grads is not None, "the layers' stage takes a chunk once"
        for i, cap in enumerate(captures):
            go, out_grads[i] = out_grads[i], None  # each output's gradient dropped once its layer's factors hold it
            if go is None:
                continue
            if go.dim() == 0 or go.shape[0] != n:
                raise GhostUnsupported(
                    f"per_unit=ghost: the output of a {type(cap.module).__name__} layer has shape "
                    f"{tuple(go.shape)}, not the chunk's {n} records first (an input broadcast over the "
                    "batch, e.g. position ids of shape [1, L]: pass them per record), so its gradient "
                    "mixes units: use training.per_unit: vmap"
                )
            go = go.to(acc_dtype) / scale if scale != 1.0 else go
            for attr, got in self._handler(cap.module)(cap.module, cap.inputs, go, m, acc_dtype).items():
                p = getattr(cap.module, attr)
                if p is not None and p.requires_grad:
                    for part in got:
                        if isinstance(part, Factored):
                            part.tc = tc
                            if not part.index:
                                self.last_narrow.setdefault(self.names[self._index[id(p)]], []).append(part.narrow)
                    contrib[self._index[id(p)]].extend(got)
        seen = [bool(parts) for parts in contrib]
        dense, factored = self._arrange(contrib, m, acc_dtype)
        return _Parts.stacked(dense, factored, seen, m, stack)

    def _bounds(self, parts: _Parts, m: int, acc_dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The norms' stage: per parameter the estimate of each unit's squared norm and what bounds the
        unit's contribution above it (:func:`~userdp.engine.ghost.bound.bounded_norms`), a stack's
        members at once; returns ``(estimate, upper)`` float64 ``[m, L]``."""
        per_param: list = [None] * len(self.params)
        u_dense = unit_roundoff(acc_dtype, False)
        for g, block in parts.blocks:
            sq = block.pow(2).sum(2, dtype=torch.float64)  # [m, k]: squares summed in float64
            size = sq.sqrt()
            for i, j in enumerate(g):
                per_param[j] = bound.Bound(sq[:, i], None, None, 0, u_dense, size[:, i])
        for st in parts.stacks:
            for j, b in zip(st.members, st.bounds(), strict=True):
                per_param[j] = b
        for j, (d, fs) in enumerate(zip(parts.dense, parts.factored, strict=True)):
            if per_param[j] is None:
                per_param[j] = grams.parameter_bound(d, fs, m, u_dense)
        return bound.bounded_norms(per_param, m)

    def _sums(self, parts: _Parts, factors: _ClipFactors, sink) -> list | None:
        """The summation stage: each parameter's ``Σ_u c_u · (unit u's gradient)``, a stack's members at
        once; each part is released as its sum is formed, so the sums do not pile up on top of every
        capture. With a ``sink``, each sum goes there as it is formed (None is returned)."""
        c, c_narrow, bad, zero = factors.c, factors.c_narrow, factors.bad, factors.zero
        sums: list = [None] * len(self.params)
        while parts.blocks:
            g, block = parts.blocks.pop()
            if zero:
                block = block.masked_fill(bad.view(-1, 1, 1), 0)
            out = (block * torch.stack([c[:, j] for j in g], dim=1).unsqueeze(2)).sum(0)  # [k, n]
            for i, j in enumerate(g):
                sums[j] = out[i].view(self.params[j].shape)
            del block, out
        while parts.stacks:
            st = parts.stacks.pop()
            out = st.weighted_sums(c_narrow if st.narrow else c, bad if zero else None)
            for i, j in enumerate(st.members):
                sums[j] = out[i].to(c.dtype).view(self.params[j].shape)
            del st, out
        dense, factored = parts.dense, parts.factored
        for j, p in enumerate(self.params):
            if sums[j] is not None:
                continue
            d, fs = dense[j], factored[j]
            dense[j] = factored[j] = None
            if zero:
                d = d.masked_fill(bad.view(-1, *([1] * (d.dim() - 1))), 0) if d is not None else None
                fs = [x.zero_units(bad) for x in fs]
            # tensor cores: one bf16 factor (<= c) for all the parameter's parts
            cj = c_narrow[:, j] if c_narrow is not None and any(x.narrow for x in fs) else c[:, j]
            sums[j] = weighted_sum(d, fs, cj, p)
            del d, fs
            if sink is not None:
                s, sums[j] = sums[j], None
                sink(j, s)
                del s
        return None if sink is not None else sums

    def _arrange(self, contrib, m, dtype):
        """Per parameter: the materialized part ``[m, *shape]`` (or None) and the uses kept factored.

        A factored use is kept as a ghost when its Gram matrix (T² per unit) is no larger than the
        unit's layer gradient (X·Y), else it is materialized (mixed ghost clipping)."""
        dense, factored = [], []
        self.last_choice = {}
        for name, p, parts in zip(self.names, self.params, contrib, strict=True):
            d, fs = None, []
            for part in parts:
                if isinstance(part, Factored) and part.tokens**2 <= part.numel:
                    fs.append(part)
                    continue
                mat = part.materialize() if isinstance(part, Factored) else part
                mat = mat.reshape(m, *p.shape)
                d = mat if d is None else d + mat
            if d is None and not fs:  # unused by this chunk: a zero gradient
                d = torch.zeros(m, *p.shape, dtype=dtype, device=p.device)
            dense.append(d)
            factored.append(fs)
            self.last_choice[name] = "ghost" if fs and d is None else ("mixed" if fs else "materialized")
        return dense, factored

    def _verify(self, seen, dense, factored, batch_grads, scale, check: Check) -> None:
        """First chunks: every parameter the loss uses must be seen by a hook, and the units'
        gradients must add up to autograd's batch gradient (checked on the first chunk whose values
        are finite; ``check``: the parameters compared on this chunk, from the coverage part). A
        parameter used outside its layers' forward would otherwise be missing from its norms and from
        the sum alike: the sensitivity bound still holds for what is summed (both come from the same
        factors), but the update would silently lack that use. (Where the model is split over ranks, later groups are
        compared on later chunks, maybe of later steps: a model that fails one trains those steps
        without that use, then stops with the error; its privacy is the same.)"""
        group = check.group
        tol = self.precision.verify_tolerance
        complete = True
        for j, (name, p, d, fs, bg, used) in enumerate(
            zip(self.names, self.params, dense, factored, batch_grads, seen, strict=True)
        ):
            if not used:
                self.coverage.unseen(name)  # where there is no gradient to compare, the part refuses it
            if j not in group:
                continue
            if not used and bg is not None:  # structural: no layer's hook saw a parameter the loss uses
                raise GhostUnsupported(
                    f"per_unit=ghost: parameter {name!r} is used by the loss but not through the "
                    "forward of a layer that owns it, so no per-unit norm can be formed from "
                    "activations: use training.per_unit: vmap"
                )
            m_units = (d if d is not None else fs[0].y).shape[0]
            dt = d.dtype if d is not None else fs[0].compute_dtype
            ours = weighted_sum(d, fs, torch.ones(m_units, dtype=dt, device=p.device), p)
            ref = torch.zeros_like(ours) if bg is None else bg.to(ours.dtype) / scale
            if not (torch.isfinite(ours).all() and torch.isfinite(ref).all()):
                complete = False  # a non-finite chunk says nothing about coverage: check the next one
                continue
            err = torch.linalg.vector_norm(ours - ref)
            size = torch.linalg.vector_norm(ref) + torch.linalg.vector_norm(ours)
            if float(err) > tol * float(size) + 1e-12 * math.sqrt(p.numel()):
                # a missing use fails every chunk; one unit whose records cancel (gradients of 1e4 summing
                # to 1) can make one chunk's float32 sums differ from autograd's by more than the tolerance
                # (summed in another order): check the next chunk before refusing the model
                self._mismatches += 1
                complete = False
                if self._mismatches >= 2:
                    raise GhostUnsupported(
                        f"per_unit=ghost: the gradient of {name!r} is not fully seen by the layers "
                        "that own it (the parameter is used outside their forward, e.g. a functional "
                        "call in a parent module), so its per-unit norm would be wrong: use "
                        "training.per_unit: vmap"
                    )
                break
        self.coverage.finish(check, complete)
