"""A parameter's squared per-unit norm from its factors' Gram matrices, with the bound on that
value's rounding error: one use with another (:func:`inner`), a use with the materialized part
(:func:`inner_dense`), and all of a parameter's uses together (:func:`parameter_norm2`)."""

from __future__ import annotations

import torch

from userdp.engine import contraction as cx
from userdp.engine.ghost.factors import Factored, root_slack_of
from userdp.engine.rounding import gamma


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


def y_gram(a: Factored, b: Factored) -> torch.Tensor:
    """``[m, Ta, Tb]``: the inner products of a's and b's y rows."""
    if a.narrow and b.narrow:
        return cx.mm32(a.y, b.y.transpose(1, 2))
    ay = a.fy()  # a use's own norm (b is a): one upcast, not two
    return torch.bmm(ay, (ay if b is a else b.fy()).transpose(1, 2))


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
    gx, gy = x_gram(a, b), y_gram(a, b)
    ta, tb = gy.shape[1:]
    u = max(a.u, b.u)
    gxn = 0.0 if (a.index or b.index) else gamma(int(a.x.shape[-1]), u)
    gyn = gamma(int(a.y.shape[-1]), u)
    spread_rows = b is a and a.rounds_operand  # |Gx|'s row sums for Factored.spread
    if b is a and a._rows is None:  # the rows' norms from the Grams' diagonals
        ry = torch.diagonal(gy, dim1=1, dim2=2).sqrt()
        rx = torch.ones_like(ry) if a.index else torch.diagonal(gx, dim1=1, dim2=2).sqrt()
        a._rows = (rx, ry, 1.0 if a.index else root_slack_of(gxn), root_slack_of(gyn))
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


def _dot_rows(ra: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``[m]``: ``Σ_t ra_t q_t`` (``ra``, ``q`` ``[m, Ta]`` non-negative: a quadratic form's row sums,
    :func:`~userdp.engine.contraction.gram_pair_rows`) as one batched product in ``q``'s dtype; with
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
    u = a.u
    gam = gamma(int(a.y.shape[-1]), u) + (0.0 if a.index else gamma(int(a.x.shape[-1]), u)) + 2.0 * u
    size = torch.linalg.vector_norm(mat.reshape(mat.shape[0], -1), dim=1, dtype=torch.float64)
    mag, smag = a.magnitude()
    return value, (gam * smag * (1.0 + 2.0**-20)) * mag * size


def parameter_norm2(d, fs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
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
        v, e = inner(a, a)
        ma, sma = a.magnitude()
        value, err, mag = add(value, v), add(err, e), add(mag, ma * sma)
        if a.rounds_operand:
            spread.append(a.spread_term())
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
