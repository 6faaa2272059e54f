"""The Gram stage: a parameter's squared per-unit norm from its factors' Gram matrices, with the bound
on that value's rounding error, computed here from the factors and their rounding constants: one use
with another (:func:`inner`), a use with the materialized part (:func:`inner_dense`), all of a
parameter's uses together (:func:`parameter_norm2`); the rows' norms, magnitudes and spreads the bound
reads (:func:`row_norms`, :func:`magnitude`, :func:`spread_term`); and the Gram pairs' row sums
(:func:`gram_pair_rows`: torch's passes, or one Triton kernel once it has passed its gate)."""

from __future__ import annotations

import torch

from userdp.engine import contraction as cx
from userdp.engine import kernel_gate
from userdp.engine.ghost.bound import Bound
from userdp.engine.ghost.factors import Factored, SpreadTerm, spreads
from userdp.engine.rounding import gamma, root_slack_of

NO_TRITON: str | None = None  # why the Gram-pair kernel cannot be imported here
try:  # written in Triton, which CUDA builds of torch bring (the CPU wheel does not)
    from userdp.engine import gram_triton
except Exception as exc:  # noqa: BLE001 - a missing or broken triton: the gate's warning says why
    gram_triton = None  # type: ignore[assignment]
    NO_TRITON = f"no triton: {type(exc).__name__}: {str(exc)[:120]}"

#: where a ghost norm's Gram-pair reductions (:func:`gram_pair_rows`) run as one Triton kernel
#: (:mod:`userdp.engine.gram_triton`): "auto" on CUDA, "off" never, "on" on any device (tests, under
#: Triton's interpreter); used once it has matched the torch passes (checked once per process).
FUSED_GRAMS = "auto"
GRAMS_CHECKED: dict = {}  # device type -> True, or why the kernel is not used


def x_gram(a: Factored, b: Factored) -> torch.Tensor:
    """``[m, Ta, Tb]``: the inner products of a's and b's x rows."""
    if a.index and b.index:
        return (a.x.unsqueeze(2) == b.x.unsqueeze(1)).to(a.compute_dtype)
    if a.index:  # one-hot row ids_t against dense rows: b.x[u, s, ids_t], gathered before the upcast (exact
        # either way; upcasting first copied the whole factor: the tied head's 50,257-wide logit gradient)
        picked = torch.gather(b.x, 2, a.x.unsqueeze(1).expand(-1, b.x.shape[1], -1))
        return picked.to(b.compute_dtype).transpose(1, 2)
    if b.index:
        return x_gram(b, a).transpose(1, 2)
    if a.narrow and b.narrow:  # bf16 x bf16 is exact in float32: tensor cores, float32 accumulation
        return cx.mm32(a.x, b.x.transpose(1, 2))
    ax = a.fx()
    return torch.bmm(ax, (ax if b is a else b.fx()).transpose(1, 2))


def inner(a: Factored, b: Factored) -> tuple[torch.Tensor, torch.Tensor]:
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
    gx = x_gram(a, b)
    if a.narrow and b.narrow:  # the y rows' Gram, as x_gram's (a use's own: one upcast, not two)
        gy = cx.mm32(a.y, b.y.transpose(1, 2))
    else:
        ay = a.fy()
        gy = torch.bmm(ay, (ay if b is a else b.fy()).transpose(1, 2))
    ta, tb = gy.shape[1:]
    # the pair's rounding constants (Python floats: no kernel), at the wider of the two roundoffs
    u = max(a.u, b.u)
    gxn = 0.0 if (a.index or b.index) else gamma(int(a.x.shape[-1]), u)
    gyn = gamma(int(a.y.shape[-1]), u)
    g_rows = gamma(ta + tb, u)
    gq = (1.0 + gamma(ta + tb + 2, 2.0**-23)) * (1.0 + 2.0**-20)
    spread_rows = b is a and a.rounds_operand  # |Gx|'s row sums for the spread (spread_term)
    if b is a and a._rows is None:  # the rows' norms from the Grams' diagonals
        ry = torch.diagonal(gy, dim1=1, dim2=2).sqrt()
        rx = torch.ones_like(ry) if a.index else torch.diagonal(gx, dim1=1, dim2=2).sqrt()
        a._rows = (rx, ry, 1.0 if a.index else root_slack_of(gxn), root_slack_of(gyn))
    rxa, rya, sxa, sya = row_norms(a)
    rxb, ryb, sxb, syb = row_norms(b)
    # Σ_ts Gx⊙Gy in two levels: a sum per row (tb terms), then the rows (ta terms), so each term is
    # rounded at most ta + tb times: gamma_{ta+tb} Σ|Gx||Gy| <= gamma (1 + gamma_X) rxᵀ|Gy|rx; the two
    # quadratic forms likewise, per row then over rows (one Triton pass over the Grams on CUDA)
    rows, qy_rows, qx_rows, gx_rows = gram_pair_rows(gx, gy, rxb, ryb, spread_rows)
    del gx, gy
    if spread_rows:
        a._gx_rows = gx_rows
    value = rows.sum(1)
    qy = _dot_rows(rxa, qy_rows)  # rxᵀ|Gy|rx, low by at most the rows' factors and gq
    qx = _dot_rows(rya, qx_rows)  # ryᵀ|Gx|ry
    ma, sma = magnitude(a)
    mb, smb = (ma, sma) if b is a else magnitude(b)
    # every term is non-negative: each coefficient carries the factors its computed terms may be low
    # by, and 2^-20 covers the float rounding of these three operations
    c_qx = gyn * gq * sya * syb
    c_qy = (gxn + g_rows * (1.0 + gxn)) * gq * sxa * sxb
    c_b = (gxn * gyn + 2.0 * u) * sma * smb * (1.0 + 2.0**-20)
    err = torch.addcmul(torch.add(qx * c_qx, qy, alpha=c_qy), ma, mb, value=c_b)
    return value, err


def _dot_rows(ra: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``[m]``: ``Σ_t ra_t q_t`` (``ra``, ``q`` ``[m, Ta]`` non-negative: a quadratic form's row sums,
    :func:`gram_pair_rows`) as one batched product in ``q``'s dtype; with
    the rows' own sums the form is low by at most gamma_{Ta+Tb+2} relative (the caller adds it)."""
    return torch.bmm(ra.to(q.dtype).unsqueeze(1), q.unsqueeze(2)).view(-1)


def inner_dense(a: Factored, mat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``([m], [m])``: ``<Σ_t a.x_t ⊗ a.y_t, M_u>`` for materialized ``M [m, X, Y]``
    (``Σ_t x_tᵀ M y_t``), and the bound on its rounding error, ``(gamma_Y + gamma_X + u) B |M|``."""
    my = torch.bmm(a.fy(), mat.transpose(1, 2))  # [m, T, X]
    if a.index:
        value = torch.gather(my, 2, a.x.unsqueeze(2)).sum(dim=(1, 2), dtype=torch.float64)
    else:
        value = (a.fx() * my).sum(dim=(1, 2), dtype=torch.float64)
    gam = a.gamma_y + a.gamma_x + 2.0 * a.u
    size = torch.linalg.vector_norm(mat.reshape(mat.shape[0], -1), dim=1, dtype=torch.float64)
    mag, smag = magnitude(a)
    return value, (gam * smag * (1.0 + 2.0**-20)) * mag * size


def parameter_norm2(d, fs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """``[m]`` each, float64: a parameter's squared per-unit norm from its materialized part and
    its uses, the bound on that value's rounding error, the magnitude of its factored uses
    (``Σ_uses Σ_t |x_t||y_t|``); and the spread terms of those whose clipped-sum operand is
    rounded (:func:`spread_term`; empty: none is)."""
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
        v, e = inner(a, a)
        ma, sma = magnitude(a)
        value, err, mag = add(value, v), add(err, e), add(mag, ma * sma)
        if a.rounds_operand:
            spread.append(spread_term(a))
    for i, a in enumerate(fs):
        assert value is not None and err is not None  # the loop above set them
        for b in fs[i + 1 :]:
            v, e = inner(a, b)
            value, err = value + 2.0 * v, err + 2.0 * e
        if d is not None:
            v, e = inner_dense(a, d.reshape(d.shape[0], a.size_x, -1))
            value, err = value + 2.0 * v, err + 2.0 * e
    assert value is not None, "a parameter's norm needs a materialized part or a use"
    if err is None or mag is None:
        err = torch.zeros_like(value)
        mag = torch.zeros_like(value)
    return value, err, mag, spread


def parameter_bound(d, fs, m: int, u_dense: float) -> Bound:
    """A parameter's norm and what bounds a unit's contribution to its sum (:class:`Bound`) from its
    materialized part ``d`` (``[m, ...]`` or None) and its factored uses ``fs``
    (:func:`parameter_norm2`): the clipped sum's longest contraction is m·T terms of a use, at the
    widest unit roundoff among its uses and the materialized part's ``u_dense``."""
    value, err, mag, spread = parameter_norm2(d, fs)
    size = torch.linalg.vector_norm(d.reshape(m, -1), dim=1, dtype=torch.float64) if d is not None else None
    k_len = max((m * x.tokens for x in fs), default=0)
    u = max([x.u for x in fs] + [u_dense])
    r = cx.ROUNDED_OPERAND_U if spread else 0.0
    return Bound(value, err, mag, k_len, u, size, r, spread)


def row_norms(a: Factored) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """``(rx, ry, sx, sy)``: the rows' computed norms ``[m, T]`` in the Grams' dtype and the factors
    by which they may be low: ``|x_t| <= sx rx_t``, ``|y_t| <= sy ry_t`` (a one-hot row has norm 1).
    Taken from the diagonals of the use's own Gram matrices when :func:`inner` formed them (no
    extra pass over the factors), else from one pass (:attr:`Factored.row_slack`); the factors cover
    the rounding of the squared norms (gamma_n relative: the terms are squares) and of the root.
    Python floats, so applying them costs no kernel. Kept on the use."""
    if a._rows is None:
        y = a.fy()
        sx, sy = a.row_slack
        ry = (y * y).sum(-1).sqrt()
        if a.index:
            rx = torch.ones_like(ry)
        else:
            x = a.fx()
            rx = (x * x).sum(-1).sqrt()
        a._rows = (rx, ry, sx, sy)
    return a._rows


def magnitude(a: Factored) -> tuple[torch.Tensor, float]:
    """``(B, s)``: ``Σ_t |x_t| |y_t| <= s B`` per unit (``[m]``), which bounds the Frobenius norm
    of every partial sum of the unit's per-token terms: the scale of every rounding error in its
    norm and its sum. One batched dot; ``s`` covers the rows' factors and its own rounding. Kept on
    the use."""
    if a._mag is None:
        rx, ry, sx, sy = row_norms(a)
        a._mag = (torch.bmm(rx.unsqueeze(1), ry.unsqueeze(2)).view(-1), sx * sy * a.token_slack)
    return a._mag


def spread_term(a: Factored) -> SpreadTerm:
    """What :func:`spread` is computed from: the use's magnitude, rows' norms and, after its own Gram
    (:func:`inner`), the row sums of ``|Gx|`` (None: B alone)."""
    mag, smag = magnitude(a)
    rx, ry, sx, sy = row_norms(a)
    return SpreadTerm(mag, smag, rx, ry, sx, sy, a._gx_rows, a.gamma_x)


def spread(a: Factored) -> torch.Tensor:
    """``[m]`` float64: an upper bound on ``‖Σ_t x_t ⊗ e_t‖`` per unit for any ``e_t`` with
    ``|e_t| <= |y_t|`` elementwise: the scale of the rounded operand's error (which is at most
    2^-8 · c_u · |y_t| an entry). It is ``‖X‖₂ ‖E‖_F <= ‖X‖₂ ‖Y‖_F`` with ``‖X‖₂² = λ_max(Gx)``
    bounded by Gershgorin (the largest row sum of ``|Gx|``, from the computed Gram plus its
    rounding, gamma_X |x_t||x_s| an entry), or ``B = Σ_t |x_t||y_t|`` (Cauchy-Schwarz on each
    token) where that is smaller: up to sqrt(T) below B when the unit's inputs point apart.
    Every computed term is inflated by the factor it may be low by. (:func:`~userdp.engine.ghost.factors.spreads`
    computes a chunk's spreads together, from :func:`spread_term`.)"""
    return spreads([[spread_term(a)]], int(a.y.shape[0]))[0]


def gram_pair_rows(gx: torch.Tensor, gy: torch.Tensor, rb_x: torch.Tensor, rb_y: torch.Tensor, row_sums: bool) -> tuple:
    """``(v, qy, qx, sx)`` ``[m, Ta]``, per row t of a Gram pair ``[m, Ta, Tb]``: ``Σ_s Gx_ts Gy_ts``,
    ``Σ_s |Gy_ts| rb_x_s``, ``Σ_s |Gx_ts| rb_y_s`` and (``row_sums``; else None) ``Σ_s |Gx_ts|``, in the
    Grams' dtype: what a ghost norm and its rounding bound are summed from
    (:func:`inner`). One Triton kernel where :data:`FUSED_GRAMS` allows it and it
    has matched :func:`torch_pair_rows` on this device type; else torch's passes. Any order of
    these sums is covered by the bound (each term moves through fewer additions than it has terms)."""
    if gx.dtype == torch.float32 and _grams_kernel_allowed(gx.device):
        got = gram_triton.pair_rows(gx.contiguous(), gy.contiguous(), rb_x, rb_y, row_sums)
        if got is not None:
            return got
    return torch_pair_rows(gx, gy, rb_x, rb_y, row_sums)


def torch_pair_rows(
    gx: torch.Tensor, gy: torch.Tensor, rb_x: torch.Tensor, rb_y: torch.Tensor, row_sums: bool
) -> tuple:
    """:func:`gram_pair_rows` by torch's passes: a batched dot per row, the absolute Grams and two
    batched products with the row vectors."""
    m, ta, tb = gy.shape
    v = torch.bmm(gx.reshape(m * ta, 1, tb), gy.reshape(m * ta, tb, 1)).view(m, ta)
    gx_abs = gx.abs()
    qy = torch.bmm(gy.abs(), rb_x.to(gy.dtype).unsqueeze(2)).view(m, ta)
    qx = torch.bmm(gx_abs, rb_y.to(gx.dtype).unsqueeze(2)).view(m, ta)
    return v, qy, qx, (gx_abs.sum(-1) if row_sums else None)


def _grams_kernel_allowed(device: torch.device) -> bool:
    return kernel_gate.allowed(FUSED_GRAMS, GRAMS_CHECKED, device, check_gram_kernel, "the fused Gram-pair kernel")


def gram_row_budget(ta: int, tb: int) -> float:
    """gamma_{Ta+Tb} = n u / (1 - n u) for n = Ta + Tb and float32's unit roundoff u = 2^-24: the
    relative rounding the proven norm bound budgets for one row of a Gram pair's sums."""
    return gamma(ta + tb, 2.0**-24)


def check_gram_kernel(device: torch.device) -> bool | str:
    """True when the Triton kernel's row sums match :func:`torch_pair_rows`' on test Grams (entries
    of both signs, several row and column blocks, a cross pair of two token counts, with and without
    the row sums), each within the rounding budget the norm bound's proof allows a row,
    gamma_{Ta+Tb} of the row's absolute terms in float32 (twice gamma_Tb, the rounding either
    side may carry, is looser when Ta < Tb: the gate holds a kernel to the proof's budget, not to
    what the difference of two roundings could reach); else why not."""
    if gram_triton is None:
        return NO_TRITON
    g = torch.Generator().manual_seed(0)
    for m, ta, tb, sums in ((3, 20, 300, True), (2, 7, 5, False), (4, 33, 256, True)):
        gx = (torch.randn(m, ta, tb, generator=g) * 4).to(device)
        gy = (torch.randn(m, ta, tb, generator=g) * 0.25).to(device)
        rbx = torch.rand(m, tb, generator=g).to(device)
        rby = torch.rand(m, tb, generator=g).to(device)
        got = gram_triton.pair_rows(gx, gy, rbx, rby, sums)
        if got is None:
            return f"it refused Grams of shape {(m, ta, tb)}"
        want = torch_pair_rows(gx, gy, rbx, rby, sums)
        slack = gram_row_budget(ta, tb)
        scales = ((gx * gy).abs().sum(-1), want[1], want[2], want[3])
        for name, a, b, scale in zip(("dot", "|Gy| form", "|Gx| form", "|Gx| row sum"), got, want, scales, strict=True):
            if (a is None) != (b is None):
                return f"its {name} is {'missing' if a is None else 'extra'}"
            if a is not None and not bool(((a - b).abs() <= slack * scale + 1e-30).all()):
                return f"its {name} differs from torch's on {(m, ta, tb)}"
    return True
