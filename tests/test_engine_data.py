"""The UserData contract the engine trains on (docs/ARCHITECTURE.md §2)."""

import numpy as np
import pytest
import torch

from userdp.engine import ELS, TensorUserData
from userdp.errors import UserError


def _data():
    x = torch.arange(20.0).unsqueeze(1)
    return TensorUserData({"x": x, "u": torch.tensor([0] * 3 + [1] * 10 + [2] * 2 + [3] * 5)},
                          np.array([0, 3, 13, 15, 20]))


def test_gather_and_sizes():
    d = _data()
    assert d.num_users == 4 and list(d.sizes()) == [3, 10, 2, 5]
    b = d.gather(np.array([1, 3, 0]), np.array([9, 0, 2]))
    assert b["x"].squeeze(1).tolist() == [12.0, 15.0, 2.0]


def test_draw_records_caps_masks_and_is_fresh():
    d = _data()
    rng = np.random.default_rng(0)
    users = np.array([0, 1, 2, 3])
    seen = set()
    for _ in range(30):
        b, m = d.draw_records(users, 4, rng)
        assert b["x"].shape == (4, 4, 1) and m.shape == (4, 4)
        assert m.sum(1).tolist() == [3, 4, 2, 4]  # min(G, n_u) real records
        assert (b["u"] == torch.tensor([0, 1, 2, 3]).unsqueeze(1)).all()  # padding repeats the same user
        big = b["x"][1, :, 0].tolist()
        assert len(set(big)) == 4  # without replacement
        seen.add(tuple(sorted(big)))
    assert len(seen) > 10  # drawn fresh each call


def test_els_table_caps_every_user_at_g():
    d = _data()
    t = ELS(4, 0.5).units(d, np.random.default_rng(1))
    counts = np.bincount(t.users, minlength=4)
    assert counts.tolist() == [3, 4, 2, 4]
    pairs = set(zip(t.users.tolist(), t.records.tolist()))
    assert len(pairs) == len(t)  # distinct records


def test_bad_offsets_and_grouping():
    x = torch.zeros(5, 1)
    with pytest.raises(UserError, match="no records"):
        TensorUserData({"x": x}, np.array([0, 2, 2, 5]))
    with pytest.raises(UserError, match="offsets end"):
        TensorUserData({"x": x}, np.array([0, 2, 4]))
    with pytest.raises(UserError, match="differ"):
        TensorUserData({"x": x, "y": torch.zeros(4)}, np.array([0, 5]))
    g = TensorUserData.from_user_ids({"x": torch.arange(6.0)}, ["b", "a", "b", "c", "a", "b"])
    assert list(g.sizes()) == [2, 3, 1]
    assert g.gather(np.array([1, 1, 1]), np.arange(3))["x"].tolist() == [0.0, 2.0, 5.0]
