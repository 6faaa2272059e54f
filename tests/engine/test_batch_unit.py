"""per_unit: batch (engine/batch_unit.py): the non-private baseline's sum from one ordinary
backward equals what the per-unit strategies compute with nothing clipped, non-finite units
included; a clipping that could bind goes to the per-unit strategy; `auto` takes it for
nonprivate only; a private algorithm is refused with it."""

import math

import numpy as np
import pytest
import torch

from userdp.engine import ULS, Adam, FlatClip, NonPrivate, TensorUserData, TrainConfig, train
from userdp.engine.batch_unit import UNCLIPPED, BatchPerUnit
from userdp.engine.clipping import StepClipping
from userdp.engine.per_unit import make_per_unit, resolve_per_unit
from userdp.engine.performance import Performance
from userdp.errors import UserError

from _engine_helpers import MLP, ce_loss, mlp_data

SIZES = [1, 2, 3, 12, 1, 5, 8, 2, 1, 9, 4, 1, 3, 2, 7, 1] * 2


def _train(per_unit, clip=UNCLIPPED):
    torch.manual_seed(0)
    model = MLP().double()
    data = mlp_data(SIZES)
    data = TensorUserData({"x": data.tensors["x"].double(), "y": data.tensors["y"]}, data.offsets)
    cfg = TrainConfig(
        algorithm=NonPrivate(4, 0.5),
        steps=4,
        noise_multiplier=0.0,
        optimizer=Adam(1e-2),
        seed=5,
        clipping=FlatClip(clip),
        performance=Performance(chunk_size=3, per_unit=per_unit, track_epsilon=False),
    )
    res = train(model, data, ce_loss, cfg)
    return [p.detach().clone() for p in model.parameters()], res


def test_auto_takes_batch_for_the_baseline_and_ghost_for_a_private_run():
    assert resolve_per_unit("auto", NonPrivate(4, 0.5)) == "batch"
    assert resolve_per_unit("auto", ULS(4, 0.5)) == "ghost"
    _, res = _train("auto")
    assert res.record["per_unit"]["strategy"] == "batch"


def test_the_baseline_trains_the_same_model_as_the_per_unit_strategies():
    batch, _ = _train("batch")
    for other in ("vmap", "ghost"):
        ref, _ = _train(other)
        for a, b in zip(batch, ref, strict=True):  # same seed: same cohorts and records; float64 model
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_a_clip_that_could_bind_is_the_per_unit_strategys():
    # an engine caller may give the baseline a finite clip norm: the units are then clipped as before
    batch, res = _train("auto", clip=0.05)
    ref, _ = _train("ghost", clip=0.05)
    unclipped, _ = _train("ghost")
    for a, b in zip(batch, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(batch, unclipped, strict=True))  # the clip did bind
    assert res.record["per_unit"]["strategy"] == "batch"


def _chunk(poison):
    torch.manual_seed(1)
    model = MLP().double()
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.normal(size=(5, 3, 6)))
    y = torch.from_numpy(rng.integers(0, 3, (5, 3)))
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.float64)
    w = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    if poison == "loss":
        x[2, 0, 0] = math.nan  # unit 2's loss is NaN
    batch = {"x": x, "y": y}
    return model, batch, mask, w


def _sums(strategy, model, batch, mask, w, loss=ce_loss):
    s = make_per_unit(strategy, model, loss, NonPrivate(3, 0.5))
    state = {"clip_norm": UNCLIPPED}  # what a non-private run clips at: nothing
    return s.clipped_sum(batch, mask, w, StepClipping(FlatClip(UNCLIPPED), state, torch.float64))


@pytest.mark.parametrize("poison", [None, "loss"])
def test_a_chunk_equals_vmap_and_a_unit_with_a_nan_loss_is_zeroed(poison):
    model, batch, mask, w = _chunk(poison)
    sums, norms, losses, bad = _sums("batch", model, batch, mask, w)
    ref, _, ref_losses, ref_bad = _sums("vmap", model, batch, mask, w)
    assert bad.tolist() == ref_bad.tolist() == [False, False, poison == "loss", False, False]
    for a, b in zip(sums, ref, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    ok = ~bad
    torch.testing.assert_close(losses[ok], ref_losses[ok])
    if poison is None:
        assert (norms == 0).all()  # none computed; every unit counts as unclipped


class SqrtMLP(MLP):
    """MLP + sqrt(|h_0|): a finite loss whose gradient is not finite for a record with h_0 = 0."""

    def forward(self, x):
        h = self.net[0](x)
        return self.net[3](self.net[2](self.net[1](h))) + torch.sqrt(h[..., :1].abs())


def test_a_finite_loss_with_an_infinite_gradient_is_redone_per_unit():
    _, batch, mask, w = _chunk(None)
    torch.manual_seed(1)
    model = SqrtMLP().double()
    with torch.no_grad():
        model.net[0].bias[0] = 0.0
    batch["x"][1, 0] = 0.0  # unit 1's first record: h_0 = 0
    s = make_per_unit("batch", model, ce_loss, NonPrivate(3, 0.5))
    assert isinstance(s, BatchPerUnit)
    sums, _, losses, bad = s.clipped_sum(
        batch, mask, w, StepClipping(FlatClip(UNCLIPPED), {"clip_norm": UNCLIPPED}, torch.float64)
    )
    assert torch.isfinite(losses).all() and bad.tolist() == [False, True, False, False, False]
    ref, _, _, ref_bad = _sums("vmap", model, batch, mask, w)
    assert ref_bad.tolist() == bad.tolist()  # the unit at fault is zeroed, as vmap does
    for a, b in zip(sums, ref, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_private_algorithm_is_refused_with_batch():
    with pytest.raises(UserError, match="nonprivate only"):
        make_per_unit("batch", MLP(), ce_loss, ULS(4, 0.5))
    cfg = TrainConfig(
        algorithm=ULS(4, 0.5),
        steps=1,
        noise_multiplier=1.0,
        clipping=FlatClip(1.0),
        optimizer=Adam(1e-2),
        delta=1e-5,
        performance=Performance(per_unit="batch"),
    )
    with pytest.raises(UserError, match="per_unit: batch"):
        train(MLP(), mlp_data(SIZES), ce_loss, cfg)
