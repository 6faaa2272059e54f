"""The noise is added to the clipped sums in place, streamed a piece at a time.

A model-sized noise buffer was the largest extra allocation of a DP step (0.5 GB for gpt2-small's
124M parameters in float32, 1 GB of float64 normals for the device generator). These tests check
that the streamed draw is the same draw whatever the piece size, that it adds rather than
overwrites, that it never holds more than a piece on the host, and that it refuses to add noise
below float32.
"""

import os
import threading
import tracemalloc

import numpy as np
import pytest
import torch

from userdp.engine.noise import aes, chacha
from userdp.engine.noise import gaussian as noise_mod
from userdp.engine.noise.gaussian import draw_dtype
from userdp.engine.noise.mechanism import IIDGaussian
from userdp.engine.performance import Performance
from userdp.errors import UserError

SHAPES = [(3, 1000, 70), (17,), (0,), (5000, 51), (123_457,)]


def _tensors(wide=False):
    return [torch.zeros(s, dtype=torch.float64 if (wide and i == 1) else torch.float32) for i, s in enumerate(SHAPES)]


@pytest.mark.parametrize("wide", [False, True])
def test_host_draw_does_not_depend_on_the_piece_size(monkeypatch, wide):
    big = noise_mod.GaussianNoise(77, seeded=True).like(_tensors(wide), 1.5)
    monkeypatch.setattr(noise_mod, "_PIECE", 1000)  # pieces cut across tensors and stream blocks
    small = noise_mod.GaussianNoise(77, seeded=True).like(_tensors(wide), 1.5)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(big, small, strict=True))
    assert [t.dtype for t in small][:2] == [torch.float32, torch.float64 if wide else torch.float32]
    assert float(torch.cat([t.double().flatten() for t in small]).std()) == pytest.approx(1.5, rel=0.01)


def test_device_generator_does_not_depend_on_the_slab_size(monkeypatch):
    big = chacha.ChaChaNoise(78, seeded=True).like(_tensors(True), 0.5)
    monkeypatch.setattr(chacha, "_SLAB_BLOCKS", 1001)  # many slabs, each cutting across tensors
    small = chacha.ChaChaNoise(78, seeded=True).like(_tensors(True), 0.5)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(big, small, strict=True))


@pytest.mark.parametrize("source", [noise_mod.GaussianNoise, chacha.ChaChaNoise])
def test_add_adds_in_place(source):
    base = [torch.full(s, 3.0) for s in SHAPES]
    want = [t + 3.0 for t in source(5, seeded=True).like(base, 2.0)]
    out = source(5, seeded=True).add_(base, 2.0)
    assert all(o is b for o, b in zip(out, base, strict=True))  # the caller's tensors, not copies
    assert all(torch.equal(b, w) for b, w in zip(base, want, strict=True))


@pytest.mark.parametrize("source", [noise_mod.GaussianNoise, chacha.ChaChaNoise])
def test_noise_is_never_added_below_float32(source):
    with pytest.raises(ValueError, match="float32"):
        source(5, seeded=True).add_([torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)], 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        source(5, seeded=True).add_([torch.zeros(4, 6).t()], 1.0)


def test_the_host_draw_holds_a_piece_not_the_model(monkeypatch):
    monkeypatch.setattr(noise_mod, "_PIECE", 1 << 14)  # 64 KB per thread at most
    sums = [torch.zeros(1 << 21), torch.zeros(1 << 21)]  # 16 MB of float32 sums
    source = noise_mod.GaussianNoise(9, seeded=True)
    source.add_([torch.zeros(1 << 20)], 1.0)  # the kernel compiled, each stream's word buffer made
    held = [s._held.nbytes for s in source._streams]
    tracemalloc.start()  # numpy reports its buffers to tracemalloc
    try:
        source.add_(sums, 1.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, peak  # a flat draw of the sums would be 16 MB; 16 streams' pieces are ≤ 1 MB
    # each stream keeps one buffer of words, a piece's (never the model's), whatever the draw: the
    # piece's normals, its margin for the wedges and the tail, and a cipher block either side
    piece = 4 * (aes._PIECE + aes._MARGIN + 2 * aes._WORDS)
    assert [s._held.nbytes for s in source._streams] == held and max(held) <= piece < 300 << 10, held
    assert float(torch.cat(sums).std()) == pytest.approx(1.0, rel=0.01)


def test_the_mechanism_adds_nothing_without_a_source_or_noise():
    sums = [torch.ones(5)]
    assert IIDGaussian(None).update(sums, None, 3.0) == (sums, None)
    IIDGaussian(noise_mod.GaussianNoise(1, seeded=True)).update(sums, None, 0.0)
    assert torch.equal(sums[0], torch.ones(5))
    got, state = IIDGaussian(noise_mod.GaussianNoise(1, seeded=True)).update(sums, None, 3.0)
    assert got is sums and state is None and not torch.equal(sums[0], torch.ones(5))


def _numel_dtypes(tensors):
    return sum(t.numel() for t in tensors), [t.dtype for t in tensors]


@pytest.mark.parametrize("wide", [False, True])
def test_a_draw_made_ahead_is_the_same_draw_and_is_used_once(monkeypatch, wide):
    """What the step adds and where the streams stand afterwards do not depend on whether the draw
    was begun while the sums were computed; the normals drawn ahead are used by one add only."""
    monkeypatch.setattr(noise_mod, "PREFETCH", "on")
    plain = noise_mod.GaussianNoise(31, seeded=True)
    ahead = noise_mod.GaussianNoise(31, seeded=True)
    assert ahead.prefetch(*_numel_dtypes(_tensors(wide)))
    assert ahead._pending is not None
    first = [plain.like(_tensors(wide), 0.7), ahead.like(_tensors(wide), 0.7)]
    assert ahead._pending is None  # consumed
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(*first, strict=True))
    second = [plain.like(_tensors(wide), 0.7), ahead.like(_tensors(wide), 0.7)]  # nothing pending: drawn anew
    assert all(torch.equal(a, b) for a, b in zip(*second, strict=True))
    assert not torch.equal(first[0][0], second[0][0])  # the next draw, not the one drawn ahead again
    assert plain.state_dict()["streams"] == ahead.state_dict()["streams"]


def test_a_draw_ahead_of_another_layout_is_dropped_never_reused(monkeypatch):
    monkeypatch.setattr(noise_mod, "PREFETCH", "on")
    numel, dtypes = _numel_dtypes(_tensors())
    ahead = noise_mod.GaussianNoise(32, seeded=True)
    ahead.prefetch(numel + 1, dtypes)  # not what the add receives
    got = ahead.like(_tensors(), 1.0)
    ref = noise_mod.GaussianNoise(32, seeded=True)
    dropped = ref.like([torch.zeros(numel + 1)], 1.0)  # the normals the prefetch drew
    want = ref.like(_tensors(), 1.0)  # the stream's next ones
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert not torch.equal(torch.cat([t.flatten() for t in got]), dropped[0][:numel])
    # a second prefetch replaces the first, whose normals are dropped too
    a, b = noise_mod.GaussianNoise(33, seeded=True), noise_mod.GaussianNoise(33, seeded=True)
    a.prefetch(numel, dtypes)
    a.prefetch(numel, dtypes)
    b.like(_tensors(), 1.0)
    assert all(torch.equal(x, y) for x, y in zip(a.like(_tensors(), 1.0), b.like(_tensors(), 1.0), strict=True))


def test_a_pending_draw_is_never_saved_or_kept_past_a_state(monkeypatch):
    monkeypatch.setattr(noise_mod, "PREFETCH", "on")
    numel, dtypes = _numel_dtypes(_tensors())
    src = noise_mod.GaussianNoise(34, seeded=True)
    start = src.state_dict()
    src.prefetch(numel, dtypes)
    saved = src.state_dict()  # a step that added no noise: its draw is dropped, the state saved past it
    assert src._pending is None
    ref = noise_mod.GaussianNoise(34, seeded=True)
    ref.like(_tensors(), 1.0)
    assert saved["streams"] == ref.state_dict()["streams"] != start["streams"]
    after = src.like(_tensors(), 1.0)  # never the dropped normals: the next ones
    assert all(torch.equal(a, b) for a, b in zip(after, ref.like(_tensors(), 1.0), strict=True))
    src.prefetch(numel, dtypes)
    src.load_state_dict(start)  # the pending normals came from the state now replaced
    assert src._pending is None
    fresh = noise_mod.GaussianNoise(34, seeded=True)
    assert all(torch.equal(a, b) for a, b in zip(src.like(_tensors(), 1.0), fresh.like(_tensors(), 1.0), strict=True))


def test_nothing_is_drawn_ahead_unless_asked_and_auto_waits_for_a_core_torch_leaves_idle(monkeypatch):
    src = noise_mod.GaussianNoise(35, seeded=True)
    big = noise_mod._PARALLEL_FROM
    assert noise_mod.PREFETCH == "off" or "USERDP_NOISE_PREFETCH" in os.environ  # the default: no extra thread
    monkeypatch.setattr(noise_mod, "PREFETCH", "off")
    monkeypatch.setattr(noise_mod, "_usable_cores", lambda: 8)
    assert not src.prefetch(big, [torch.float32])
    monkeypatch.setattr(noise_mod, "PREFETCH", "auto")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert not src.prefetch(big - 1, [torch.float32])  # small: drawn when added
    assert src.prefetch(big, [torch.float32])  # torch computes on 1 of 8 cores: one is idle
    src._drop_pending()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert not src.prefetch(big, [torch.float32])  # torch's threads take every core: none is idle
    monkeypatch.setattr(noise_mod, "PREFETCH", "yes")
    with pytest.raises(UserError, match="USERDP_NOISE_PREFETCH must be on, off or auto"):
        src.prefetch(big, [torch.float32])


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_a_draw_is_filled_on_no_more_threads_than_torch_may_use(monkeypatch, limit):
    """The noise follows torch's thread limit (a user who limits threads on a shared host limits the
    noise's), and the numbers do not depend on it."""
    seen: set[str] = set()
    real_fill = noise_mod.GaussianNoise.add_
    monkeypatch.setattr(noise_mod, "_PIECE", 1 << 14)
    original = noise_mod._for_each

    def watching(fn, items, parallel=True):
        def wrapped(item):
            seen.add(threading.current_thread().name)
            return fn(item)

        return original(wrapped, items, parallel)

    monkeypatch.setattr(noise_mod, "_for_each", watching)
    before = torch.get_num_threads()
    torch.set_num_threads(limit)
    try:
        assert noise_mod.noise_threads() == limit
        tensors = [torch.zeros(noise_mod._PARALLEL_FROM + 7)]
        real_fill(noise_mod.GaussianNoise(36, seeded=True), tensors, 1.0)
    finally:
        torch.set_num_threads(before)
    workers = {n for n in seen if n.startswith("userdp-noise")}
    assert len(workers) <= (limit if limit > 1 else 0)
    if limit == 1:
        assert seen == {threading.current_thread().name}  # one thread: the caller's own
    else:
        assert seen == workers  # the pool's threads alone
    ref = [torch.zeros(noise_mod._PARALLEL_FROM + 7)]
    noise_mod.GaussianNoise(36, seeded=True).add_(ref, 1.0)
    assert torch.equal(tensors[0], ref[0])


@pytest.mark.parametrize("own_loop", [False, True])
def test_a_seeded_run_is_the_same_with_its_noise_drawn_ahead(monkeypatch, own_loop):
    """train() and make_private() begin each step's draw while its sums are computed (where PREFETCH
    says so): the model, the metrics and the noise streams are those of drawing when the sums are ready."""
    import numpy as np

    from userdp.engine import SGD, ULS, FlatClip, TrainConfig, make_private, train

    from _engine_helpers import MLP, ce_loss, mlp_data

    data = mlp_data(np.random.default_rng(3).integers(1, 9, 60))
    cfg = TrainConfig(
        algorithm=ULS(group_size=3, sampling_rate=0.3),
        steps=4,
        clipping=FlatClip(0.5),
        optimizer=SGD(lr=0.2),
        noise_multiplier=1.3,
        delta=1e-4,
        seed=11,
        performance=Performance(chunk_size=4),
    )
    fills = []
    real_fill = noise_mod._fill
    monkeypatch.setattr(noise_mod, "_fill", lambda *a: fills.append(1) or real_fill(*a))
    out = {}
    for mode in ("off", "on"):
        monkeypatch.setattr(noise_mod, "PREFETCH", mode)
        torch.manual_seed(0)
        model = MLP()
        if own_loop:
            opt = torch.optim.SGD(model.parameters(), lr=0.2)
            with make_private(model, opt, data, ce_loss, cfg) as private:
                history = []
                for step in private:
                    opt.zero_grad()
                    history.append(step.backward())
                    opt.step()
        else:
            history = train(model, data, ce_loss, cfg).history
        out[mode] = ([p.detach().clone() for p in model.parameters()], [h["loss"] for h in history])
    assert len(fills) == 4 * noise_mod._STREAMS  # "on" drew every step ahead, "off" never
    assert all(torch.equal(a, b) for a, b in zip(out["off"][0], out["on"][0], strict=True))
    assert out["off"][1] == out["on"][1]


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize(  # the host draw's float32 sums take the compiled add, float64 torch's
    ("source", "wide"), [(noise_mod.GaussianNoise, False), (noise_mod.GaussianNoise, True), (chacha.ChaChaNoise, True)]
)
def test_a_draw_read_in_order_a_tensor_at_a_time_is_the_same_draw(monkeypatch, source, ahead, wide):
    """A sharded step reads the step's one draw a parameter at a time (``pieces`` through a
    ``DrawCursor``) to scatter each parameter's noise to its shards: the numbers are those ``add_``
    adds, rounded alike, and the generator stands where a whole draw leaves it."""
    from userdp.engine.noise.flat import DrawCursor

    monkeypatch.setattr(noise_mod, "_PIECE", 1000)  # pieces cut across tensors and stream blocks
    monkeypatch.setattr(chacha, "_SLAB_BLOCKS", 1001)
    monkeypatch.setattr(noise_mod, "PREFETCH", "on")
    whole, by_tensor = source(41, seeded=True), source(41, seeded=True)
    mech = IIDGaussian(by_tensor)
    tensors = _tensors(wide=wide)
    want = whole.like(tensors, 0.3)
    numel, dtypes = _numel_dtypes(tensors)
    if ahead and source is noise_mod.GaussianNoise:
        assert by_tensor.prefetch(numel, dtypes)  # drawn while the sums were computed: the same numbers
    cursor = DrawCursor(mech.draws(numel, dtypes, "cpu"))  # what a sharded step reads and scatters
    dt = draw_dtype(dtypes)  # read in the draw's dtype, scaled, then rounded as add_piece rounds it
    got = [cursor.take(t.numel(), dt, "cpu").mul_(0.3).to(t.dtype).view(t.shape) for t in tensors]
    cursor.finish()
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(want, got, strict=True))
    assert torch.equal(whole.like(tensors, 1.0)[0], by_tensor.like(tensors, 1.0)[0])  # the next draw, alike
    short = DrawCursor(mech.draws(numel, dtypes, "cpu"))
    short.take(numel - 1, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="not read to its end"):
        short.finish()


def test_the_compiled_add_is_torchs_multiply_then_add_bit_for_bit():
    """The host draw adds ``z · std`` to the sums in one compiled pass (add_kernel.scale_add); torch
    multiplies in float32, rounds, adds and rounds again. A fused multiply-add, or a product kept in
    float64, rounds once: on these numbers it differs from torch's in thousands of places, so the test
    can tell them apart; the kernel differs in none."""
    from userdp.engine.noise import add_kernel

    gen = torch.Generator().manual_seed(3)
    for std in (0.37, 0.1, 2.5e-3, 1234.5678):  # not 1.0: its products are exact, rounded or not
        dst = torch.randn(200_003, generator=gen) * 0.01
        z = torch.randn(200_003, generator=gen)
        want = dst.clone().add_(z.clone().mul_(std))
        got = dst.clone()
        add_kernel.scale_add(got.numpy(), z.numpy(), np.float32(std))
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        once = (dst.double() + z.double() * float(np.float32(std))).float()  # one rounding, as an FMA
        assert int((once != want).sum()) > 1000


def test_the_compiled_add_lands_where_torchs_does_and_leaves_the_normals_alone():
    """``add_scaled`` over tensors of mixed dtypes, pieces cutting across them: the same sums as
    ``add_piece`` of the scaled piece (torch's ops), and the piece of normals it read unchanged."""
    from userdp.engine.noise.flat import add_piece, add_scaled, flat_views

    gen = torch.Generator().manual_seed(4)
    shapes = [(70,), (3, 50), (1,), (400,)]
    for z_dtype in (torch.float32, torch.float64):
        tensors = [
            torch.randn(s, generator=gen, dtype=torch.float64 if i == 2 else torch.float32)
            for i, s in enumerate(shapes)
        ]
        ref = [t.clone() for t in tensors]
        flats, offsets = flat_views(tensors)
        ref_flats, _ = flat_views(ref)
        z = torch.randn(offsets[-1], generator=gen, dtype=z_dtype).numpy()
        kept = z.copy()
        for lo, hi in ((0, 33), (33, 71), (71, 260), (260, offsets[-1])):
            add_scaled(flats, offsets, z[lo:hi], 0.73, lo)
            add_piece(ref_flats, offsets, torch.from_numpy(z[lo:hi].copy()).mul_(0.73), lo)
        assert all(torch.equal(a, b) for a, b in zip(tensors, ref, strict=True))
        assert np.array_equal(z, kept)
