"""The user-grouped store: contiguous users, offsets, dataset order, determinism, out-of-core shards."""

import json

import numpy as np
import pytest

from userdp.data import UserStore, build_store, open_source
from userdp.data.records import RecordBatch
from userdp.errors import UserError


class ListSource:
    """A source from Python lists, yielding small batches (exercises many partition rounds)."""

    has_dates = False
    size_hint = 0
    description = "list source"

    def __init__(self, users, texts):
        self.users, self.texts = users, texts
        from userdp.data.records import DropReport

        self.drops = DropReport()

    def batches(self, batch_size):
        for a in range(0, len(self.users), 37):
            yield RecordBatch(self.users[a : a + 37], self.texts[a : a + 37], None, list(range(a, a + 37)), "list")


def heavy_tail(n_users=200, seed=0):
    rng = np.random.default_rng(seed)
    sizes = np.minimum(1 + rng.zipf(1.8, n_users), 300)
    users = np.repeat([f"user-{i}" for i in range(n_users)], sizes)
    order = rng.permutation(len(users))
    users = users[order].tolist()
    texts = [f"r{j} of {u}" for j, u in enumerate(users)]
    return users, texts


@pytest.mark.parametrize("shards", [1, 7])
def test_store_matches_in_memory_grouping(tmp_path, shards):
    users, texts = heavy_tail()
    st = build_store(ListSource(users, texts), tmp_path / "s", num_shards=shards).store
    expect: dict[str, list[str]] = {}
    for u, t in zip(users, texts, strict=True):
        expect.setdefault(u, []).append(t)
    assert st.num_users == len(expect) and st.num_records == len(users)
    assert st.offsets[0] == 0 and np.all(np.diff(st.offsets) >= 1)
    assert st.sizes().dtype == np.int64
    for i, uid in enumerate(st.user_ids):
        assert st.texts(i) == expect[uid]  # contiguous, in dataset order
        assert st.sizes()[i] == len(expect[uid])
    # records are laid out contiguously: the global text column is the users' texts concatenated
    col = st.column("text").to_pylist()
    assert col == [t for uid in st.user_ids for t in expect[uid]]


def test_cohort_gather_and_record_indices(tmp_path):
    users, texts = heavy_tail(50, seed=1)
    st = build_store(ListSource(users, texts), tmp_path / "s", num_shards=3).store
    rng = np.random.default_rng(0)
    us = rng.integers(0, st.num_users, 64)
    rs = np.array([rng.integers(0, st.sizes()[u]) for u in us])
    got = st.gather_texts(us, rs)
    assert got == [st.texts(u)[r] for u, r in zip(us, rs, strict=True)]
    big = int(np.argmax(st.sizes()))
    assert st.texts(big, [2, 0]) == [st.texts(big)[2], st.texts(big)[0]]
    with pytest.raises(IndexError):
        st.texts(big, [st.sizes()[big]])


def test_fingerprint_is_deterministic_and_content_sensitive(tmp_path):
    users, texts = heavy_tail(30, seed=2)
    a = build_store(ListSource(users, texts), tmp_path / "a", num_shards=4).store
    b = build_store(ListSource(users, texts), tmp_path / "b", num_shards=4).store
    texts2 = list(texts)
    texts2[5] = texts2[5] + "!"
    c = build_store(ListSource(users, texts2), tmp_path / "c", num_shards=4).store
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert a.user_ids == b.user_ids


def test_store_spans_many_arrow_batches(tmp_path, monkeypatch):
    import userdp.data.store as store_mod

    monkeypatch.setattr(store_mod, "CHUNK_ROWS", 16)
    users, texts = heavy_tail(40, seed=3)
    st = build_store(ListSource(users, texts), tmp_path / "s", num_shards=2).store
    assert len(st._batches) > 10
    big = int(np.argmax(st.sizes()))
    assert len(st.texts(big)) == st.sizes()[big]
    rows = np.random.default_rng(0).permutation(st.num_records)[:50]
    allt = st.column("text").to_pylist()
    assert st._column_rows("text", rows) == [allt[r] for r in rows]


def test_existing_folder_and_bad_store(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps({"user": "a", "text": "b"}) + "\n")
    build_store(open_source(str(p)), tmp_path / "s")
    with pytest.raises(UserError, match="exists and is not empty"):
        build_store(open_source(str(p)), tmp_path / "s")
    assert build_store(open_source(str(p)), tmp_path / "s", overwrite=True).store.num_records == 1
    with pytest.raises(UserError, match="not a userdp data store"):
        UserStore(tmp_path)


def test_shards_are_removed_and_count_follows_size_hint(tmp_path):
    users, texts = heavy_tail(20, seed=4)
    src = ListSource(users, texts)
    src.size_hint = 10 * (128 << 20)  # pretend 1.3 GB of input
    res = build_store(src, tmp_path / "s")
    assert res.store.meta["num_shards"] >= 10
    assert not (tmp_path / "s" / "_shards").exists()
    assert res.store.num_records == len(users)
