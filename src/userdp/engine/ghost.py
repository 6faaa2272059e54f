"""The ghost per-unit strategy: per-unit norms and the clipped sum without per-unit gradient copies.

For a layer ``y = W a`` applied to every token t of a unit, the unit's weight gradient is
``Σ_t g_t a_tᵀ`` (``g_t`` the gradient of the loss at the layer's output). Its squared norm is
``Σ_{t,s} (g_t·g_s)(a_t·a_s)`` — two T×T Gram matrices, never the d_out×d_in gradient
("ghost norm", Goodfellow 2015; Li et al. 2022). For ULS a unit is a user, so T = G·L: the user's
G records × L tokens are treated as one sequence. Per layer and per chunk the strategy picks the
cheaper of the ghost norm (memory ∝ T²) and materializing the unit's layer gradient
(∝ d_out·d_in), as mixed ghost clipping does (Bu et al. 2023).

The clipped sum comes from the same factors (book-keeping, Bu et al. 2023): with each unit's
clip factor ``c_u``, ``Σ_u c_u Σ_t g_t a_tᵀ`` is one matrix product of the scaled output
gradients with the activations. So one forward and one backward (to the layers' outputs, not to
the weights) give norms and the clipped sum; the weights' batch gradient is never formed. And
the clipped sum is built from exactly the quantities whose norms were measured, so the
sensitivity bound holds for what is summed, whatever the rounding.

Launches: on a GPU every op is a kernel launch, and a step of small kernels is launch-bound
whatever its FLOPs. So parameters of one shape are stacked and handled as one (GROUP_ELEMENTS
caps what a group's temporaries hold; a chunk big enough to fill the device keeps one layer at a
time): the single-use dense ghosts of one factor shape (GPT-2's twelve ``c_fc``, ...) get one
batched Gram product per factor, one batched dot for their norms and one batched product for their
clipped sums; the small materialized-only parameters of one size (biases, LayerNorms, LoRA factors
whose gradients are cheaper than their Grams) one stacked norm and one stacked sum. A ghost chunk
of GPT-2 small dispatches 1.24x a non-private forward and backward's kernels (2.20x one parameter
at a time; ``benchmarks/bench_ops.py``), with the same norms and sums (tests compare both). The
factor stacks follow the device (:data:`STACK_FACTORS`): the CPU, with no launches to save, keeps
one layer at a time.

What is captured and how (the registry :data:`GHOST_LAYERS`, keyed by layer type, like Opacus's
grad samplers): ``nn.Linear`` (and so peft's LoRA A/B, which are Linears), GPT-2's ``Conv1D``,
``nn.Embedding`` (a one-hot factor: Gram entries are token-id equalities), ``nn.LayerNorm``
(materialized: its gradients are d-vectors). A layer of any other type that owns trainable
parameters falls back to per-unit gradients **for that layer only**, computed by ``torch.func``
(vmap over units of the layer's vector-Jacobian product at its captured inputs). A parameter used
by several layers (GPT-2's tied ``wte``/``lm_head``) gets the cross terms of its contributions.

Precision: Gram matrices, norms, factors and sums are computed in float32 (float64 for a float64
model) from the captured tensors, whatever the autocast dtype of the forward. Under bf16/fp16
autocast the captured activations and output gradients are *kept* in that dtype and upcast at
each use (one layer at a time): the values are the same as upcasting them once at capture, so the
norms and the sums are bit-identical to that, while the chunk holds half the bytes (no float32
copy of every captured layer's input and output gradient until the clipped sum is formed).

Memory: a capture holds its layer's inputs and its output's gradient edge, never the output (so
what a non-private forward frees is freed here too), and an autocast GEMM layer's float32 input is
cast before the layer (one bf16 tensor for the GEMM, autograd and the capture): a chunk's peak is
the non-private forward and backward's, counted op by op (``benchmarks/bench_memory.py``).

Assumptions, checked: every layer sees a batch-first input whose leading dimension is the chunk's
record count (the engine's ``loss_fn`` contract); on its first chunk the strategy compares the
sum of its per-unit gradients with autograd's batch gradient and refuses (naming the parameter)
a model that uses a parameter outside the forward of the layers that own it, where no hook can
see it. FedAvg's unit update is a local-SGD delta, not a gradient: it keeps the vmap strategy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.func import functional_call, vjp, vmap

from userdp.engine import contraction as cx
from userdp.engine.clipping import StepClipping
from userdp.engine.layer_norm_grads import LayerNormSpec, per_unit_grads
from userdp.engine.model_lint import BUFFER_CHANGED, lint_model, mutates_captured, trainable_parameters
from userdp.engine.precision import Precision, exact_float32
from userdp.engine.rounding import gamma, round_down_to, unit_roundoff
from userdp.engine.sharding import is_sharded, whole
from userdp.errors import UserError


class GhostUnsupported(UserError):
    """The model cannot be served by ghost norms (a layer that is not batch-first, an input broadcast
    over the batch, a parameter used outside its layers): ``per_unit: auto`` then uses vmap."""


#: the clip factor is taken from a proven upper bound on what a unit adds, not from its estimated
#: norm (docs/guarantee.md, "Ghost norms: the bound"): the Gram-form norm plus the bound on its
#: rounding error, plus the bound on the rounding of the unit's own terms in the clipped sum.
#: BOUND = False takes the factor from the estimate alone (the pre-0.4 behaviour: a unit whose
#: per-token terms cancel could then add up to 3x C); only tests set it, to show that.
BOUND = True


@dataclass
class Factored:
    """One use of a parameter of layout ``[X, Y]``: unit u's gradient is ``Σ_t x[u,t] ⊗ y[u,t]``.

    ``x`` is dense ``[m, T, X]`` or, when ``index`` is True, int64 token ids ``[m, T]`` standing for
    one-hot rows of size ``size_x`` (an embedding); ``y`` is ``[m, T, Y]``.
    """

    x: torch.Tensor
    y: torch.Tensor
    size_x: int
    index: bool = False
    #: the dtype everything is computed in (float32, or float64); ``x``/``y`` may be stored narrower
    dtype: torch.dtype | None = None
    #: contract bf16 ``x``/``y`` on tensor cores (float32 accumulation) instead of upcasting first
    tc: bool = False
    #: cached upper bounds on the rows' norms (:meth:`row_norms`) and on the magnitude (:meth:`magnitude`)
    _rows: tuple | None = field(default=None, repr=False, compare=False)
    _mag: torch.Tensor | None = field(default=None, repr=False, compare=False)
    #: ``Σ_s |Ĝx_ts|`` ``[m, T]``, kept from the use's own Gram where the rounded operand needs it (:meth:`spread`)
    _gx_rows: torch.Tensor | None = field(default=None, repr=False, compare=False)
    #: units whose rows of ``y`` count as zero in :meth:`weighted_sum` (:meth:`zero_units`)
    bad: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def narrow(self) -> bool:
        """Both factors bf16 (token ids count as exact), so tensor cores may contract them."""
        return (
            self.tc
            and self.y.dtype == torch.bfloat16
            and self.compute_dtype == torch.float32
            and (self.index or self.x.dtype == torch.bfloat16)
        )

    @property
    def rounds_operand(self) -> bool:
        """This use's clipped sum takes the rounded tensor-core operand (a dense use on tensor cores
        with :data:`~userdp.engine.contraction.SUM_OPERAND` "rounded"), whose rounding the norm's
        bound takes in through :meth:`spread`; an embedding's sum is exact."""
        return not self.index and cx.operand_roundoff(self.narrow) > 0

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.dtype or self.y.dtype

    @property
    def u(self) -> float:
        """The unit roundoff of this use's contractions (:func:`~userdp.engine.rounding.unit_roundoff`)."""
        return unit_roundoff(self.compute_dtype, self.narrow)

    def row_norms(self) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        """``(rx, ry, sx, sy)``: the rows' computed norms ``[m, T]`` in the Grams' dtype and the factors
        by which they may be low: ``|x_t| <= sx rx_t``, ``|y_t| <= sy ry_t`` (a one-hot row has norm 1).
        Taken from the diagonals of the use's own Gram matrices when :func:`_inner` formed them (no
        extra pass over the factors), else from one pass; the factors cover the rounding of the
        squared norms (gamma_n relative: the terms are squares) and of the root. Python floats, so
        applying them costs no kernel."""
        if self._rows is None:
            y = self.fy()
            ry, sy = (y * y).sum(-1).sqrt(), _root_slack(int(y.shape[-1]) + 1, 2.0**-23)
            if self.index:
                rx, sx = torch.ones_like(ry), 1.0
            else:
                x = self.fx()
                rx, sx = (x * x).sum(-1).sqrt(), _root_slack(int(x.shape[-1]) + 1, 2.0**-23)
            self._rows = (rx, ry, sx, sy)
        return self._rows

    def magnitude(self) -> tuple[torch.Tensor, float]:
        """``(B, s)``: ``Σ_t |x_t| |y_t| <= s B`` per unit (``[m]``), which bounds the Frobenius norm
        of every partial sum of the unit's per-token terms: the scale of every rounding error in its
        norm and its sum. One batched dot; ``s`` covers the rows' factors and its own rounding."""
        if self._mag is None:
            rx, ry, sx, sy = self.row_norms()
            t = rx.shape[1]
            self._mag = (torch.bmm(rx.unsqueeze(1), ry.unsqueeze(2)).view(-1), sx * sy * (1.0 + gamma(t + 2, 2.0**-23)))
        return self._mag

    def spread(self) -> torch.Tensor:
        """``[m]`` float64: an upper bound on ``‖Σ_t x_t ⊗ e_t‖`` per unit for any ``e_t`` with
        ``|e_t| <= |y_t|`` elementwise: the scale of the rounded operand's error (which is at most
        2^-8 · c_u · |y_t| an entry). It is ``‖X‖₂ ‖E‖_F <= ‖X‖₂ ‖Y‖_F`` with ``‖X‖₂² = λ_max(Gx)``
        bounded by Gershgorin (the largest row sum of ``|Gx|``, from the computed Gram plus its
        rounding, gamma_X |x_t||x_s| an entry), or ``B = Σ_t |x_t||y_t|`` (Cauchy-Schwarz on each
        token) where that is smaller: up to sqrt(T) below B when the unit's inputs point apart.
        Every computed term is inflated by the factor it may be low by. (:func:`_spreads` computes
        a chunk's spreads together, from :meth:`spread_term`.)"""
        return _spreads([[self.spread_term()]], int(self.y.shape[0]))[0]

    def spread_term(self) -> _SpreadTerm:
        """What :meth:`spread` is computed from: this use's magnitude, rows' norms and, after its
        own Gram (:func:`_inner`), the row sums of ``|Gx|`` (None: B alone)."""
        mag, smag = self.magnitude()
        rx, ry, sx, sy = self.row_norms()
        return _SpreadTerm(mag, smag, rx, ry, sx, sy, self._gx_rows, gamma(int(self.x.shape[-1]), self.u))

    def fx(self) -> torch.Tensor:
        """``x`` in the compute dtype (token ids as they are)."""
        return self.x if self.index else self.x.to(self.compute_dtype)

    def fy(self) -> torch.Tensor:
        """``y`` in the compute dtype."""
        return self.y.to(self.compute_dtype)

    @property
    def tokens(self) -> int:
        return int(self.y.shape[1])

    @property
    def numel(self) -> int:
        return int(self.size_x) * int(self.y.shape[2])

    def materialize(self) -> torch.Tensor:
        """Unit-wise gradients ``[m, X, Y]``."""
        if self.index:
            m, _, y = self.y.shape
            out = torch.zeros(m * self.size_x, y, dtype=self.compute_dtype, device=self.y.device)
            rows = (self.x + self.size_x * torch.arange(m, device=self.x.device).unsqueeze(1)).reshape(-1)
            out.index_add_(0, rows, self.fy().reshape(-1, y))
            return out.view(m, self.size_x, y)
        if self.narrow:
            return cx.mm32(self.x.transpose(1, 2), self.y)
        return torch.bmm(self.fx().transpose(1, 2), self.fy())

    def weighted_sum(self, c: torch.Tensor) -> torch.Tensor:
        """``Σ_u c_u Σ_t x[u,t] ⊗ y[u,t]`` (``[X, Y]``): the clipped sum of this use.

        On tensor cores (:attr:`narrow`) the factors ``c`` must already be bf16 numbers (see
        :func:`~userdp.engine.contraction.round_down_bf16`): then each ``c_u · y`` is exact in float32 and splits
        exactly into
        two bf16 pieces, and ``xᵀ hi + xᵀ lo`` is one bf16 GEMM with float32 accumulation — the
        float32 result up to the order of its sums, at twice the bf16 FLOPs instead of float32's."""
        if not self.index:
            return cx.clipped_contraction(self.x, self.y, c, self.narrow, self.compute_dtype, self.bad)
        width = self.y.shape[2]
        if self.narrow:  # noqa: SIM108 - each branch's comment says why it is exact
            y = self.y.float() * c.float().view(-1, 1, 1)  # exact: bf16 x bf16
        else:
            y = self.fy() * c.view(-1, 1, 1)
        out = torch.zeros(self.size_x, width, dtype=y.dtype, device=y.device)
        return out.index_add_(0, self.x.reshape(-1), y.reshape(-1, width))

    def zero_units(self, bad: torch.Tensor) -> Factored:
        """This use with the units ``bad`` (bool ``[m]``) zeroed in both factors (Inf and NaN
        included: masked_fill writes the zeros, it does not multiply). A dense use keeps ``y`` as it
        is and ``bad`` with it: :meth:`weighted_sum` zeroes those rows where it reads ``y``
        (:func:`~userdp.engine.contraction.clipped_contraction`; on tensor cores in the same pass that builds the
        GEMM's operand)."""
        drop = bad.view(-1, 1, 1)
        if self.index:  # x holds token ids
            return Factored(self.x, cx.zero_rows(self.y, drop), self.size_x, self.index, self.dtype, self.tc)
        return Factored(cx.zero_rows(self.x, drop), self.y, self.size_x, self.index, self.dtype, self.tc, bad=bad)


@dataclass
class _SpreadTerm:
    """One rounded use's share of its parameter's spread (:meth:`Factored.spread`): ``mag`` ``[m]``
    the computed ``Σ_t |x_t||y_t|`` (low by at most the factor ``smag``), ``rx``/``ry`` ``[m, T]`` the
    rows' computed norms (low by at most ``sx``/``sy``), ``gx_rows`` ``[m, T]`` the row sums of the
    computed ``|Gx|`` (None: the spread is B), ``gxn`` gamma_X of that Gram."""

    mag: torch.Tensor
    smag: float
    rx: torch.Tensor
    ry: torch.Tensor
    sx: float
    sy: float
    gx_rows: torch.Tensor | None
    gxn: float

    def split(self, k: int) -> list[_SpreadTerm]:
        """A stack's term (``k·m`` units: k members of m) as each member's, by views."""

        def part(t, i):
            return None if t is None else t.view(k, -1, *t.shape[1:])[i]

        return [
            _SpreadTerm(
                part(self.mag, i),
                self.smag,
                part(self.rx, i),
                part(self.ry, i),
                self.sx,
                self.sy,
                part(self.gx_rows, i),
                self.gxn,
            )
            for i in range(k)
        ]


def _spreads(per_param: list[list[_SpreadTerm]], m: int) -> torch.Tensor:
    """``[P, m]`` float64: per parameter, the sum of its terms' spreads (:meth:`Factored.spread`),
    all of a chunk's uses at once: a dozen kernels per token count, not a dozen per use (49 uses at
    gpt2-small). A parameter without terms gets 0."""
    terms = [(j, t) for j, ts in enumerate(per_param) for t in ts]
    device = terms[0][1].mag.device if terms else torch.device("cpu")
    out = torch.zeros(len(per_param), m, dtype=torch.float64, device=device)
    groups: dict = {}
    for j, t in terms:  # uses of one token count stack; B-only terms stack apart
        groups.setdefault(None if t.gx_rows is None else int(t.rx.shape[1]), []).append((j, t))
    for tokens, members in groups.items():
        ts = [t for _, t in members]

        def coef(values):
            return _coefficients(tuple(values), device).view(-1, 1)

        b = torch.stack([t.mag for t in ts]).double() * coef(t.smag * (1.0 + 2.0**-40) for t in ts)  # [U, m]
        if tokens is None:
            val = b
        else:
            rxd = torch.stack([t.rx for t in ts]).double() * coef(t.sx for t in ts).unsqueeze(2)  # [U, m, T]
            rows = torch.stack([t.gx_rows for t in ts]).double() * (1.0 + gamma(tokens + 2, 2.0**-23)) + coef(
                t.gxn for t in ts
            ).unsqueeze(2) * rxd * rxd.sum(2, keepdim=True)
            yf = (torch.stack([t.ry for t in ts]).double() * coef(t.sy for t in ts).unsqueeze(2)).pow(2).sum(2)
            val = torch.minimum(b, (rows.amax(2) * yf).sqrt() * (1.0 + 2.0**-40))
        index = _coefficients(tuple(j for j, _ in members), device, torch.long)
        out.index_add_(0, index, val)
    return out


def _x_gram(a: Factored, b: Factored) -> torch.Tensor:
    """``[m, Ta, Tb]``: the inner products of a's and b's x rows."""
    if a.index and b.index:
        return (a.x.unsqueeze(2) == b.x.unsqueeze(1)).to(a.compute_dtype)
    if a.index:  # one-hot row ids_t against dense rows: b.x[u, s, ids_t], gathered before the upcast (exact
        # either way; upcasting first copied the whole factor: the tied head's 50,257-wide logit gradient)
        picked = torch.gather(b.x, 2, a.x.unsqueeze(1).expand(-1, b.x.shape[1], -1))
        return picked.to(b.compute_dtype).transpose(1, 2)
    if b.index:
        return _x_gram(b, a).transpose(1, 2)
    if a.narrow and b.narrow:  # bf16 x bf16 is exact in float32: tensor cores, float32 accumulation
        return cx.mm32(a.x, b.x.transpose(1, 2))
    ax = a.fx()
    return torch.bmm(ax, (ax if b is a else b.fx()).transpose(1, 2))


def _y_gram(a: Factored, b: Factored) -> torch.Tensor:
    """``[m, Ta, Tb]``: the inner products of a's and b's y rows."""
    if a.narrow and b.narrow:
        return cx.mm32(a.y, b.y.transpose(1, 2))
    ay = a.fy()  # a use's own norm (b is a): one upcast, not two
    return torch.bmm(ay, (ay if b is a else b.fy()).transpose(1, 2))


def _inner(a: Factored, b: Factored) -> tuple[torch.Tensor, torch.Tensor]:
    """``([m], [m])``: ``<Σ_t a.x_t ⊗ a.y_t, Σ_s b.x_s ⊗ b.y_s>`` per unit from two Gram matrices,
    and a proven bound on that value's rounding error (both float64).

    The bound (docs/guarantee.md, "Ghost norms: the bound"): an entry of a Gram of rows of width n
    is off by at most ``gamma_n |r_t| |r_s|``; with ``Gx``, ``Gy`` the computed Grams and ``rx``, ``ry``
    the rows' norms, the exact value lies within ``gamma_X rxᵀ|Gy|rx + gamma_Y ryᵀ|Gx|ry +
    (gamma_X gamma_Y + 2u) B_a B_b`` of ``Σ Gx⊙Gy`` (``B = Σ_t |x_t||y_t|``); that sum is taken row by
    row in float32 (adding ``gamma_T Σ|Gx||Gy|``, bounded through the first quadratic form) and over
    rows in float64. An embedding's one-hot Gram, and a gather from one, are exact (gamma_X = 0).
    Per-token terms that cancel (records built to hide a large gradient) make the estimate small and
    this bound large, so the clip factor still holds what is summed to C."""
    gx, gy = _x_gram(a, b), _y_gram(a, b)
    ta, tb = gy.shape[1:]
    u = max(a.u, b.u)
    gxn = 0.0 if (a.index or b.index) else gamma(int(a.x.shape[-1]), u)
    gyn = gamma(int(a.y.shape[-1]), u)
    spread_rows = b is a and a.rounds_operand  # |Gx|'s row sums for Factored.spread
    if b is a and a._rows is None:  # the rows' norms from the Grams' diagonals
        ry = torch.diagonal(gy, dim1=1, dim2=2).sqrt()
        rx = torch.ones_like(ry) if a.index else torch.diagonal(gx, dim1=1, dim2=2).sqrt()
        a._rows = (rx, ry, 1.0 if a.index else _root_slack_of(gxn), _root_slack_of(gyn))
    rxa, rya, sxa, sya = a.row_norms()
    rxb, ryb, sxb, syb = b.row_norms()
    # Σ_ts Gx⊙Gy in two levels: a sum per row (tb terms), then the rows (ta terms), so each term is
    # rounded at most ta + tb times: gamma_{ta+tb} Σ|Gx||Gy| <= gamma (1 + gamma_X) rxᵀ|Gy|rx; the two
    # quadratic forms likewise, per row then over rows (one Triton pass over the Grams on CUDA)
    rows, qy_rows, qx_rows, gx_rows = cx.gram_pair_rows(gx, gy, rxb, ryb, spread_rows)
    del gx, gy
    if spread_rows:
        a._gx_rows = gx_rows
    value = rows.sum(1)
    qy = _dot_rows(rxa, qy_rows)  # rxᵀ|Gy|rx, low by at most the rows' factors and gq
    qx = _dot_rows(rya, qx_rows)  # ryᵀ|Gx|ry
    ma, sma = a.magnitude()
    mb, smb = (ma, sma) if b is a else b.magnitude()
    # every term is non-negative: each coefficient carries the factors its computed terms may be low
    # by, and 2^-20 covers the float rounding of these three operations
    gq = (1.0 + gamma(ta + tb + 2, 2.0**-23)) * (1.0 + 2.0**-20)
    c_qx = gyn * gq * sya * syb
    c_qy = (gxn + gamma(ta + tb, u) * (1.0 + gxn)) * gq * sxa * sxb
    c_b = (gxn * gyn + 2.0 * u) * sma * smb * (1.0 + 2.0**-20)
    err = torch.addcmul(torch.add(qx * c_qx, qy, alpha=c_qy), ma, mb, value=c_b)
    return value, err


def _root_slack(n: int, u: float) -> float:
    """The factor a root of an n-term sum of squares may be low by (gamma_n, the root, the division)."""
    return _root_slack_of(gamma(n, u))


def _root_slack_of(g: float) -> float:
    return ((1.0 + 2.0**-20) / (1.0 - g)) ** 0.5


def _dot_rows(ra: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``[m]``: ``Σ_t ra_t q_t`` (``ra``, ``q`` ``[m, Ta]`` non-negative: a quadratic form's row sums,
    :func:`~userdp.engine.contraction.gram_pair_rows`) as one batched product in ``q``'s dtype; with
    the rows' own sums the form is low by at most gamma_{Ta+Tb+2} relative (the caller adds it)."""
    return torch.bmm(ra.to(q.dtype).unsqueeze(1), q.unsqueeze(2)).view(-1)


def _inner_dense(a: Factored, mat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``([m], [m])``: ``<Σ_t a.x_t ⊗ a.y_t, M_u>`` for materialized ``M [m, X, Y]``
    (``Σ_t x_tᵀ M y_t``), and the bound on its rounding error, ``(gamma_Y + gamma_X + u) B |M|``."""
    my = torch.bmm(a.fy(), mat.transpose(1, 2))  # [m, T, X]
    if a.index:
        value = torch.gather(my, 2, a.x.unsqueeze(2)).sum(dim=(1, 2), dtype=torch.float64)
    else:
        value = (a.fx() * my).sum(dim=(1, 2), dtype=torch.float64)
    u = a.u
    gam = gamma(int(a.y.shape[-1]), u) + (0.0 if a.index else gamma(int(a.x.shape[-1]), u)) + 2.0 * u
    size = torch.linalg.vector_norm(mat.reshape(mat.shape[0], -1), dim=1, dtype=torch.float64)
    mag, smag = a.magnitude()
    return value, (gam * smag * (1.0 + 2.0**-20)) * mag * size


#: keep bf16/fp16 captures narrow in Factored (upcast at each use); False upcasts at capture
#: (the reference the tests compare with: the results are bit-identical)
KEEP_NARROW = True


def _by_units(t: torch.Tensor, m: int, n: int, dtype: torch.dtype, what: str, *, store: bool = False) -> torch.Tensor:
    """``[n, ..., d] -> [m, T, d]`` in ``dtype`` (a unit's records are consecutive rows); with
    ``store``, a bf16/fp16 tensor stays in its dtype (a factor kept until the clipped sum)."""
    if t.dim() < 2 or t.shape[0] != n:
        raise GhostUnsupported(
            f"per_unit=ghost: {what} has shape {tuple(t.shape)}, expected the chunk's {n} records "
            "first; this model is not batch-first here: use training.per_unit: vmap"
        )
    t = t.reshape(m, -1, t.shape[-1])
    if store and KEEP_NARROW and t.dtype in (torch.bfloat16, torch.float16):
        return cx.aligned_rows(t)
    return t.to(dtype)


# --------------------------------------------------------------------------- layer registry
# handler(module, inputs, output_grad, m, dtype) -> {parameter attribute: [Factored | Tensor[m, *shape]]}
LayerHandler = Callable[[nn.Module, tuple, torch.Tensor, int, torch.dtype], dict]

#: layer type -> handler (Opacus-style registry); other layers with parameters use :func:`_per_unit_vjp`
GHOST_LAYERS: dict[type, LayerHandler] = {}


def register_ghost_layer(*types: type):
    """Decorator: register a handler for layers of ``types`` (see :data:`LayerHandler`)."""

    def deco(fn: LayerHandler) -> LayerHandler:
        for t in types:
            GHOST_LAYERS[t] = fn
        return fn

    return deco


@register_ghost_layer(nn.Linear)
def _linear(mod: nn.Linear, inputs: tuple, gout: torch.Tensor, m: int, dtype: torch.dtype) -> dict:
    n = gout.shape[0]
    a = _by_units(inputs[0], m, n, dtype, f"the input of {type(mod).__name__}", store=True)
    g = _by_units(gout, m, n, dtype, f"the output of {type(mod).__name__}", store=True)
    out = {"weight": [Factored(g, a, mod.out_features, dtype=dtype)]}
    if mod.bias is not None:
        out["bias"] = [g.sum(1, dtype=dtype)]  # accumulated in dtype: no upcast copy of g
    return out


def _conv1d(mod, inputs: tuple, gout: torch.Tensor, m: int, dtype: torch.dtype) -> dict:
    """transformers' ``Conv1D`` (GPT-2): ``y = a W + b`` with ``W`` stored ``[in, out]``."""
    n = gout.shape[0]
    a = _by_units(inputs[0], m, n, dtype, "the input of Conv1D", store=True)
    g = _by_units(gout, m, n, dtype, "the output of Conv1D", store=True)
    return {"weight": [Factored(a, g, a.shape[2], dtype=dtype)], "bias": [g.sum(1, dtype=dtype)]}


@register_ghost_layer(nn.Embedding)
def _embedding(mod: nn.Embedding, inputs: tuple, gout: torch.Tensor, m: int, dtype: torch.dtype) -> dict:
    if mod.max_norm is not None or mod.scale_grad_by_freq or mod.sparse:
        raise GhostUnsupported(
            "per_unit=ghost: nn.Embedding with max_norm, scale_grad_by_freq or sparse gradients "
            "is not supported: use training.per_unit: vmap"
        )
    ids = inputs[0]
    n = gout.shape[0]
    if ids.shape[0] != n:
        raise GhostUnsupported(
            f"per_unit=ghost: embedding ids have shape {tuple(ids.shape)}, expected {n} records first"
        )
    ids = ids.reshape(m, -1)
    g = _by_units(gout, m, n, dtype, "the output of nn.Embedding", store=True)
    if mod.padding_idx is not None:  # PyTorch gives the padding row no gradient (x 0/1: exact in any dtype)
        g = g * (ids != mod.padding_idx).unsqueeze(2).to(g.dtype)
    return {"weight": [Factored(ids.long(), g, mod.num_embeddings, index=True, dtype=dtype)]}


@register_ghost_layer(nn.LayerNorm)
def _layer_norm(mod: nn.LayerNorm, inputs: tuple, gout: torch.Tensor, m: int, dtype: torch.dtype) -> dict:
    # materialized: a unit's gradients are d-vectors (engine/layer_norm_grads.py: torch's passes, or one
    # Triton pass on CUDA)
    got = per_unit_grads(inputs[0], gout, m, LayerNormSpec.of(mod), dtype)
    return {name: [v] for name, v in got.items()}


def _register_transformers_layers() -> None:
    """GPT-2's Conv1D, registered when transformers is importable (it is a dependency)."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    GHOST_LAYERS.setdefault(Conv1D, _conv1d)
    AUTOCAST_GEMM_LAYERS.add(Conv1D)  # its forward is torch.addmm


def _per_unit_vjp(mod: nn.Module, inputs: tuple, gout: torch.Tensor, m: int, dtype: torch.dtype) -> dict:
    """Fallback for a layer type with no handler: its own parameters' per-unit gradients by
    ``torch.func`` (vmap over units of the layer's VJP at the captured inputs), materialized."""
    names = [n for n, p in mod.named_parameters(recurse=False) if p.requires_grad]
    n = gout.shape[0]
    # a sharded parameter (FSDP2: a DTensor once the forward has resharded it) is gathered whole for
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


def _weighted_sum(
    dense: torch.Tensor | None, factored: list[Factored], c: torch.Tensor, p: torch.Tensor
) -> torch.Tensor:
    """``Σ_u c_u · (unit u's gradient of p)`` from its materialized part and its factored uses."""
    wide = c.float() if c.dtype == torch.bfloat16 else c  # a bf16 factor (tensor cores) is exact in float32
    # the first term is the sum's buffer (each term is a fresh tensor): no zeros + add per parameter
    s = torch.tensordot(wide, dense, dims=1).reshape(p.shape).to(wide.dtype) if dense is not None else None
    for x in factored:
        part = x.weighted_sum(c).reshape(p.shape)
        s = part.to(wide.dtype) if s is None else s.add_(part)
    return s


#: the most elements a stacked group's largest temporary may hold (64 MB in float32): groups form where
#: a chunk's per-layer kernels are small (launch-bound), and a chunk whose layers are big enough to
#: fill the device on their own keeps one layer at a time, so stacking never adds much memory
GROUP_ELEMENTS = 1 << 24


def _cap_groups(by_key: dict, per_member: dict) -> list[list[int]]:
    """Split each key's members into groups of at most ``GROUP_ELEMENTS // per_member[key]``, keeping
    those of two or more; ``GROUP_ELEMENTS = 0`` stacks nothing (one parameter at a time, the
    reference the tests compare with)."""
    if GROUP_ELEMENTS <= 0:
        return []
    groups = []
    for key, members in by_key.items():
        cap = max(1, GROUP_ELEMENTS // max(1, per_member[key]))
        groups.extend(g for g in (members[i : i + cap] for i in range(0, len(members), cap)) if len(g) > 1)
    return groups  # a group of one would only copy its member: it is left to the per-parameter path


def _vector_groups(dense: list, factored: list, m: int) -> list[list[int]]:
    """Indices of the parameters with a materialized part only, grouped by (size, dtype): each group
    is stacked ``[m, k, size]`` so its norms and clipped sums take a few kernels, not a few per
    parameter (GPT-2 small: 98 biases and LayerNorm vectors in 3 groups)."""
    by_key: dict = {}
    per_member: dict = {}
    for j, (d, fs) in enumerate(zip(dense, factored, strict=True)):
        if d is not None and not fs:
            key = (d[0].numel(), d.dtype)
            by_key.setdefault(key, []).append(j)
            per_member[key] = m * key[0]
    return _cap_groups(by_key, per_member)


#: where single-use dense ghosts are stacked: "auto" follows the device (CUDA, and the meta device
#: that stands in for it in the tests: launches cost there); on the CPU, which has no launch to save,
#: a batched product over a stack measured slower than one product per layer (gpt2-small, ELS: 2.27 s
#: against 2.01 s of GEMM a chunk), so it keeps one layer at a time. Tests force "on".
STACK_FACTORS = "auto"


def _stack_factors(device: torch.device) -> bool:
    return STACK_FACTORS == "on" or (STACK_FACTORS == "auto" and device.type in cx.TC_DEVICES)


def _factor_groups(dense: list, factored: list, m: int) -> list[list[int]]:
    """Indices of the parameters whose one use is a dense ghost (no materialized part, not an
    embedding), grouped by the shapes and dtypes of their factors: the twelve ``c_fc`` of GPT-2
    small, say. A group's Gram matrices and clipped sums are then one batched product each
    (where :data:`STACK_FACTORS` says so)."""
    by_key: dict = {}
    per_member: dict = {}
    for j, (d, fs) in enumerate(zip(dense, factored, strict=True)):
        if d is None and len(fs) == 1 and not fs[0].index and _stack_factors(fs[0].y.device):
            f = fs[0]
            key = (tuple(f.x.shape), tuple(f.y.shape), f.x.dtype, f.y.dtype, f.compute_dtype, f.tc)
            by_key.setdefault(key, []).append(j)
            _, t, wx = f.x.shape
            per_member[key] = m * t * max(t, wx, 2 * f.y.shape[2])  # Grams; x upcast; c·y split in two
    return _cap_groups(by_key, per_member)


class _FactorStack:
    """A group of single-use dense ghosts stacked ``[k, m, T, ·]``: one batched Gram product per
    factor for the group's norms, one batched product for its clipped sums. Stacking replaces each
    member's factors by views of the stack, one factor at a time, so the originals are freed as the
    copies are made."""

    def __init__(self, members: list[int], factored: list):
        self.members = members
        f0 = factored[members[0]][0]  # the members share shapes, dtypes and the tensor-core setting
        self.size_x, self.dtype, self.tc, self.narrow = f0.size_x, f0.dtype, f0.tc, f0.narrow
        x = torch.stack([factored[j][0].x for j in members])
        for i, j in enumerate(members):
            factored[j] = [Factored(x[i], factored[j][0].y, self.size_x, False, self.dtype, self.tc)]
        y = torch.stack([factored[j][0].y for j in members])
        for i, j in enumerate(members):
            factored[j] = [Factored(x[i], y[i], self.size_x, False, self.dtype, self.tc)]
        self.x, self.y = x, y

    def norm2(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list | None]:
        """``[k, m]`` each: the members' squared per-unit norms, their rounding-error bounds, their
        magnitudes and, with the rounded operand, each member's spread term (else None; the stack as
        k·m units of one use; see :func:`_inner`)."""
        k, m = self.x.shape[:2]
        flat = Factored(
            self.x.reshape(k * m, *self.x.shape[2:]),
            self.y.reshape(k * m, *self.y.shape[2:]),
            self.size_x,
            False,
            self.dtype,
            self.tc,
        )
        value, err = _inner(flat, flat)
        mag, smag = flat.magnitude()
        spread = flat.spread_term().split(k) if flat.rounds_operand else None
        return value.view(k, m), err.view(k, m), (mag * smag).view(k, m), spread

    def weighted_sums(self, c: torch.Tensor, bad: torch.Tensor | None) -> torch.Tensor:
        """``[k, X, Y]``: each member's ``Σ_u c[u, member] · (unit u's gradient)``, units ``bad`` zeroed
        (masked_fill writes the zeros, so a non-finite unit cannot turn the sum into NaN; None: no unit
        is bad). ``c`` ``[m, L]``: on tensor cores already rounded down to bf16 numbers, as one use's are."""
        x, y = self.x, self.y
        if bad is not None:  # y's rows are zeroed where the contraction reads them
            x = x.masked_fill(bad.view(1, -1, 1, 1), 0)
        self.x = self.y = None
        cg = torch.stack([c[:, j] for j in self.members])  # [k, m]
        return cx.clipped_contraction(x, y, cg, self.narrow, self.dtype or y.dtype, bad)


@dataclass
class _Bound:
    """One parameter's per-unit norm estimate and what bounds a unit's contribution (float64 ``[m]``):
    ``value`` the computed squared norm, ``err`` the bound on its rounding error (None: exact to
    2^-53), ``magnitude`` ``Σ_uses Σ_t |x_t||y_t|`` of its factored uses, ``length`` the longest
    contraction its clipped sum takes (m·T), ``u`` the unit roundoff, ``size`` the norm of its
    materialized part (None: none), ``operand`` the relative rounding of its clipped sum's operand
    entries (:data:`~userdp.engine.contraction.ROUNDED_OPERAND_U` for the rounded tensor-core operand, else 0:
    exact) and
    ``spread`` what that rounding is a share of: the terms of the uses whose operand is rounded, their
    :meth:`Factored.spread` summed (:func:`_spreads`; needed when ``operand`` is not 0)."""

    value: torch.Tensor
    err: torch.Tensor | None
    magnitude: torch.Tensor | None
    length: int
    u: float
    size: torch.Tensor | None
    operand: float = 0.0
    spread: list | None = None


_COEFFICIENTS: dict = {}


def _coefficients(values: tuple, device: torch.device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``values`` as a ``dtype`` (float64) tensor on ``device``, made once per distinct tuple (a
    chunk's shapes repeat step after step): no host-to-device copy in the step after the first."""
    key = (values, str(device), dtype)
    t = _COEFFICIENTS.get(key)
    if t is None:
        if (
            len(_COEFFICIENTS) > 512
        ):  # a run's chunk shapes repeat: a few dozen keys (the spreads add five per token count)
            _COEFFICIENTS.clear()
        t = _COEFFICIENTS[key] = torch.tensor(values, dtype=dtype, device=device)
    return t


def _bounded_norms(parts: list, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(estimate, upper)``, float64 ``[m, L]``: per unit and parameter the estimated norm and a
    proven upper bound on the norm of what the unit adds to the clipped sum at factor 1:
    ``sqrt(value + err)`` bounds the exact norm of the unit's gradient (built from the stored
    factors), and ``(gamma_K + 2u)(1 + r) · magnitude + r · spread + (gamma_m + u) · size`` bounds the
    rounding of the unit's own terms in the sum (a K-term contraction perturbs each term by at most
    gamma_K, and a rounded operand's terms are at most 1 + r times the exact ones; an operand entry
    rounded to bf16 moves by at most r = 2^-8 of itself, which moves the unit's sum by at most
    r · spread, :meth:`Factored.spread`).
    All parameters at once: a few kernels per chunk, not a few per parameter."""
    value = torch.stack([b.value for b in parts], dim=1).clamp(min=0)
    est = value.sqrt()
    if not BOUND:  # the estimate alone (tests only: shows what the bound closes)
        return est, est * (1.0 + 256 * 2.0**-23)
    zero = torch.zeros_like(parts[0].value)
    err = torch.stack([zero if b.err is None else b.err for b in parts], dim=1)
    mag = torch.stack([zero if b.magnitude is None else b.magnitude for b in parts], dim=1)
    size = torch.stack([zero if b.size is None else b.size for b in parts], dim=1)
    c_sum = _coefficients(
        tuple((gamma(b.length, b.u) + 2.0 * b.u) * (1.0 + b.operand) if b.length else 0.0 for b in parts), value.device
    )
    c_dense = _coefficients(tuple(gamma(m, b.u) + b.u for b in parts), value.device)
    # 2^-40: the float64 square root and sums; the rest is what the float32 arithmetic may move
    upper = (value + err).sqrt() * (1.0 + 2.0**-40) + mag * c_sum + size * c_dense
    if any(b.operand for b in parts):
        spread = _spreads([b.spread if b.operand else [] for b in parts], m).t()
        upper = upper + spread * _coefficients(tuple(b.operand for b in parts), value.device)
    return est, upper


#: layer types whose input autocast casts to its low-precision dtype before the layer's GEMM
#: (aten linear and addmm are on autocast's lower-precision list): their captured input is rounded
#: the same way, before the layer, so the ghost factors are the GEMM's own operands (see :func:`_captured`)
AUTOCAST_GEMM_LAYERS: set = {nn.Linear}


def _autocast_operand_dtype(mod: nn.Module, device: torch.device) -> torch.dtype | None:
    """The dtype autocast gives this layer's GEMM operands here (None: no autocast, or a layer
    whose op autocast leaves alone)."""
    if type(mod) not in AUTOCAST_GEMM_LAYERS:
        return None
    kind = device.type if device.type in ("cuda", "cpu", "xpu", "mps") else None
    if kind is None or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def _narrowable(a) -> bool:
    """A float32 tensor: what autocast casts to its low-precision dtype for a GEMM."""
    return isinstance(a, torch.Tensor) and a.dtype == torch.float32


def _captured(a):
    """A captured layer input, detached. Under autocast the forward's pre-hook has already cast a
    float32 input of a GEMM layer to autocast's dtype (float32 LayerNorm outputs feed GPT-2's
    ``c_attn``, ``c_fc`` and its tied head): the capture is the tensor the GEMM consumed and autograd
    keeps, so the norm, the clipped sum and autograd's own gradient see the same numbers, no second
    copy is held, and on tensor cores the contraction takes the bf16 path (float32 accumulation)."""
    return a.detach() if isinstance(a, torch.Tensor) else a


# --------------------------------------------------------------------------- the strategy
class _Capture:
    """A layer call seen in the forward: its module, its captured inputs, and where autograd will
    deliver its output's gradient: the output's gradient edge, not the output itself, so its storage
    is freed when the forward no longer needs it, as in a non-private step (the tied head's logits:
    1.5 GiB of bf16 at a 64-user gpt2-small chunk, held through the backward's peak before). None
    when the output does not require grad (the loss does not reach the layer's parameters there)."""

    __slots__ = ("edge", "inputs", "module")

    def __init__(self, module, inputs, output):
        self.module, self.inputs = module, inputs
        self.edge = get_gradient_edge(output) if output.requires_grad else None


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

    def __init__(self, model: nn.Module, loss_fn, algorithm, precision: Precision | None = None):
        lint_model(model)
        if algorithm.update != "gradient":
            raise GhostUnsupported(
                f"per_unit=ghost clips gradients; {type(algorithm).__name__}'s unit update is "
                f"{algorithm.update!r}: use training.per_unit: vmap (or auto)"
            )
        _register_transformers_layers()
        self.model, self.loss_fn, self.algorithm = model, loss_fn, algorithm
        self.precision = precision or Precision()
        self.names, self.params = trainable_parameters(model)
        self._index = {id(p): j for j, p in enumerate(self.params)}
        self._layers = [mod for mod in model.modules() if any(p.requires_grad for p in mod.parameters(recurse=False))]
        # (layer, attribute) -> the parameter's index: under FSDP2 the attribute holds a gathered tensor
        # while the module is unsharded (the root's stays so from its forward to its backward)
        self._owner = {
            (id(mod), n): self._index[id(p)]
            for mod in self._layers
            for n, p in mod.named_parameters(recurse=False)
            if id(p) in self._index
        }
        self.fallback_layers = sorted({type(mod).__name__ for mod in self._layers if type(mod) not in GHOST_LAYERS})
        self._verified = False
        self._mismatches = 0  # first-chunk checks whose sums differed from autograd's (_verify)
        # FSDP2 (engine.sharding): the parameters are DTensor shards and the forward uses the
        # unsharded tensors FSDP gathers, so the first-chunk check differentiates with respect to
        # those (what the hooks saw in use), not the shards (autograd gives None for those)
        self._sharded = is_sharded(self.params)
        self._in_use: list = []  # (module, name, tensor in use) while a checked forward runs
        # the parameters whose coverage is still to check (_verify): all on the first chunk; a sharded
        # rank checks them a group of at most 1/W of the model at a time (a whole batch gradient of
        # each in the group), so the check never holds the model's whole gradient
        self._unchecked: list[int] = list(range(len(self.params)))
        self._check_budget = (
            max(
                max(p.numel() for p in self.params),
                math.ceil(sum(p.numel() for p in self.params) / self.params[0].device_mesh.size()),
            )
            if self._sharded
            else None
        )
        self.last_choice: dict[str, str] = {}  # parameter -> "ghost" | "materialized" (last chunk)
        #: parameter -> for each dense (GEMM) use in the last chunk, whether it took the bf16 tensor-core path
        self.last_narrow: dict[str, list[bool]] = {}

    def _handler(self, mod) -> LayerHandler:
        return GHOST_LAYERS.get(type(mod), _per_unit_vjp)

    def _forward(self, flat: dict):
        """Forward with hooks: (per-unit losses [m] in the accumulation dtype, captures)."""
        captures: list[_Capture] = []
        device = self.params[0].device

        def hook(mod, args, out):
            if not isinstance(out, torch.Tensor):
                raise GhostUnsupported(
                    f"per_unit=ghost: layer {type(mod).__name__} returns {type(out).__name__}, "
                    "not a tensor: use training.per_unit: vmap"
                )
            captures.append(_Capture(mod, tuple(_captured(a) for a in args), out))
            if self._sharded and not self._verified:
                self._in_use.extend((mod, n, t) for n, t in mod.named_parameters(recurse=False) if t.requires_grad)

        def cast_first(mod, args):
            # a float32 input of an autocast GEMM layer is cast here, as autocast would cast it inside the
            # layer (the same rounding), so the layer's GEMM, autograd's saved operand and the capture
            # (the hook above sees these args) share one bf16 tensor
            cast = _autocast_operand_dtype(mod, device)
            if cast is None or not any(_narrowable(a) for a in args):
                return None
            return tuple(a.to(cast) if _narrowable(a) else a for a in args)

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
        formed, in the order of the parameters, one at a time (no stacked groups): a sharded step
        reduce-scatters it there, so no rank holds more than one parameter's whole sum at a time
        (:mod:`userdp.engine.sharding`). The returned sums are then None.

        Returns:
            (sums, norms, losses, bad) as :meth:`userdp.engine.per_unit.PerUnit.clipped_sum`.

        Raises:
            UserError: a layer whose input is not batch-first, or (first chunk) a parameter used
                outside the layers that own it.
        """
        clipping, clip_state, acc_dtype = clip.clipping, clip.state, clip.acc_dtype
        m, g_cap = mask.shape
        n = m * g_cap
        tc = cx.tensor_cores(self.params[0].device)
        flat = {k: v.reshape(n, *v.shape[2:]) for k, v in batch.items()}
        losses, captures = self._forward(flat)
        if losses.shape != (n,):
            raise UserError(f"loss_fn must return one loss per record (shape ({n},)), got {tuple(losses.shape)}")
        lm = losses.to(acc_dtype).reshape(m, g_cap)
        mk = mask.to(acc_dtype)
        unit_loss = (lm * mk).sum(1) / mk.sum(1).clamp(min=1.0)
        scale = self.precision.loss_scale
        outs = [c.edge for c in captures if c.edge is not None]
        # the first chunk (with a unit in it: a sharded rank's padding chunk proves nothing) checks coverage
        check = not self._verified and (not self._sharded or bool(weights.any()))
        group = self._check_group() if check else set()
        in_use = list({id(t): (mod, a, t) for mod, a, t in self._in_use}.values()) if check and self._sharded else []
        self._in_use = []
        in_use = [(mod, a, t) for mod, a, t in in_use if self._owner.get((id(mod), a)) in group]
        wrt = [t for _, _, t in in_use] if self._sharded else [self.params[j] for j in sorted(group)]
        grads = torch.autograd.grad(unit_loss.sum() * scale, outs + wrt, allow_unused=True)
        delivered, checked = iter(grads[: len(outs)]), grads[len(outs) :]
        out_grads = [None if c.edge is None else next(delivered) for c in captures]
        del delivered
        batch_grads: list = [None] * len(self.params)  # the checked group's batch gradients (on this rank)
        if self._sharded:  # each gathered tensor's gradient is its (sharded) parameter's batch gradient
            for (mod, attr, _), g in zip(in_use, checked, strict=True):
                j = self._owner[(id(mod), attr)]
                if g is not None:
                    batch_grads[j] = g if batch_grads[j] is None else batch_grads[j] + g
        else:
            for j, g in zip(sorted(group), checked, strict=True):
                batch_grads[j] = g
        del checked
        del grads  # each output's gradient is dropped once its layer's factors hold what they need
        # every contraction of norms and sums in IEEE float32, whatever the caller's TF32 setting
        with exact_float32():
            contrib: list[list] = [[] for _ in self.params]
            self.last_narrow = {}
            for i, cap in enumerate(captures):
                go, out_grads[i] = out_grads[i], None
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
                for attr, parts in self._handler(cap.module)(cap.module, cap.inputs, go, m, acc_dtype).items():
                    p = getattr(cap.module, attr)
                    if p is not None and p.requires_grad:
                        for part in parts:
                            if isinstance(part, Factored):
                                part.tc = tc
                                if not part.index:
                                    self.last_narrow.setdefault(self.names[self._index[id(p)]], []).append(part.narrow)
                        contrib[self._index[id(p)]].extend(parts)
            seen = [bool(parts) for parts in contrib]
            dense, factored = self._arrange(contrib, m, acc_dtype)
            # from here on only dense/factored hold the captured tensors: each parameter's are released
            # once its share of the sum is formed, so the sums do not pile up on top of every capture
            cap = go = None  # the loop variables above hold the last layer's tensors
            del captures, outs, out_grads, contrib, cap, go
            # same-shaped parameters are stacked, so their norms and sums take a few kernels per group,
            # not a few per parameter: small materialized-only ones (biases, LayerNorms, LoRA factors)
            # [m, k, size], and single-use dense ghosts (a block's c_fc, ...) by their factors
            # (a sink takes the sums one parameter at a time, in order: no groups)
            blocks = [
                (g, torch.stack([dense[j].reshape(m, -1) for j in g], dim=1))
                for g in (_vector_groups(dense, factored, m) if sink is None else [])
            ]
            stacks = [_FactorStack(g, factored) for g in (_factor_groups(dense, factored, m) if sink is None else [])]
            # per parameter: the estimate of each unit's squared norm and what bounds the unit's
            # contribution above it (float64 [m] each; see _bounded_norms)
            parts: list = [None] * len(self.params)
            u_dense = unit_roundoff(acc_dtype, False)
            for g, block in blocks:
                sq = block.pow(2).sum(2, dtype=torch.float64)  # [m, k]: squares summed in float64
                size = sq.sqrt()
                for i, j in enumerate(g):
                    parts[j] = _Bound(sq[:, i], None, None, 0, u_dense, size[:, i])
            for st in stacks:
                value, err, mag, spread = st.norm2()  # [k, m]
                k_len = m * int(st.y.shape[2])
                u = unit_roundoff(st.dtype or st.y.dtype, st.narrow)
                r = cx.operand_roundoff(st.narrow)
                for i, j in enumerate(st.members):
                    parts[j] = _Bound(value[i], err[i], mag[i], k_len, u, None, r, [spread[i]] if r else None)
            for j, (d, fs) in enumerate(zip(dense, factored, strict=True)):
                if parts[j] is None:
                    value, err, mag, spread = self._norm2(d, fs)
                    size = (
                        torch.linalg.vector_norm(d.reshape(m, -1), dim=1, dtype=torch.float64)
                        if d is not None
                        else None
                    )
                    k_len = max((m * x.tokens for x in fs), default=0)
                    u = max([x.u for x in fs] + [u_dense])
                    r = cx.ROUNDED_OPERAND_U if spread else 0.0
                    parts[j] = _Bound(value, err, mag, k_len, u, size, r, spread)
            est, upper = _bounded_norms(parts, m)
            del parts
            if check:
                self._verify(seen, dense, factored, batch_grads, scale, group)
            del batch_grads
            for g in [g for g, _ in blocks] + [st.members for st in stacks]:
                for j in g:  # the stacks hold these now
                    dense[j] = factored[j] = None
            # the clip factors come from the upper bounds (what a unit can add), the reported norms
            # from the estimates
            f, _ = clipping.factors_from_norms(upper, clip_state)
            _, norms = clipping.factors_from_norms(est, clip_state)
            norms = norms.to(acc_dtype)
            bad = ~torch.isfinite(norms) | ~torch.isfinite(f).all(1)
            c = round_down_to(torch.where(bad.unsqueeze(1), 0.0, f) * weights.to(f.dtype).unsqueeze(1), acc_dtype)
            zero = cx.must_zero(bad, clip.lazy_zeroing)
            # the tensor-core contractions' factors: bf16 numbers (<= c), rounded down once for the chunk
            c_narrow = cx.round_down_bf16(c).float() if tc else None
            sums: list = [None] * len(self.params)
            while blocks:
                g, block = blocks.pop()
                if zero:
                    block = block.masked_fill(bad.view(-1, 1, 1), 0)
                out = (block * torch.stack([c[:, j] for j in g], dim=1).unsqueeze(2)).sum(0)  # [k, n]
                for i, j in enumerate(g):
                    sums[j] = out[i].view(self.params[j].shape)
                del block, out
            while stacks:
                st = stacks.pop()
                out = st.weighted_sums(c_narrow if st.narrow else c, bad if zero else None)
                for i, j in enumerate(st.members):
                    sums[j] = out[i].to(c.dtype).view(self.params[j].shape)
                del st, out
            for j, p in enumerate(self.params):
                if sums[j] is not None:
                    continue
                d, fs = dense[j], factored[j]
                dense[j] = factored[j] = None
                if zero:
                    d = d.masked_fill(bad.view(-1, *([1] * (d.dim() - 1))), 0) if d is not None else None
                    fs = [x.zero_units(bad) for x in fs]
                # tensor cores: one bf16 factor (<= c) for all the parameter's parts
                cj = c_narrow[:, j] if any(x.narrow for x in fs) else c[:, j]
                sums[j] = _weighted_sum(d, fs, cj, p)
                del d, fs
                if sink is not None:
                    s, sums[j] = sums[j], None
                    sink(j, s)
                    del s
            return None if sink is not None else sums, torch.where(bad, 0.0, norms), unit_loss.detach(), bad

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

    @staticmethod
    def _norm2(d, fs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
        """``[m]`` each, float64: a parameter's squared per-unit norm from its materialized part and
        its uses, the bound on that value's rounding error, the magnitude of its factored uses
        (``Σ_uses Σ_t |x_t||y_t|``); and the spread terms of those whose clipped-sum operand is
        rounded (:meth:`Factored.spread_term`; empty: none is)."""
        value = err = mag = None  # the first term starts each sum: no zeros + add per parameter
        spread: list = []

        def add(acc, term):
            return term if acc is None else acc + term

        if d is not None:  # squares of float32 numbers summed in float64: exact to 2^-53 N, no bound needed
            value = d.reshape(d.shape[0], -1).pow(2).sum(1, dtype=torch.float64)
        # every use's own Gram first: their diagonals give each use's row norms, which the cross terms
        # below read; a cross term met first would take them from a pass of its own over the factors,
        # a float32 copy and square of the whole of a wide one (the tied head's 50,257-wide logit
        # gradient: 2 x 3.3 GB at a 64-user gpt2-small chunk, at the step's peak)
        for a in fs:
            v, e = _inner(a, a)
            ma, sma = a.magnitude()
            value, err, mag = add(value, v), add(err, e), add(mag, ma * sma)
            if a.rounds_operand:
                spread.append(a.spread_term())
        for i, a in enumerate(fs):
            for b in fs[i + 1 :]:
                v, e = _inner(a, b)
                value, err = value + 2.0 * v, err + 2.0 * e
            if d is not None:
                v, e = _inner_dense(a, d.reshape(d.shape[0], a.size_x, -1))
                value, err = value + 2.0 * v, err + 2.0 * e
        if err is None:
            err = torch.zeros_like(value)
            mag = torch.zeros_like(value)
        return value, err, mag, spread

    def _check_group(self) -> set:
        """The parameters this chunk's coverage check compares: every one still unchecked, or on a
        sharded rank the next of them up to :attr:`_check_budget` numbers (at least one)."""
        if self._check_budget is None:
            return set(self._unchecked)
        group, size = set(), 0
        for j in self._unchecked:
            n = self.params[j].numel()
            if group and size + n > self._check_budget:
                break
            group.add(j)
            size += n
        return group

    def _verify(self, seen, dense, factored, batch_grads, scale, group: set) -> None:
        """First chunks: every parameter the loss uses must be seen by a hook, and the units'
        gradients must add up to autograd's batch gradient (checked on the first chunk whose values
        are finite; ``group``: the parameters compared on this chunk, :meth:`_check_group`). A
        parameter used outside its layers' forward would otherwise be missing from its norms and from
        the sum alike: the sensitivity bound still holds for what is summed (both come from the same
        factors), but the update would silently lack that use. (A sharded run's later groups are
        compared on later chunks, maybe of later steps: a model that fails one trains those steps
        without that use, then stops with the error; its privacy is the same.)"""
        tol = self.precision.verify_tolerance
        complete = True
        for j, (name, p, d, fs, bg, used) in enumerate(
            zip(self.names, self.params, dense, factored, batch_grads, seen, strict=True)
        ):
            if not used and self._sharded:  # its gathered tensor was never seen: no gradient to compare
                raise GhostUnsupported(
                    f"sharding=fsdp: parameter {name!r} is trainable but not used through the "
                    "forward of a layer that owns it; freeze it (requires_grad=False) or use "
                    "sharding: none"
                )
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
            ours = _weighted_sum(d, fs, torch.ones(m_units, dtype=dt, device=p.device), p)
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
        if complete:
            self._unchecked = [j for j in self._unchecked if j not in group]
        self._verified = not self._unchecked
