"""The UserData contract the engine trains on (docs/ARCHITECTURE.md §2)."""

import numpy as np
import pytest
import torch

from userdp.engine import ELS, TensorUserData
from userdp.errors import UserError


def _data():
    x = torch.arange(20.0).unsqueeze(1)
    return TensorUserData(
        {"x": x, "u": torch.tensor([0] * 3 + [1] * 10 + [2] * 2 + [3] * 5)}, np.array([0, 3, 13, 15, 20])
    )


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
    pairs = set(zip(t.users.tolist(), t.records.tolist(), strict=True))
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


def test_uniform_subsets_is_uniform_distinct_and_capped():
    """The vectorized draw (Floyd's algorithm over all users at once) gives each G-subset of a
    user's n records probability 1/C(n, G): chi-square over the 10 pairs of 5 records."""
    from scipy import stats

    from userdp.engine.user_data import uniform_subsets

    rng = np.random.default_rng(123)
    rec, mask = uniform_subsets(np.full(50_000, 5), 2, rng)
    assert (mask == 1).all() and (rec[:, 0] != rec[:, 1]).all() and rec.max() < 5
    pairs = np.sort(rec, axis=1)
    counts = np.bincount(pairs[:, 0] * 5 + pairs[:, 1], minlength=25)
    observed = counts[counts > 0]
    assert len(observed) == 10
    assert stats.chisquare(observed).pvalue > 1e-3
    rec, mask = uniform_subsets(np.array([1, 3, 9]), 4, rng)
    assert mask.sum(axis=1).tolist() == [1, 3, 4]
    assert rec[0, 0] == 0 and sorted(rec[1, :3]) == [0, 1, 2] and len(set(rec[2])) == 4


def test_bounded_records_default_is_capped_random_subset():
    from userdp.engine.user_data import TensorUserData

    sizes = np.array([1, 3, 7, 2])
    d = TensorUserData({"x": torch.arange(13.0)}, np.concatenate([[0], np.cumsum(sizes)]))
    seen = set()
    for seed in range(30):
        users, records = d.bounded_records(3, np.random.default_rng(seed))
        assert np.bincount(users).tolist() == [1, 3, 3, 2]
        assert (records < sizes[users]).all()
        seen.add(tuple(records[users == 2]))
    assert len(seen) > 5  # the heavy user's kept records vary with the seed
