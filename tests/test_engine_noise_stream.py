"""The noise is added to the clipped sums in place, streamed a piece at a time.

A model-sized noise buffer was the largest extra allocation of a DP step (0.5 GB for gpt2-small's
124M parameters in float32, 1 GB of float64 normals for the device generator). These tests check
that the streamed draw is the same draw whatever the piece size, that it adds rather than
overwrites, that it never holds more than a piece on the host, and that it refuses to add noise
below float32.
"""

import tracemalloc

import pytest
import torch

from userdp.engine import chacha
from userdp.engine import noise as noise_mod

SHAPES = [(3, 1000, 70), (17,), (0,), (5000, 51), (123_457,)]


def _tensors(wide=False):
    return [torch.zeros(s, dtype=torch.float64 if (wide and i == 1) else torch.float32) for i, s in enumerate(SHAPES)]


@pytest.mark.parametrize("wide", [False, True])
def test_host_draw_does_not_depend_on_the_piece_size(monkeypatch, wide):
    big = noise_mod.GaussianNoise(77, seeded=True).like(_tensors(wide), 1.5)
    monkeypatch.setattr(noise_mod, "_PIECE", 1000)  # pieces cut across tensors and stream blocks
    small = noise_mod.GaussianNoise(77, seeded=True).like(_tensors(wide), 1.5)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(big, small))
    assert [t.dtype for t in small][:2] == [torch.float32, torch.float64 if wide else torch.float32]
    assert float(torch.cat([t.double().flatten() for t in small]).std()) == pytest.approx(1.5, rel=0.01)


def test_device_generator_does_not_depend_on_the_slab_size(monkeypatch):
    big = chacha.ChaChaNoise(78, seeded=True).like(_tensors(True), 0.5)
    monkeypatch.setattr(chacha, "_SLAB_BLOCKS", 1001)  # many slabs, each cutting across tensors
    small = chacha.ChaChaNoise(78, seeded=True).like(_tensors(True), 0.5)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(big, small))


@pytest.mark.parametrize("source", [noise_mod.GaussianNoise, chacha.ChaChaNoise])
def test_add_adds_in_place(source):
    base = [torch.full(s, 3.0) for s in SHAPES]
    want = [t + 3.0 for t in source(5, seeded=True).like(base, 2.0)]
    out = source(5, seeded=True).add_(base, 2.0)
    assert all(o is b for o, b in zip(out, base))  # the caller's tensors, not copies
    assert all(torch.equal(b, w) for b, w in zip(base, want))


@pytest.mark.parametrize("source", [noise_mod.GaussianNoise, chacha.ChaChaNoise])
def test_noise_is_never_added_below_float32(source):
    with pytest.raises(ValueError, match="float32"):
        source(5, seeded=True).add_([torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)], 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        source(5, seeded=True).add_([torch.zeros(4, 6).t()], 1.0)


def test_the_host_draw_holds_a_piece_not_the_model(monkeypatch):
    monkeypatch.setattr(noise_mod, "_PIECE", 1 << 14)  # 64 KB per thread at most
    sums = [torch.zeros(1 << 21), torch.zeros(1 << 21)]  # 16 MB of float32 sums
    tracemalloc.start()  # numpy reports its buffers to tracemalloc
    try:
        noise_mod.GaussianNoise(9, seeded=True).add_(sums, 1.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, peak  # a flat draw of the sums would be 16 MB; 16 streams' pieces are ≤ 1 MB
    assert float(torch.cat(sums).std()) == pytest.approx(1.0, rel=0.01)


def test_the_mechanism_adds_nothing_without_a_source_or_noise():
    sums = [torch.ones(5)]
    noise_mod.IIDGaussian(None).add_noise(sums, 3.0)
    noise_mod.IIDGaussian(noise_mod.GaussianNoise(1, seeded=True)).add_noise(sums, 0.0)
    assert torch.equal(sums[0], torch.ones(5))
    noise_mod.IIDGaussian(noise_mod.GaussianNoise(1, seeded=True)).add_noise(sums, 3.0)
    assert not torch.equal(sums[0], torch.ones(5))
