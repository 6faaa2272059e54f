"""What only a GPU can show (issue 27): skipped on a machine without CUDA, run by
``benchmarks/gpu/run.sh`` where there is one. Each has a CPU-side twin that runs everywhere
(tests/engine/test_tensor_cores.py, tests/engine/test_device_discipline.py, tests/engine/test_chacha.py)."""

import numpy as np
import pytest
import torch

from userdp.engine.clipping import StepClipping
from userdp.engine.performance import Performance

from _engine_helpers import bf16_lm_chunk

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu/run.sh)")

CUDA = torch.device("cuda") if torch.cuda.is_available() else None


def test_chacha_on_cuda_draws_the_cpu_keystream_and_compiles():
    from userdp.engine.noise.chacha import ChaChaNoise, chacha20_blocks, compile_kernel

    key, nonce = list(range(8)), [1, 2, 3]
    assert torch.equal(chacha20_blocks(key, nonce, 5, 64, CUDA).cpu(), chacha20_blocks(key, nonce, 5, 64, "cpu"))
    status = compile_kernel(CUDA)[1]
    assert status == "triton", status  # the hand-written kernel, held to NORMALS_ULPS by the check
    a = ChaChaNoise(7, seeded=True).like([torch.zeros(10_001, device=CUDA)], 1.0)[0].cpu()
    b = ChaChaNoise(7, seeded=True).like([torch.zeros(10_001)], 1.0)[0]
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # compiled vs eager transcendental functions


def test_the_triton_kernel_draws_the_cpu_keystream_and_normals():
    from userdp.engine.noise import chacha as CH
    from userdp.engine.noise import chacha_triton as T

    fixed = torch.tensor(
        [*CH._CONSTANTS, *[0xFFFFFFFF - i for i in range(8)], 0, 0xFFFFFFFF, 0x80000000, 2], dtype=torch.int64
    )
    for lo in (0, 2**32 - 100_000):
        ctr = torch.arange(lo, lo + 100_000, dtype=torch.int64)
        assert torch.equal(T.blocks(ctr.to(CUDA), fixed.to(CUDA)).cpu(), CH._words(ctr, fixed))
        got = T.slab(ctr.to(CUDA), fixed.to(CUDA)).cpu()
        assert float(CH.normals_error(got, CH._slab_eager(ctr, fixed))) <= CH.NORMALS_ULPS * 2.0**-52


def test_tensor_core_grams_and_sums_match_the_cpu_emulation():
    from userdp.engine.contraction import mm32, round_down_bf16, split_bf16

    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 256, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(4, 64, 96, generator=g).to(torch.bfloat16)
    got = mm32(a.to(CUDA), b.to(CUDA)).cpu()
    exact = a.double() @ b.double()
    bound = 64 * 2.0**-24 * (a.double().abs() @ b.double().abs())
    assert got.dtype == torch.float32 and bool(((got.double() - exact).abs() <= bound).all())
    c = round_down_bf16(torch.rand(4, generator=g)).to(CUDA)
    p = b.to(CUDA).float() * c.float().view(-1, 1, 1)
    hi, lo = split_bf16(p)
    assert torch.equal(hi.double() + lo.double(), p.double())


def test_a_bf16_ghost_step_on_cuda_stays_within_the_bound_and_matches_float32():
    from userdp.engine.algorithms import ULS
    from userdp.engine.clipping import FlatClip
    from userdp.engine.ghost import GhostPerUnit
    from userdp.engine.precision import Precision
    from userdp.lm import models
    from userdp.lm.models import causal_lm_loss

    torch.manual_seed(0)
    model = models.build_preset("tiny", vocab_size=50, n_positions=32).to(CUDA)
    ids = torch.randint(0, 50, (4, 2, 12), device=CUDA)
    batch, mask = {"input_ids": ids, "labels": ids.clone()}, torch.ones(4, 2, device=CUDA)
    clip = FlatClip(0.05)
    for u in range(4):
        w = torch.zeros(4, device=CUDA)
        w[u] = 1.0
        sums, norms, *_ = GhostPerUnit(model, causal_lm_loss, ULS(2, 0.5), Precision("bfloat16")).clipped_sum(
            batch, mask, w, StepClipping(clip, clip.initial_state(), torch.float32)
        )
        total = torch.sqrt(sum((s.double() ** 2).sum() for s in sums))
        assert float(norms[u]) > 0.05 and float(total) <= 0.05


def test_a_training_step_on_cuda_uses_fused_optimizers_and_records_its_kernels():
    from userdp.engine import ULS, Adam, TrainConfig, train
    from userdp.engine.user_data import TensorUserData
    from userdp.lm import models

    torch.manual_seed(0)
    model = models.build_preset("tiny", vocab_size=50, n_positions=32).to(CUDA)
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 50, (60, 12)))
    data = TensorUserData({"input_ids": ids, "labels": ids.clone()}, np.arange(0, 61, 3))
    cfg = TrainConfig(
        algorithm=ULS(2, 0.3),
        steps=2,
        noise_multiplier=1.0,
        delta=1e-5,
        optimizer=Adam(1e-3),
        performance=Performance(track_epsilon=False, precision="bfloat16", chunk_size=4),
    )
    rec = train(model, data, models.causal_lm_loss, cfg).record
    assert rec["per_unit"]["strategy"] == "ghost"
    assert rec["noise_kernel"] == "triton"
    assert "pinned off" in rec["precision"]["float32_contractions"]
    assert rec["noise_tail"]["delta"] < 1e-12


def test_the_fused_operand_kernel_is_taken_and_gives_the_torch_passes_operand(monkeypatch):
    """The one-pass [hi | lo] and rounded-operand kernel (engine/split_triton.py) against the torch passes, bit for bit,
    at the step's own sizes (a 64-user chunk's c_fc factor, a stack, the odd-width head stored
    with aligned rows), a bad unit holding Inf zeroed; and a ghost chunk's sums with it agree with
    the torch passes' (to float32 rounding only: the embedding's index_add_ sums in atomic order)."""
    from userdp.engine import contraction as C
    from userdp.engine.split_triton import scale_split
    from userdp.lm import models

    assert C.check_fused_operand(CUDA) is True
    g = torch.Generator(device=CUDA).manual_seed(0)
    for shape in ((64, 256, 3072), (4, 16, 64, 768), (8, 64, 50257)):
        y = C.aligned_rows(torch.randn(shape, generator=g, device=CUDA).to(torch.bfloat16))
        m = shape[-3]
        c = C.round_down_bf16(torch.rand(shape[:-2], generator=g, device=CUDA)).float()
        bad = torch.zeros(m, dtype=torch.bool, device=CUDA)
        bad[1] = True
        y[..., 1, 0, 0] = float("inf")
        wp = C.aligned_width(shape[-1])
        got = scale_split(y, c, bad, wp)
        assert got is not None and torch.equal(got.view(torch.int16), C.split_operand(y, c, bad, wp).view(torch.int16))
        got = scale_split(y, c, bad, wp, False)  # the rounded operand
        assert got is not None and torch.equal(
            got.view(torch.int16), C.rounded_operand(y, c, bad, wp).view(torch.int16)
        )
    torch.manual_seed(0)
    model = models.build_preset("tiny", vocab_size=1001, n_positions=32).to(CUDA).train()
    ids = torch.randint(0, 1001, (3, 2, 16), device=CUDA)
    out = {}
    for mode in ("off", "on"):
        monkeypatch.setattr(C, "FUSED_SPLIT", mode)
        out[mode] = bf16_lm_chunk(model, ids)[1][0]
    assert C.FUSED_CHECKED.get("cuda") is True
    for a, b in zip(out["off"], out["on"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_the_gram_and_layer_norm_kernels_pass_their_checks_and_give_the_torch_passes_norms(monkeypatch):
    """The Gram-pair reductions (engine/gram_triton.py) and a LayerNorm's per-unit gradients
    (engine/layer_norm_triton.py) pass their run-time checks here, at the step's own sizes too, and a
    ghost chunk's norms and sums with them agree with the torch passes' (float32 summation order)."""
    from userdp.engine import gram_triton
    from userdp.engine import layer_norm_grads as L
    from userdp.engine.ghost import grams as C
    from userdp.lm import models

    assert C.check_gram_kernel(CUDA) is True
    assert L.check_fused(CUDA) is True
    g = torch.Generator(device=CUDA).manual_seed(1)
    gx = torch.randn(64, 256, 256, generator=g, device=CUDA)
    gy = torch.randn(64, 256, 256, generator=g, device=CUDA)
    rb = torch.rand(64, 256, generator=g, device=CUDA)
    for a, b in zip(gram_triton.pair_rows(gx, gy, rb, rb, True), C.torch_pair_rows(gx, gy, rb, rb, True), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)
    torch.manual_seed(0)
    model = models.build_preset("tiny", vocab_size=1001, n_positions=64).to(CUDA).train()
    ids = torch.randint(0, 1001, (3, 2, 40), device=CUDA)
    out = {}
    for mode in ("off", "auto"):
        monkeypatch.setattr(C, "FUSED_GRAMS", mode)
        monkeypatch.setattr(L, "FUSED_LAYER_NORM", mode)
        out[mode] = bf16_lm_chunk(model, ids)[1]
    assert C.GRAMS_CHECKED.get("cuda") is True and L.FUSED_CHECKED.get("cuda") is True
    torch.testing.assert_close(out["off"][1], out["auto"][1], rtol=1e-5, atol=1e-7)
    for a, b in zip(out["off"][0], out["auto"][0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
