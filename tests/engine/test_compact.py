"""ULS chunks without their padding slots (engine.user_data.compact_groups): the same clipped sums for
less work.

A ULS unit is a user with up to G records; a user with fewer records is padded to G with masked
slots, which the per-unit strategies computed in full (a third of the slots on blogs at G = 16).
The loop now sorts a step's users by record count and trims each chunk's group axis.
"""

import pytest
import torch

from userdp.engine import ULS, Adam, FedAvg, FlatClip, TensorUserData, TrainConfig, train
from userdp.engine.performance import Performance
from userdp.engine.run import cohort
from userdp.engine.user_data import compact_groups

from _engine_helpers import MLP, ce_loss, mlp_data

SIZES = [1, 2, 3, 12, 1, 5, 8, 2, 1, 9, 4, 1, 3, 2, 7, 1] * 3


def test_real_records_move_first_and_the_axis_is_cut_to_the_largest_count():
    x = torch.arange(3 * 8).reshape(3, 8, 1)
    mask = torch.zeros(3, 8)
    mask[0, [1, 5]] = 1
    mask[1, 0] = 1
    mask[2, [2, 3, 7]] = 1
    batch, m = compact_groups({"x": x}, mask)
    assert m.shape == (3, 3) and batch["x"].shape == (3, 3, 1)  # 3 real at most -> 3 slots
    assert batch["x"][0, :2, 0].tolist() == [1, 5] and batch["x"][1, 0, 0] == 8
    assert batch["x"][2, :3, 0].tolist() == [18, 19, 23]  # in their order
    assert m.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]


def test_nothing_to_trim_returns_the_same_objects():
    x, mask = {"x": torch.zeros(2, 4, 3)}, torch.ones(2, 4)
    assert compact_groups(x, mask) == (x, mask)
    mask[1, 3] = 0  # 4 real at most: still 4 slots
    assert compact_groups(x, mask)[1] is mask
    x6, m6 = {"x": torch.zeros(2, 6)}, torch.tensor([[1.0] * 5 + [0.0], [1.0] * 2 + [0.0] * 4])
    assert compact_groups(x6, m6)[1].shape == (2, 5)


def _run(per_unit, monkeypatch, trim, algorithm=None):
    torch.manual_seed(0)
    model = MLP().double()
    widths = []
    if not trim:
        monkeypatch.setattr(cohort, "compact_groups", lambda b, m: (b, m))
    real = cohort.Chunks.load

    def spy(self, cid, step):
        out = real(self, cid, step)
        widths.append(out[1].shape[-1])
        return out

    monkeypatch.setattr(cohort.Chunks, "load", spy)
    cfg = TrainConfig(
        algorithm=algorithm or ULS(8, 0.5),
        steps=3,
        noise_multiplier=1.0,
        clipping=FlatClip(0.5),
        optimizer=Adam(1e-2),
        seed=11,
        delta=1e-5,
        performance=Performance(chunk_size=4, per_unit=per_unit, track_epsilon=False),
    )
    data = mlp_data(SIZES)
    train(model, TensorUserData({"x": data.tensors["x"].double(), "y": data.tensors["y"]}, data.offsets), ce_loss, cfg)
    monkeypatch.undo()
    return [p.detach().clone() for p in model.parameters()], widths


@pytest.mark.parametrize("per_unit", ["ghost", "vmap"])
def test_trimmed_chunks_train_the_same_model(monkeypatch, per_unit):
    full, w_full = _run(per_unit, monkeypatch, trim=False)
    trimmed, w_trim = _run(per_unit, monkeypatch, trim=True)
    assert set(w_full) == {8}
    assert min(w_trim) <= 2 and max(w_trim) <= 8  # the short users' chunks are trimmed
    assert sum(w_trim) < 0.7 * sum(w_full)
    for a, b in zip(full, trimmed, strict=True):  # same seed: same cohorts, records and noise; float64 model
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_fedavg_is_not_trimmed(monkeypatch):
    _, widths = _run("vmap", monkeypatch, trim=True, algorithm=FedAvg(8, 0.5, local_batch_size=4))
    assert widths and set(widths) == {8}  # its local SGD depends on the slots and their order
