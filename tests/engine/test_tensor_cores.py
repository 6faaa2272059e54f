"""The ghost strategy's tensor-core path (issue 27, P1), proven on the CPU.

On CUDA, bf16 factors are contracted by one bf16 GEMM with float32 accumulation and output (aten
``mm.dtype``/``bmm.dtype``) instead of upcasting them first. Its arithmetic is emulated here
exactly (``TENSOR_CORES = "on"``: a product of two bf16 numbers is exact in float32, so the
emulation differs from the GPU only in the order of float32 sums):

* Gram matrices: bf16 x bf16 products are exact in float32 (checked in float64);
* the clip factor is rounded *down* to bf16, so the sensitivity can only shrink;
* ``c' y`` splits exactly into two bf16 pieces (hi + lo reconstructs it bit for bit), so
  ``xᵀ hi + xᵀ lo`` is the float32 clipped sum up to summation order;
* every unit's clipped contribution stays within C, and the result matches the float32 path.
"""

import sys

import numpy as np
import pytest
import torch
from _paths import REPO

import userdp.engine.contraction as contraction
from userdp.engine import rounding as rounding_mod
from userdp.engine.algorithms import ULS
from userdp.engine.clipping import FlatClip, PerLayerClip, StepClipping
from userdp.engine.contraction import mm32, round_down_bf16, split_bf16
from userdp.engine.ghost import GhostPerUnit
from userdp.engine.ghost import bound as ghost_bound
from userdp.engine.ghost import capture as ghost_capture
from userdp.engine.ghost import factors as ghost_factors
from userdp.engine.ghost import grams as ghost_grams
from userdp.engine.ghost import layers as ghost_layers
from userdp.engine.precision import Precision, _fp32_handles, exact_float32
from userdp.lm import models
from userdp.lm.models import causal_lm_loss

from _engine_helpers import WidestOutput, bf16_lm_chunk

sys.path.insert(0, str(REPO / "benchmarks"))
from _paths import TESTS
from bench_operand import bound_over_estimate  # noqa: E402

BF16 = torch.bfloat16


def _bf16(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(BF16)


def test_bf16_products_and_grams_are_exact_in_float32():
    a, b = _bf16(3, 40, 24, seed=1), _bf16(3, 24, 17, seed=2)
    prods = a.float().unsqueeze(3) * b.float().unsqueeze(1)  # every product, in float32
    assert torch.equal(prods.double(), a.double().unsqueeze(3) * b.double().unsqueeze(1))
    got = mm32(a, b)
    assert got.dtype == torch.float32
    exact = a.double() @ b.double()
    # float32 accumulation of K = 24 exact products: the standard bound K u sum |a_i b_i|, u = 2^-24
    absdot = a.double().abs() @ b.double().abs()
    assert bool(((got.double() - exact).abs() <= 24 * 2.0**-24 * absdot).all())
    assert torch.equal(got, a.float() @ b.float())  # the CPU emulation is the float32 Gram


def test_the_clip_factor_is_rounded_down_to_the_largest_bf16_below_it():
    c = torch.cat(
        [
            torch.rand(10_000, generator=torch.Generator().manual_seed(3)),
            torch.tensor([1.0, 0.5, 2.0**-20, 0.0, 1.0 - 2.0**-24]),
        ]
    )
    r = round_down_bf16(c)
    assert r.dtype == BF16
    assert bool((r.float() <= c).all())
    # the next bf16 number up is above c: nothing was given away
    up = (r.float().view(torch.int32) + 0x10000).view(torch.float32)
    assert bool((up > c).all())
    assert float(round_down_bf16(torch.tensor([1.0]))) == 1.0


@pytest.mark.parametrize("scale", [1.0, 1e-20, 1e20])
def test_c_times_y_splits_exactly_into_two_bf16_pieces(scale):
    y = _bf16(4, 64, 32, seed=4, scale=scale)
    c = round_down_bf16(torch.rand(4, generator=torch.Generator().manual_seed(5)))
    p = y.float() * c.float().view(-1, 1, 1)
    assert torch.equal(p.double(), y.double() * c.double().view(-1, 1, 1))  # the product is exact
    hi, lo = split_bf16(p)
    assert hi.dtype == lo.dtype == BF16
    assert torch.equal(hi.double() + lo.double(), p.double())  # bit for bit, checked in float64


def _tiny_gpt2():
    torch.manual_seed(0)
    return models.build_preset("tiny", vocab_size=50, n_positions=32)


def _chunk(m=4, G=2, L=12, seed=8):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (m, G, L), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}, torch.ones(m, G)


def _run(monkeypatch, mode, clip, w, model=None):
    monkeypatch.setattr(contraction, "TENSOR_CORES", mode)
    model = model or _tiny_gpt2()
    batch, mask = _chunk()
    return GhostPerUnit(model, causal_lm_loss, ULS(2, 0.5), Precision("bfloat16")).clipped_sum(
        batch, mask, w, StepClipping(clip, clip.initial_state(), torch.float32)
    )


@pytest.mark.parametrize("operand", ["split", "rounded"])
@pytest.mark.parametrize(
    "clip", [FlatClip(0.5), PerLayerClip(0.05), FlatClip(1e9)], ids=["flat", "per_layer", "unclipped"]
)
def test_tensor_core_sums_match_the_float32_path(monkeypatch, clip, operand):
    """Same norms bit for bit (Grams of bf16 factors are exact, summed in float32); sums within the
    bf16 rounding down of the clip factor (under 2^-7 relative a unit) of the float32 reference with
    the exact split operand; with the rounded one, also each entry's rounding (2^-8) and, for a
    clipped unit, the factor's bound raised by the spread (0.8-1.2% measured on this random-weight model)."""
    monkeypatch.setattr(contraction, "SUM_OPERAND", operand)
    w = torch.tensor([1.0, 0.5, 2.0, 1.0])
    ref = _run(monkeypatch, "off", clip, w)
    tc = _run(monkeypatch, "on", clip, w)
    assert torch.allclose(tc[1], ref[1], rtol=1e-5)
    num = torch.sqrt(sum(((a.double() - b.double()) ** 2).sum() for a, b in zip(tc[0], ref[0], strict=True)))
    den = torch.sqrt(sum((b.double() ** 2).sum() for b in ref[0]))
    clipped = clip.norm < 1e9
    tol = 2.0**-7 if operand == "split" else 2.0**-7 + 2.0**-8 + (0.015 if clipped else 0.0)
    assert float(num / den) < tol
    assert all(a.dtype == torch.float32 for a in tc[0])


@pytest.mark.parametrize("operand", ["split", "rounded"])
def test_each_units_tensor_core_contribution_is_within_the_bound(monkeypatch, operand):
    monkeypatch.setattr(contraction, "SUM_OPERAND", operand)
    clip = FlatClip(0.05)
    model = _tiny_gpt2()
    for u in range(4):
        w = torch.zeros(4)
        w[u] = 1.0
        sums, norms, *_ = _run(monkeypatch, "on", clip, w, model)
        total = torch.sqrt(sum((s.double() ** 2).sum() for s in sums))
        assert float(norms[u]) > 0.05 and float(total) <= 0.05


def test_the_float32_contractions_run_with_tf32_pinned_off(monkeypatch):
    """Whatever the caller set (HF's tf32=True sets these), the norms and sums see IEEE float32,
    and the caller's setting is back afterwards."""
    handles = _fp32_handles()
    assert handles, "this torch has per-backend fp32_precision"
    seen = []
    real = ghost_grams.inner

    def spy(a, b):
        seen.append([h.fp32_precision for h in handles])
        return real(a, b)

    monkeypatch.setattr(ghost_grams, "inner", spy)
    before = [h.fp32_precision for h in handles]
    try:
        for h in handles:
            h.fp32_precision = "tf32"
        _run(monkeypatch, "off", FlatClip(0.5), torch.ones(4))
        assert seen and all(v == "ieee" for row in seen for v in row)
        assert [h.fp32_precision for h in handles] == ["tf32"] * len(handles)
    finally:
        for h, v in zip(handles, before, strict=True):
            h.fp32_precision = v
    with exact_float32():
        assert all(h.fp32_precision == "ieee" for h in handles)
    assert [h.fp32_precision for h in handles] == before


def test_meta_runs_the_cuda_contractions():
    """aten mm.dtype / bmm.dtype (the CUDA path) exist on the meta device: shapes and dtypes."""
    a = torch.empty(3, 5, 7, dtype=BF16, device="meta")
    b = torch.empty(3, 7, 2, dtype=BF16, device="meta")
    out = mm32(a, b)
    assert out.device.type == "meta" and out.dtype == torch.float32 and out.shape == (3, 5, 2)
    assert mm32(a[0], b[0]).shape == (5, 2)
    np.testing.assert_equal(contraction.tensor_cores(torch.device("meta")), True)


def _narrow_flags(monkeypatch, lora: bool, capture_rounding: bool) -> tuple[list, dict]:
    monkeypatch.setattr(contraction, "TENSOR_CORES", "on")
    if not capture_rounding:  # the capture as it was before issue 35: float32 inputs kept float32
        monkeypatch.setattr(ghost_capture, "AUTOCAST_GEMM_LAYERS", set())
        monkeypatch.setattr(ghost_layers, "register_transformers_layers", lambda: None)
    torch.manual_seed(0)
    model = models.build_preset("tiny", vocab_size=256, n_positions=32).train()
    if lora:
        model = models.apply_lora(model, models.LoraSpec(rank=4, alpha=8.0))
    st, (sums, norms, _, bad) = bf16_lm_chunk(model, torch.randint(0, 256, (3, 2, 16)))
    assert not bad.any() and all(s.dtype == torch.float32 for s in sums)
    return st.names, st.last_narrow


def test_without_capture_rounding_the_layernorm_fed_gemms_fall_off_the_tensor_cores(monkeypatch):
    """What the test below guards against (the code before issue 35)."""
    ghost_layers.register_transformers_layers()
    _, narrow = _narrow_flags(monkeypatch, False, capture_rounding=False)
    slow = {n for n, flags in narrow.items() if not all(flags)}
    assert any(n.endswith("c_attn.weight") for n in slow) and any(n.endswith("c_fc.weight") for n in slow)
    assert "transformer.wte.weight" in slow


@pytest.mark.parametrize("lora", [False, True])
def test_under_bf16_autocast_every_weight_gemm_takes_the_tensor_core_path(monkeypatch, lora):
    """Issue 35: under bf16 autocast the LayerNorm-fed inputs of ``c_attn``, ``c_fc`` and the tied
    LM head are float32; autocast's GEMM consumed their bf16 rounding, so the ghost capture rounds
    them the same way and every weight's contraction is bf16 x bf16 on the tensor cores (before,
    those took float32 SIMT GEMMs: 71% of gpt2-small's clipped-sum FLOPs)."""
    names, narrow = _narrow_flags(monkeypatch, lora, capture_rounding=True)
    gemm_weights = [n for n in names if n.endswith("weight") and n in narrow]
    assert gemm_weights, "no GEMM use was seen"
    if not lora:
        for needed in ("attn.c_attn.weight", "mlp.c_fc.weight", "attn.c_proj.weight", "mlp.c_proj.weight"):
            assert any(n.endswith(needed) for n in gemm_weights), needed
        assert "transformer.wte.weight" in narrow, "the tied head's use of wte was not seen as a GEMM"
    else:
        assert any("lora_A" in n for n in gemm_weights) and any("lora_B" in n for n in gemm_weights)
    slow = {n: flags for n, flags in narrow.items() if not all(flags)}
    assert not slow, f"float32 (SIMT) contractions left: {sorted(slow)}"


def _leading_stride(t: torch.Tensor) -> int:
    """The GEMM's leading dimension of a 2-D/3-D operand: the stride that is not 1 of its last two."""
    s = t.stride()[-2:]
    return s[0] if s[1] == 1 else s[1]


def test_a_narrow_factor_of_odd_width_is_stored_with_aligned_rows(monkeypatch):
    monkeypatch.setattr(contraction, "TENSOR_CORES", "on")
    t = _bf16(3, 5, 67, seed=9)
    a = contraction.aligned_rows(t)
    assert a.shape == t.shape and torch.equal(a, t) and a.dtype == BF16
    assert a.stride(-2) % contraction.ALIGN_ELEMENTS == 0 and a.stride(-2) >= 67
    even = _bf16(3, 5, 64, seed=9)
    assert contraction.aligned_rows(even) is even  # already aligned: no copy
    monkeypatch.setattr(contraction, "TENSOR_CORES", "off")
    assert contraction.aligned_rows(t) is t  # off the tensor cores nothing is padded


def _contraction_case(monkeypatch, operand: str, wy: int):
    """A chunk's contraction on tensor cores with ``operand``: (m, t, wx, x, y, c, its sum, the exact
    float64 sum, the float64 sum of the terms' magnitudes)."""
    monkeypatch.setattr(contraction, "TENSOR_CORES", "on")
    monkeypatch.setattr(contraction, "SUM_OPERAND", operand)
    m, t, wx = 4, 9, 70
    x, y = _bf16(m, t, wx, seed=10), _bf16(m, t, wy, seed=11, scale=3.0)
    c = round_down_bf16(torch.rand(m, generator=torch.Generator().manual_seed(12)) + 0.1)
    got = contraction.clipped_contraction(x, y, c, True, torch.float32)
    exact = torch.einsum("mtx,mty->xy", x.double(), y.double() * c.double().view(m, 1, 1))
    absdot = torch.einsum("mtx,mty->xy", x.double().abs(), y.double().abs() * c.double().view(m, 1, 1))
    return m, t, wx, x, y, c, got, exact, absdot


@pytest.mark.parametrize("wy", [64, 67, 1001])
def test_the_fused_split_gives_the_old_split_sum(monkeypatch, wy):
    """[hi | lo] written in place (aligned halves) is the clipped sum of split_bf16 + cat, and within
    float32 accumulation of the exact (float64) sum."""
    m, t, wx, x, y, c, got, exact, absdot = _contraction_case(monkeypatch, "split", wy)
    hi, lo = split_bf16(y.float() * c.float().view(m, 1, 1))
    xt = x.reshape(m * t, wx).t()
    old = mm32(xt, torch.cat([hi, lo], dim=-1).reshape(m * t, 2 * wy))
    old = old[:, :wy] + old[:, wy:]
    assert got.shape == (wx, wy) and got.dtype == torch.float32
    bound = (2 * m * t + 2) * 2.0**-24 * absdot
    assert bool(((got.double() - exact).abs() <= bound).all())
    assert bool(((got.double() - old.double()).abs() <= 2 * bound).all())


@pytest.mark.parametrize("wy", [64, 67])
def test_the_rounded_operand_is_c_y_rounded_once_and_its_sum_within_its_bound(monkeypatch, wy):
    """SUM_OPERAND "rounded": the operand is c_u * y rounded to bf16 once (to nearest), the sum one
    GEMM on it, and every entry of the sum within (2^-8 + gamma_K (1 + 2^-8)) of its terms'
    magnitudes of the exact sum: the per-unit bound the clip factor is divided by."""
    m, t, wx, x, y, c, got, exact, absdot = _contraction_case(monkeypatch, "rounded", wy)
    once = (y.float() * c.float().view(m, 1, 1)).to(BF16)  # exact product, one rounding
    want = mm32(x.reshape(m * t, wx).t(), once.reshape(m * t, wy))
    assert got.shape == (wx, wy) and torch.equal(got, want)
    k = m * t
    g = k * 2.0**-23 / (1 - k * 2.0**-23)
    err = (got.double() - exact).abs()
    assert bool((err <= (2.0**-8 + g * (1 + 2.0**-8)) * absdot).all())
    assert float(err.max()) > 2.0**-20 * float(absdot.max())  # the rounding is there: not the split's sum


def _adversarial_contribution(monkeypatch, fold: bool) -> float:
    """One unit of 64 records with the same input (ones) and output gradients alternating +a and -b
    on every column, a and b chosen (by a search over the bf16 numbers in [1, 2)) so that at the
    clip factor they get, each c * y rounds away from the other's: the rounding errors add up over
    the records instead of cancelling. The norm of what the unit adds at the clip factor its bound
    gives (C = 1), with the rounded operand, its rounding folded into the bound or not."""
    monkeypatch.setattr(contraction, "TENSOR_CORES", "on")
    monkeypatch.setattr(contraction, "SUM_OPERAND", "rounded")
    if not fold:
        monkeypatch.setattr(contraction, "operand_roundoff", lambda narrow: 0.0)
    t, w = 64, 8
    y = torch.tensor([1.265625, -1.3046875] * (t // 2)).view(1, t, 1).repeat(1, 1, w).to(BF16)
    f = ghost_factors.Factored(torch.ones(1, t, w, dtype=BF16), y, w, dtype=torch.float32, tc=True)
    value, err = ghost_grams.inner(f, f)
    mag, smag = ghost_grams.magnitude(f)
    r = contraction.operand_roundoff(f.narrow)
    bound = ghost_bound.Bound(value, err, mag * smag, t, f.u, None, r, [ghost_grams.spread_term(f)] if r else None)
    _, upper = ghost_bound.bounded_norms([bound], 1)
    c = round_down_bf16((1.0 / upper[:, 0]).clamp(max=1.0).float())
    s = contraction.clipped_contraction(f.x, f.y, c, True, torch.float32)
    return float(torch.linalg.vector_norm(s.double()))


def test_the_spread_bounds_what_any_bounded_operand_error_can_add(monkeypatch):
    """grams.spread bounds ``‖Σ_t x_t ⊗ e_t‖`` for every ``|e_t| <= |y_t|``: it is at least
    ``‖X‖₂ ‖Y‖_F`` (computed exactly here) where that is below B, and at least what random-sign and
    aligned errors add; on rows that point apart it is well below B (the bound it tightens)."""
    monkeypatch.setattr(contraction, "TENSOR_CORES", "on")
    monkeypatch.setattr(contraction, "SUM_OPERAND", "rounded")
    m, t, wx, wy = 3, 32, 256, 48
    x, y = _bf16(m, t, wx, seed=21), _bf16(m, t, wy, seed=22)
    f = ghost_factors.Factored(x, y, wx, dtype=torch.float32, tc=True)
    ghost_grams.inner(f, f)
    spread = ghost_grams.spread(f)
    xd, yd = x.double(), y.double()
    b = (xd.norm(dim=2) * yd.norm(dim=2)).sum(1)
    spectral = torch.linalg.matrix_norm(xd, ord=2) * yd.reshape(m, -1).norm(dim=1)
    assert bool((spread >= torch.minimum(b, spectral)).all())
    assert bool((spread < 0.5 * b).all())  # independent rows: near sqrt(T) below B
    g = torch.Generator().manual_seed(23)
    for _ in range(20):
        e = yd.abs() * torch.sign(torch.randn(m, t, wy, generator=g, dtype=torch.float64))
        assert bool((torch.einsum("mtx,mty->mxy", xd, e).reshape(m, -1).norm(dim=1) <= spread).all())
    # errors aligned with X's top singular direction over tokens: the worst case the spectral term covers
    u = torch.linalg.svd(xd).U[:, :, :1]  # [m, T, 1]
    e = yd.abs() * torch.sign(u)
    assert bool((torch.einsum("mtx,mty->mxy", xd, e).reshape(m, -1).norm(dim=1) <= spread).all())


def _spread_by_hand(f) -> torch.Tensor:
    """grams.spread's formula for one use, written out (the reference for the batched form)."""
    mag, smag = ghost_grams.magnitude(f)
    b = mag.double() * (smag * (1.0 + 2.0**-40))
    if f._gx_rows is None:
        return b
    rx, ry, sx, sy = ghost_grams.row_norms(f)
    t = int(rx.shape[1])
    rxd = rx.double() * sx
    gxn = rounding_mod.gamma(int(f.x.shape[-1]), f.u)
    rows = f._gx_rows.double() * (1.0 + rounding_mod.gamma(t + 2, 2.0**-23)) + gxn * rxd * rxd.sum(1, keepdim=True)
    yf = (ry.double() * sy).pow(2).sum(1)
    return torch.minimum(b, (rows.amax(1) * yf).sqrt() * (1.0 + 2.0**-40))


def test_a_chunks_spreads_taken_together_are_each_uses_own(monkeypatch):
    """_spreads takes every rounded use's spread in a few batched kernels: per parameter it must be
    the sum of its uses' own spreads, whatever mix of token counts, widths and B-only uses (no Gram
    rows kept) the parameters hold, and 0 for a parameter with none; a stack's term split by
    member gives each member's own spread."""
    monkeypatch.setattr(contraction, "TENSOR_CORES", "on")
    monkeypatch.setattr(contraction, "SUM_OPERAND", "rounded")
    m = 3
    uses = []
    for i, (t, wx, wy, own_gram) in enumerate(
        [(8, 64, 16, True), (8, 32, 48, True), (5, 64, 8, True), (8, 16, 16, False)]
    ):
        f = ghost_factors.Factored(
            _bf16(m, t, wx, seed=40 + i), _bf16(m, t, wy, seed=50 + i), wx, dtype=torch.float32, tc=True
        )
        if own_gram:
            ghost_grams.inner(f, f)  # keeps the Gram's row sums
        uses.append(f)
    per_param = [
        [ghost_grams.spread_term(uses[0]), ghost_grams.spread_term(uses[3])],
        [],
        [ghost_grams.spread_term(uses[1]), ghost_grams.spread_term(uses[2])],
    ]
    got = ghost_factors.spreads(per_param, m)
    want = [
        _spread_by_hand(uses[0]) + _spread_by_hand(uses[3]),
        torch.zeros(m, dtype=torch.float64),
        _spread_by_hand(uses[1]) + _spread_by_hand(uses[2]),
    ]
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, rtol=1e-15, atol=0)
    assert bool((_spread_by_hand(uses[1]) < ghost_grams.magnitude(uses[1])[0].double()).all())  # not B alone
    # a stack of two members (2·m units of one use) split back: each member's own spread
    x = torch.cat([uses[0].x, uses[0].x.flip(0)])
    y = torch.cat([uses[0].y, uses[0].y.flip(0)])
    flat = ghost_factors.Factored(x, y, 64, dtype=torch.float32, tc=True)
    ghost_grams.inner(flat, flat)
    members = ghost_grams.spread_term(flat).split(2)
    both = ghost_factors.spreads([[members[0]], [members[1]]], m)
    assert torch.allclose(both[0], _spread_by_hand(uses[0]), rtol=1e-6)
    assert torch.allclose(both[1], _spread_by_hand(uses[0]).flip(0), rtol=1e-6)


def test_records_built_to_round_one_way_stay_within_c_with_the_rounded_operand(monkeypatch):
    """The rounded operand's bound has teeth: without the 2^-8 term the built unit adds 1.125 C;
    with it, at most C."""
    assert _adversarial_contribution(monkeypatch, fold=True) <= 1.0
    monkeypatch.undo()
    assert _adversarial_contribution(monkeypatch, fold=False) > 1.1


def test_the_rounded_operand_costs_the_clip_factor_more_than_the_split_one(monkeypatch):
    """What the rounded operand's bound costs an honest unit (a random-weight GPT-2, ULS, G = 4 x 32
    tokens, bf16): its flat bound over its estimate, against the split operand's (measured
    1.013-1.014 against 1.001; 1.036-1.038 with B in place of the spread). The rounded operand
    halves the clipped sum's FLOPs on a GPU; this is its price, which is why "split" stays the
    default until a GPU measures the other side."""
    torch.manual_seed(0)
    model = models.build_preset("tiny", vocab_size=512, n_positions=64)
    ids = torch.randint(0, 512, (4, 4, 32), generator=torch.Generator().manual_seed(8))
    ratio = {operand: bound_over_estimate(model, ids, operand) for operand in ("split", "rounded")}
    assert bool((ratio["split"] >= 1.0).all() and (ratio["split"] < 1.005).all()), ratio
    assert bool((ratio["rounded"] > ratio["split"] + 0.005).all() and (ratio["rounded"] < 1.03).all()), ratio


@pytest.mark.parametrize("zeroing", ["cpu", "device"])
def test_every_tensor_core_gemm_of_a_ghost_chunk_gets_aligned_operands(monkeypatch, zeroing):
    """An odd vocabulary (GPT-2's 50,257; here 1,001) made the tied head's Gram and clipped-sum GEMMs
    take operands with unaligned rows: on an H200 they ran on Turing-era kernels (17 ms of a 205 ms
    step). Every bf16 operand of every tensor-core GEMM now has a leading dimension that is a
    multiple of 8 elements (16 bytes), also where the bad units' rows are zeroed before the sum (on a
    device always, since reading whether any unit is bad would wait for it)."""
    monkeypatch.setattr(contraction, "TENSOR_CORES", "on")
    if zeroing == "device":
        monkeypatch.setattr(contraction, "must_zero", lambda bad, lazy=False: True)
    seen = []
    real = contraction.mm32

    def spy(a, b):
        if a.dtype == BF16 and min(a.shape[-2:]) > 1 and min(b.shape[-2:]) > 1:
            seen.append((tuple(a.shape), _leading_stride(a), tuple(b.shape), _leading_stride(b)))
        return real(a, b)

    monkeypatch.setattr(contraction, "mm32", spy)
    torch.manual_seed(0)
    model = models.build_preset("tiny", vocab_size=1001, n_positions=32).train()
    _, (sums, norms, _, bad) = bf16_lm_chunk(model, torch.randint(0, 1001, (3, 2, 16)))
    assert not bad.any() and all(torch.isfinite(s).all() for s in sums)
    wide = [s for s in seen if 1001 in s[0] or 1001 in s[2]]
    assert wide, "the head's GEMMs were not seen"
    unaligned = [s for s in seen if s[1] % 8 or s[3] % 8]
    assert not unaligned, unaligned


def test_the_tied_heads_cross_gram_gathers_before_it_upcasts(monkeypatch):
    """The embedding's one-hot rows against the tied head's logit gradient: the columns are gathered
    from the bf16 factor, then upcast (exact either way); the whole factor is never copied to
    float32 (3.3 GB at a 64-user gpt2-small chunk)."""
    monkeypatch.setattr(contraction, "TENSOR_CORES", "on")
    m, t, vocab = 3, 16, 1001
    ids = torch.randint(0, vocab, (m, t), generator=torch.Generator().manual_seed(1))
    emb = ghost_factors.Factored(ids, _bf16(m, t, 8, seed=2), vocab, index=True, dtype=torch.float32, tc=True)
    head = ghost_factors.Factored(
        _bf16(m, t, vocab, seed=3), _bf16(m, t, 8, seed=4), vocab, dtype=torch.float32, tc=True
    )

    with WidestOutput((torch.float32,)) as widest:
        g = ghost_grams.x_gram(emb, head)
    assert widest.widest < m * t * vocab  # no float32 copy of the head's factor
    ref = head.x.float()[torch.arange(m)[:, None, None], torch.arange(t)[None, None, :], ids[:, :, None]]
    assert g.dtype == torch.float32 and torch.equal(g, ref)
    assert torch.equal(ghost_grams.x_gram(head, emb), ref.transpose(1, 2))


def _interpreted(probe: str, timeout: int) -> list[str]:
    """The words ``probe`` (a script) prints, run in a process of its own under Triton's interpreter
    (the CUDA kernels' CPU stand-in); skipped where triton is not installed."""
    pytest.importorskip("triton", reason="the fused kernels' tests need triton (pip install -e '.[test]')")
    import os
    import subprocess
    import sys

    here = str(TESTS)  # the probes import _engine_helpers
    env = dict(
        os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    )
    res = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.split()


_FUSED_PROBE = r"""
import torch
from userdp.engine import contraction
from userdp.engine import split_triton as S
from userdp.engine.clipping import FlatClip
from userdp.lm import models
from _engine_helpers import bf16_lm_chunk

class OneBad(FlatClip):  # unit 1's clip factor is NaN: the run counts it bad and zeroes its rows
    def factors_from_norms(self, norms, state):
        f, n = super().factors_from_norms(norms, state)
        f = f.clone(); f[1] = float("nan")
        return f, n

contraction.TENSOR_CORES = "on"
contraction.must_zero = lambda bad, lazy=False: True  # as on a device: the bad units' rows are always zeroed
calls = []
real = S.scale_split
S.scale_split = lambda *a: calls.append(a[0].shape) or real(*a)
torch.manual_seed(0)
model = models.build_preset("tiny", vocab_size=1001, n_positions=32).train()
ids = torch.randint(0, 1001, (3, 2, 16))
same = []
for operand in ("split", "rounded"):
    contraction.SUM_OPERAND = operand
    out = {}
    for mode in ("off", "on"):
        contraction.FUSED_SPLIT = mode
        _, (sums, norms, _, bad) = bf16_lm_chunk(model, ids, OneBad(1.0))
        out[mode] = sums
    same.append(all(torch.equal(a, b) for a, b in zip(out["off"], out["on"])))
print(all(same), bad.tolist() == [False, True, False], contraction.FUSED_CHECKED.get("cpu"), len(calls))
"""


@pytest.mark.heavy(
    counterpart="tests/engine/test_tensor_cores.py::test_a_fused_operand_kernel_that_differs_is_not_used_and_is_warned_about"
)
def test_the_fused_operand_kernel_gives_the_torch_passes_sums_bit_for_bit():
    """The Triton kernel that builds the clipped sum's operand in one pass (engine/split_triton.py:
    [hi | lo], and the rounded operand), run by Triton's interpreter on the CPU inside a whole ghost
    chunk on tensor cores: its run-time check passes for both, it serves the narrow uses, and the
    chunk's clipped sums (a 1,001-token vocabulary: odd widths, aligned rows) equal the torch passes'
    bit for bit with either operand, with a bad unit zeroed as on a device."""
    same, one_bad, state, calls = _interpreted(_FUSED_PROBE, 300)
    assert one_bad == "True" and state == "True"
    assert int(calls) >= 8
    assert same == "True"


def test_a_fused_operand_kernel_that_differs_is_not_used_and_is_warned_about(monkeypatch):
    import types
    import warnings

    fake = types.ModuleType("userdp.engine.split_triton")

    def off_by_one_bit(y, c, bad, wp, split=True):  # the torch passes' buffer with one bit flipped
        buf = contraction.split_operand(y, c, bad, wp)
        flat = buf.view(torch.int16).view(-1)
        flat[3] ^= 1
        return buf

    fake.scale_split = off_by_one_bit
    monkeypatch.setattr(contraction, "split_triton", fake)
    monkeypatch.setattr(contraction, "FUSED_SPLIT", "on")
    monkeypatch.setattr(contraction, "FUSED_CHECKED", {})
    y, c = _bf16(2, 3, 37), round_down_bf16(torch.rand(2)).float()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert contraction.fused_operand(y, c, None, 40) is None
        assert contraction.fused_operand(y, c, None, 40) is None  # decided once
    assert len(caught) == 1 and "differs from torch's" in str(caught[0].message)
    monkeypatch.setattr(contraction, "split_triton", None)  # no triton (the CPU wheel of torch)
    monkeypatch.setattr(contraction, "NO_TRITON", "no triton: ModuleNotFoundError: No module named 'triton'")
    monkeypatch.setattr(contraction, "FUSED_CHECKED", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert contraction.fused_operand(y, c, None, 40) is None
    assert "no triton" in str(caught[0].message)
    monkeypatch.setattr(contraction, "FUSED_SPLIT", "auto")  # off CUDA, auto never tries it
    monkeypatch.setattr(contraction, "FUSED_CHECKED", {})
    assert contraction.fused_operand(y, c, None, 40) is None and contraction.FUSED_CHECKED == {}


_LN_PROBE = r"""
import torch
from userdp.engine import layer_norm_grads as L
from userdp.engine import layer_norm_triton as T
from userdp.engine.clipping import FlatClip
from userdp.lm import models
from _engine_helpers import bf16_lm_chunk

calls = []
real = T.unit_grads
T.unit_grads = lambda *a: calls.append(a[0].shape) or real(*a)
torch.manual_seed(0)
model = models.build_preset("tiny", vocab_size=1001, n_positions=48).train()
ids = torch.randint(0, 1001, (3, 2, 40))  # 80 tokens a unit: two blocks of the kernel's tokens
out = {}
for mode in ("off", "on"):
    L.FUSED_LAYER_NORM = mode
    _, (sums, norms, _, bad) = bf16_lm_chunk(model, ids, FlatClip(1e9))
    out[mode] = (sums, norms)
names = [n for n, _ in model.named_parameters()]
ln = [i for i, n in enumerate(names) if "ln" in n]
worst = max(float((out["on"][0][i] - out["off"][0][i]).abs().max() / out["off"][0][i].abs().max()) for i in ln)
rest = all(torch.equal(out["on"][0][i], out["off"][0][i]) for i in range(len(names)) if i not in ln)
print(L.FUSED_CHECKED.get("cpu"), len(calls), len(ln), worst < 1e-5, rest,
      bool(torch.allclose(out["on"][1], out["off"][1], rtol=1e-6)))
"""


@pytest.mark.heavy(
    counterpart="tests/engine/test_tensor_cores.py::test_a_layer_norm_kernel_that_differs_is_not_used_and_is_warned_about"
)
def test_the_fused_layer_norm_kernel_gives_the_torch_passes_gradients():
    """The Triton kernel for a LayerNorm's per-unit gradients (engine/layer_norm_triton.py), run by
    Triton's interpreter on the CPU inside a whole bf16 ghost chunk: its run-time check passes, it
    serves every LayerNorm, and the chunk's LayerNorm sums match the torch passes' to float32's
    summation order (the other sums and the norms unchanged)."""
    state, calls, n_ln, close, rest, norms = _interpreted(_LN_PROBE, 300)
    assert state == "True"
    assert int(n_ln) > 0 and int(calls) == int(n_ln) // 2 + 3  # each LayerNorm once (weight and bias together),
    # and the run-time check's three cases
    assert close == "True" and rest == "True" and norms == "True"


def test_a_layer_norm_kernel_that_differs_is_not_used_and_is_warned_about(monkeypatch):
    import types
    import warnings

    import userdp.engine.layer_norm_grads as L

    fake = types.ModuleType("userdp.engine.layer_norm_triton")

    def off(x, g, m, eps):  # the torch sums, one of them moved by 1%
        want = L.torch_grads(x, g, m, L.LayerNormSpec((x.shape[-1],), eps), torch.float32)
        w = want["weight"].clone()
        w[0, 0] *= 1.01
        return w, want["bias"]

    fake.unit_grads = off
    monkeypatch.setattr(L, "layer_norm_triton", fake)
    monkeypatch.setattr(L, "FUSED_LAYER_NORM", "on")
    monkeypatch.setattr(L, "FUSED_CHECKED", {})
    x, g = torch.randn(6, 8), torch.randn(6, 8)
    spec = L.LayerNormSpec((8,), 1e-5)
    ref = L.torch_grads(x, g, 2, spec, torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # decided once
            got = L.per_unit_grads(x, g, 2, spec, torch.float32)
            assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert len(caught) == 1 and "differ from torch's" in str(caught[0].message)
    monkeypatch.setattr(L, "layer_norm_triton", None)  # no triton (the CPU wheel of torch)
    monkeypatch.setattr(L, "NO_TRITON", "no triton: ModuleNotFoundError: No module named 'triton'")
    monkeypatch.setattr(L, "FUSED_CHECKED", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        L.per_unit_grads(x, g, 2, spec, torch.float32)
    assert "no triton" in str(caught[0].message)


_GRAM_PROBE = r"""
import torch
from userdp.engine import contraction
from userdp.engine import gram_triton as K
from userdp.engine.ghost import grams
from userdp.engine.clipping import FlatClip
from userdp.lm import models
from _engine_helpers import bf16_lm_chunk

contraction.TENSOR_CORES = "on"
contraction.SUM_OPERAND = "rounded"  # its spread needs the |Gx| row sums too
calls = []
real = K.pair_rows
K.pair_rows = lambda *a: calls.append(a[0].shape) or real(*a)
torch.manual_seed(0)
model = models.build_preset("tiny", vocab_size=1001, n_positions=48).train()
ids = torch.randint(0, 1001, (4, 2, 20))
clip = FlatClip(0.05)
out = {}
inside = True
for mode in ("off", "on"):
    grams.FUSED_GRAMS = mode
    run = lambda w: bf16_lm_chunk(model, ids, clip, w)[1]
    sums, norms, _, _ = run(torch.ones(4))
    out[mode] = (sums, norms)
    for u in range(4):  # each unit alone: within C whichever computed its bound
        w = torch.zeros(4); w[u] = 1.0
        s, *_ = run(w)
        inside = inside and float(torch.sqrt(sum((x.double() ** 2).sum() for x in s))) <= 0.05
same_norms = bool(torch.allclose(out["on"][1], out["off"][1], rtol=1e-5))
close = all(torch.allclose(a, b, rtol=1e-3, atol=1e-7) for a, b in zip(out["on"][0], out["off"][0]))
print(grams.GRAMS_CHECKED.get("cpu"), len(calls), same_norms, close, inside)
"""


@pytest.mark.heavy(
    counterpart="tests/engine/test_tensor_cores.py::test_a_gram_kernel_that_differs_is_not_used_and_is_warned_about"
)
def test_the_fused_gram_kernel_gives_the_torch_passes_norms_and_keeps_units_within_c():
    """The Triton kernel for a ghost norm's Gram-pair reductions (engine/gram_triton.py), run by
    Triton's interpreter on the CPU inside whole bf16 ghost chunks on tensor cores with the rounded
    operand: its run-time check passes, it serves the chunk's pairs, the norms equal the torch
    passes' to float32 summation order, and every unit alone adds at most C."""
    state, calls, same_norms, close, inside = _interpreted(_GRAM_PROBE, 600)
    assert state == "True"
    assert int(calls) >= 3 + 5 * 10  # the check's cases, and the chunks' pairs (10 dense ghost uses, 5 runs)
    assert same_norms == "True" and close == "True" and inside == "True"


def test_a_gram_kernel_that_differs_is_not_used_and_is_warned_about(monkeypatch):
    import types
    import warnings

    fake = types.ModuleType("userdp.engine.gram_triton")

    def low(gx, gy, rb_x, rb_y, row_sums):  # the torch row sums, one |Gy| form 0.1% low: a bound too small
        v, qy, qx, sx = ghost_grams.torch_pair_rows(gx, gy, rb_x, rb_y, row_sums)
        qy = qy.clone()
        qy[0, 0] *= 0.999
        return v, qy, qx, sx

    fake.pair_rows = low
    monkeypatch.setattr(ghost_grams, "gram_triton", fake)
    monkeypatch.setattr(ghost_grams, "FUSED_GRAMS", "on")
    monkeypatch.setattr(ghost_grams, "GRAMS_CHECKED", {})
    gx, gy = torch.randn(2, 4, 6), torch.randn(2, 4, 6)
    rb = torch.rand(2, 6)
    ref = ghost_grams.torch_pair_rows(gx, gy, rb, rb, True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # decided once
            got = ghost_grams.gram_pair_rows(gx, gy, rb, rb, True)
            assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert len(caught) == 1 and "|Gy| form differs from torch's" in str(caught[0].message)


def test_the_kernel_gate_reports_a_check_that_raises_and_asks_once():
    """A kernel whose check raises (a Triton build or launch failure) is not used: one warning names
    the error, the answer is kept for the device type, and "off" or "auto" off CUDA never asks."""
    import warnings

    from userdp.engine import kernel_gate

    asked = []

    def broken(device):
        asked.append(device.type)
        raise RuntimeError("no kernel image for this device")

    checked: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert kernel_gate.allowed("on", checked, torch.device("cpu"), broken, "the test kernel") is False
        assert kernel_gate.allowed("auto", {}, torch.device("cpu"), broken, "the test kernel") is False
        assert kernel_gate.allowed("off", {}, torch.device("cpu"), broken, "the test kernel") is False
    assert asked == ["cpu"] and checked == {"cpu": "RuntimeError: no kernel image for this device"}
    assert len(caught) == 1 and "the test kernel is not used on cpu (RuntimeError: no kernel image" in str(
        caught[0].message
    )


def test_the_gram_kernel_gate_holds_a_kernel_to_the_proofs_budget_not_twice_gamma_tb(monkeypatch):
    """The gate that lets a fused Gram-pair kernel replace torch's passes allows each row the
    rounding the norm bound's proof budgets, gamma_{Ta+Tb}; twice gamma_Tb (what the gate allowed
    before) is looser when Ta < Tb. A kernel off by 1.5 gamma_{Ta+Tb} of a row's absolute terms —
    inside the old slack, outside the proof's — is refused; one off by half of it passes."""
    import types

    def kernel_off_by(fraction):
        def pair_rows(gx, gy, rbx, rby, sums):
            m, ta, tb = gy.shape
            want = ghost_grams.torch_pair_rows(gx, gy, rbx, rby, sums)
            scales = ((gx * gy).abs().sum(-1), want[1], want[2], want[3])
            slack = fraction * ghost_grams.gram_row_budget(ta, tb)
            return tuple(None if w is None else w + slack * s for w, s in zip(want, scales, strict=True))

        return types.SimpleNamespace(pair_rows=pair_rows)

    assert 1.5 * ghost_grams.gram_row_budget(20, 300) < 2 * 300 * 2.0**-24  # the old slack let it through
    monkeypatch.setattr(ghost_grams, "gram_triton", kernel_off_by(1.5))
    verdict = ghost_grams.check_gram_kernel(torch.device("cpu"))
    assert isinstance(verdict, str) and "differs from torch's" in verdict
    monkeypatch.setattr(ghost_grams, "gram_triton", kernel_off_by(0.5))
    assert ghost_grams.check_gram_kernel(torch.device("cpu")) is True
