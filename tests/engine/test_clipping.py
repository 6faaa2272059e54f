"""Clipping primitives and strategies (SPEC §3.1, §3.9; acceptance tests 1 and 5)."""

import math

import numpy as np
import pytest
import torch

from userdp.engine.clipping import AdaptiveClip, FlatClip, PerLayerClip, per_tensor_norms, project
from userdp.errors import UserError


def _clipped(updates, f):
    return [u * f[:, j].view(-1, *([1] * (u.dim() - 1))) for j, u in enumerate(updates)]


def test_projection_bound_identity_and_zero():
    g = torch.Generator().manual_seed(0)
    for scale in [1e-3, 0.5, 3.0, 1e4]:
        x = torch.randn(50, generator=g) * scale
        y = project(x, 1.0)
        assert torch.linalg.vector_norm(y) <= 1.0 + 1e-6
        if torch.linalg.vector_norm(x) <= 1.0:
            assert torch.equal(y, x)
        else:
            assert torch.allclose(y / torch.linalg.vector_norm(y), x / torch.linalg.vector_norm(x), atol=1e-6)
    z = project(torch.zeros(7), 2.0)
    assert torch.equal(z, torch.zeros(7)) and not torch.isnan(z).any()


def test_flat_clip_bounds_each_unit_and_keeps_small_ones():
    g = torch.Generator().manual_seed(1)
    ups = [
        torch.randn(40, 5, 3, generator=g) * torch.logspace(-2, 2, 40).view(40, 1, 1),
        torch.randn(40, 4, generator=g),
    ]
    ups[0][0] = 0.0
    ups[1][0] = 0.0
    clip = FlatClip(2.0)
    f, norms = clip.factors(ups, clip.initial_state())
    out = _clipped(ups, f)
    tot = torch.sqrt(sum((o.reshape(40, -1) ** 2).sum(1) for o in out))
    assert (tot <= 2.0 + 1e-5).all()
    small = norms <= 2.0
    assert small.any() and (~small).any()
    assert torch.allclose(tot[small], norms[small], atol=1e-5)
    assert not torch.isnan(f).any()


def test_per_layer_default_bounds_and_total():
    clip = PerLayerClip(20.0)
    b = clip.bounds(11)
    assert b[0] == pytest.approx(20 / math.sqrt(11)) and round(b[0], 2) == 6.03  # SPEC §3.1 [S2]
    assert clip.total_bound(11) == pytest.approx(20.0)
    g = torch.Generator().manual_seed(2)
    ups = [torch.randn(30, 10, generator=g) * 50 for _ in range(11)]
    f, _ = clip.factors(ups, clip.initial_state())
    out = _clipped(ups, f)
    layer = per_tensor_norms(out)
    assert (layer <= torch.tensor(b) + 1e-4).all()
    assert (torch.sqrt((layer**2).sum(1)) <= 20.0 + 1e-4).all()
    with pytest.raises(UserError):
        PerLayerClip(1.0, layer_norms=(1.0, 2.0)).bounds(3)


def test_normalized_clipping_is_invariant_to_c_when_all_clipped():
    g = torch.Generator().manual_seed(3)
    ups = [torch.randn(16, 8, generator=g) * 100]
    outs = []
    for c in [0.1, 1.0, 7.0]:
        clip = FlatClip(c, normalized=True)
        assert clip.sensitivity(clip.initial_state()) == 1.0
        f, _ = clip.factors(ups, clip.initial_state())
        outs.append(_clipped(ups, f)[0])
        assert (torch.linalg.vector_norm(outs[-1], dim=1) <= 1 + 1e-5).all()
    assert torch.allclose(outs[0], outs[1], atol=1e-6) and torch.allclose(outs[1], outs[2], atol=1e-6)


def test_adaptive_a2_grows_tenfold_in_23_rounds_when_all_clipped():
    clip = AdaptiveClip(initial_norm=0.1, target_quantile=0.5, learning_rate=0.2)
    st = clip.initial_state()
    for r in range(1, 30):  # noqa: B007 - r is read after the loop (the round it stopped at)
        st = clip.update(st, 0.0)  # no update was unclipped
        if st["clip_norm"] >= 1.0 - 1e-12:
            break
    # ln(10)/(0.2*0.5) = 23.03 rounds per factor 10 (SPEC §3.9 A2): 23 rounds give 9.97x, 24 give > 10x
    assert r == 24
    assert st["clip_norm"] / 0.1 == pytest.approx(math.exp(0.1 * 24))


@pytest.mark.parametrize("gamma,lo,hi", [(0.5, 28.0, 40.0), (0.75, 40.0, 48.0)])
def test_adaptive_quantile_toy_fig1(gamma, lo, hi):
    """X uniform on {15,25,28,40,45,48}: the median loss is minimized on [28,40]; gamma=0.75 near 45."""
    xs = np.array([15, 25, 28, 40, 45, 48.0])
    clip = AdaptiveClip(initial_norm=1.0, target_quantile=gamma, learning_rate=0.05)
    st = clip.initial_state()
    trace = []
    for _ in range(3000):
        st = clip.update(st, float((xs <= st["clip_norm"]).mean()))
        trace.append(st["clip_norm"])
    tail = np.array(trace[-500:])
    assert lo * 0.95 <= np.median(tail) <= hi * 1.05


def test_adaptive_validation():
    with pytest.raises(UserError):
        AdaptiveClip(target_quantile=1.0)
    with pytest.raises(UserError):
        AdaptiveClip(initial_norm=0)
    with pytest.raises(UserError):
        FlatClip(-1.0)
    assert AdaptiveClip().resolved_count_stddev(100) == 5.0
