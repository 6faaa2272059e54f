"""Splits (SPEC §6): deterministic from a seed, no record on both sides."""

import json
import math

import numpy as np
import pytest

from userdp.data import build_store, open_source
from userdp.data.splits import cc_news_n_eval, cc_news_split, heldout_users, time_split
from userdp.errors import UserError


def rows_of(sub, store):
    return set(sub.rows(store.offsets).tolist())


@pytest.fixture
def store(tmp_path):
    rows = []
    for u, n in enumerate([1, 2, 5, 10, 11, 40, 400]):
        for j in range(n):
            rows.append({"user": f"u{u}", "text": f"{u}:{j}", "date": f"{2016 + j % 4}-06-0{1 + u % 9}T00:00:00"})
    p = tmp_path / "a.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return build_store(open_source(str(p), date_field="date"), tmp_path / "s").store


def test_heldout_users_disjoint_deterministic(store):
    a = heldout_users(store, 0.3, seed=5)
    b = heldout_users(store, 0.3, seed=5)
    assert np.array_equal(a.eval.users, b.eval.users)
    assert len(a.eval.users) == round(0.3 * 7)
    assert not set(a.eval.users) & set(a.train.users)
    assert set(a.eval.users) | set(a.train.users) == set(range(7))
    assert a.train.num_records + a.eval.num_records == store.num_records
    seen = {tuple(heldout_users(store, 0.3, seed=s).eval.users) for s in range(20)}
    assert len(seen) > 5  # the seed matters
    with pytest.raises(UserError):
        heldout_users(store, 1.0, seed=0)


def test_cc_news_rule(store):
    assert cc_news_n_eval(np.array([2, 10, 11, 40, 320, 400])).tolist() == [1, 1, 2, 4, 32, 32]
    sp = cc_news_split(store)
    sizes = store.sizes()
    assert sp.drops.get("cc_news_users_with_one_record") == 1
    assert set(sp.train.users) == set(sp.eval.users) == set(np.flatnonzero(sizes >= 2))
    for i, u in enumerate(sp.eval.users):
        n = sizes[u]
        k = min(32, max(1, math.ceil(0.1 * n)))
        assert sp.eval.records_of(i).tolist() == list(range(k))  # the first records, dataset order
        assert sp.train.records_of(i).tolist() == list(range(k, n))
        assert store.texts(u, sp.eval.records_of(i))[0].endswith(":0")
    assert not rows_of(sp.train, store) & rows_of(sp.eval, store)


def test_time_split(store):
    sp = time_split(store, "2018-01-01")
    tr, ev = rows_of(sp.train, store), rows_of(sp.eval, store)
    assert not tr & ev and len(tr) + len(ev) == store.num_records
    for i, u in enumerate(sp.train.users):
        assert all(d < "2018" for d in store.dates(u, sp.train.records_of(i)))
    for i, u in enumerate(sp.eval.users):
        assert all(d >= "2018" for d in store.dates(u, sp.eval.records_of(i)))
    with pytest.raises(UserError, match="cutoff"):
        time_split(store, "not a date")


def test_time_split_errors(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps({"user": "a", "text": "x"}) + "\n")
    st = build_store(open_source(str(p)), tmp_path / "s").store
    with pytest.raises(UserError, match="needs dates"):
        time_split(st, "2018-01-01")
    p.write_text(json.dumps({"user": "a", "text": "x", "d": "14,May,2004"}) + "\n" + json.dumps({"user": "a", "text": "y", "d": "someday"}) + "\n")
    st = build_store(open_source(str(p), date_field="d"), tmp_path / "s2").store
    with pytest.raises(UserError, match=r"user 'a' record 1: unrecognised date 'someday'"):
        time_split(st, "2005-01-01")
