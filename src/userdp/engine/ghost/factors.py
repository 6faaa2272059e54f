"""A parameter's use in a chunk, kept as its two factors (:class:`Factored`: unit u's gradient is
``Σ_t x[u,t] ⊗ y[u,t]``) with its rounding constants (:attr:`Factored.gamma_x`, ...), the captured
tensors laid out by unit (:func:`by_units`), and the spread terms the proven bound reads
(:class:`SpreadTerm`, :func:`spreads`; :mod:`~userdp.engine.ghost.grams` computes them).
The package docstring (:mod:`userdp.engine.ghost`) gives the method."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from userdp.engine import contraction as cx
from userdp.engine.rounding import gamma, root_slack, unit_roundoff
from userdp.errors import UserError


class GhostUnsupported(UserError):
    """The model cannot be served by ghost norms (a layer that is not batch-first, an input broadcast
    over the batch, a parameter used outside its layers): ``per_unit: auto`` then uses vmap."""


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
    #: cached upper bounds on the rows' norms and on the magnitude
    #: (:func:`~userdp.engine.ghost.grams.row_norms`, :func:`~userdp.engine.ghost.grams.magnitude`)
    _rows: tuple | None = field(default=None, repr=False, compare=False)
    _mag: tuple[torch.Tensor, float] | None = field(default=None, repr=False, compare=False)
    #: ``Σ_s |Ĝx_ts|`` ``[m, T]``, kept from the use's own Gram where the rounded operand needs it
    #: (:func:`~userdp.engine.ghost.grams.spread_term`)
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
        bound takes in through its spread (:func:`~userdp.engine.ghost.grams.spread`); an embedding's sum is exact."""
        return not self.index and cx.operand_roundoff(self.narrow) > 0

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.dtype or self.y.dtype

    @property
    def u(self) -> float:
        """The unit roundoff of this use's contractions (:func:`~userdp.engine.rounding.unit_roundoff`)."""
        return unit_roundoff(self.compute_dtype, self.narrow)

    @property
    def gamma_x(self) -> float:
        """gamma_X of a product over this use's x rows at its own unit roundoff (width X); 0 for
        one-hot rows, whose products are exact."""
        return 0.0 if self.index else gamma(int(self.x.shape[-1]), self.u)

    @property
    def gamma_y(self) -> float:
        """gamma_Y of a product over this use's y rows at its own unit roundoff (width Y)."""
        return gamma(int(self.y.shape[-1]), self.u)

    @property
    def row_slack(self) -> tuple[float, float]:
        """``(sx, sy)``: the factors by which the rows' norms, computed in one pass over the factors
        in float32, may be low (gamma_n of the squares, the root; a one-hot row's norm is 1, exactly)."""
        sy = root_slack(int(self.y.shape[-1]) + 1, 2.0**-23)
        return (1.0 if self.index else root_slack(int(self.x.shape[-1]) + 1, 2.0**-23)), sy

    @property
    def token_slack(self) -> float:
        """The factor a T-term float32 sum of this use's per-token products may be low by."""
        return 1.0 + gamma(self.tokens + 2, 2.0**-23)

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
class SpreadTerm:
    """One rounded use's share of its parameter's spread (:func:`~userdp.engine.ghost.grams.spread`): ``mag`` ``[m]``
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

    def split(self, k: int) -> list[SpreadTerm]:
        """A stack's term (``k·m`` units: k members of m) as each member's, by views."""

        def part(t, i):
            return None if t is None else t.view(k, -1, *t.shape[1:])[i]

        return [
            SpreadTerm(
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


def spreads(per_param: list[list[SpreadTerm]], m: int) -> torch.Tensor:
    """``[P, m]`` float64: per parameter, the sum of its terms' spreads (:func:`~userdp.engine.ghost.grams.spread`),
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
            return coefficients(tuple(values), device).view(-1, 1)

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
        index = coefficients(tuple(j for j, _ in members), device, torch.long)
        out.index_add_(0, index, val)
    return out


_COEFFICIENTS: dict = {}


def coefficients(values: tuple, device: torch.device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
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


#: keep bf16/fp16 captures narrow in Factored (upcast at each use); False upcasts at capture
#: (the reference the tests compare with: the results are bit-identical)
KEEP_NARROW = True


def by_units(t: torch.Tensor, m: int, n: int, dtype: torch.dtype, what: str, *, store: bool = False) -> torch.Tensor:
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
