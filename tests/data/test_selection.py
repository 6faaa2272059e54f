"""Contribution bounding (SPEC §5.4) and the perplexity cache with its data touch."""

import json

import numpy as np
import pytest

from userdp.data import build_store, open_source
from userdp.data.selection import bound_contributions, perplexity_scores
from userdp.errors import UserError


@pytest.fixture
def store(tmp_path):
    rng = np.random.default_rng(0)
    rows = []
    for u in range(12):
        for j in range(1 + u):  # user u has u + 1 records
            rows.append({"user": f"u{u:02d}", "text": "x" * int(rng.integers(1, 60)) + f" {u}-{j}"})
    rng.shuffle(rows)
    p = tmp_path / "a.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return build_store(open_source(str(p)), tmp_path / "s").store


def chosen(store, sub):
    return {store.user_id(u): store.texts(u, sub.records_of(i)) for i, u in enumerate(sub.users)}


@pytest.mark.parametrize("strategy", ["longest", "shortest"])
def test_longest_shortest_pick_extremes_in_dataset_order(store, strategy):
    sub = bound_contributions(store, 3, strategy)
    assert np.array_equal(sub.sizes(), np.minimum(store.sizes(), 3))
    for i, u in enumerate(sub.users):
        texts = store.texts(u)
        lens = np.array([len(t) for t in texts])
        recs = sub.records_of(i)
        assert np.all(np.diff(recs) > 0)  # dataset order kept
        others = np.setdiff1d(np.arange(len(texts)), recs)
        if len(others):
            if strategy == "longest":
                assert lens[recs].min() >= lens[others].max()
            else:
                assert lens[recs].max() <= lens[others].min()


def test_lengths_from_tokens_override_characters(store):
    scores = np.zeros(store.num_records)
    u = int(np.argmax(store.sizes()))
    scores[store.offsets[u] + 5] = 100  # record 5 of the largest user is "longest" by tokens
    sub = bound_contributions(store, 1, "longest", scores=scores)
    i = int(np.flatnonzero(sub.users == u)[0])
    assert sub.records_of(i).tolist() == [5]


def test_random_is_seeded_and_uniform(store):
    a = bound_contributions(store, 2, "random", seed=1)
    b = bound_contributions(store, 2, "random", seed=1)
    assert np.array_equal(a.records, b.records)
    u = int(np.argmax(store.sizes()))  # 12 records
    counts = np.zeros(store.sizes()[u])
    n = 3000
    for s in range(n):
        sub = bound_contributions(store, 2, "random", seed=s)
        counts[sub.records_of(int(np.flatnonzero(sub.users == u)[0]))] += 1
    p = 2 / store.sizes()[u]
    # each record kept with probability G/n_u; 4.5 sigma band
    assert np.all(np.abs(counts / n - p) < 4.5 * np.sqrt(p * (1 - p) / n))
    with pytest.raises(UserError, match="seed"):
        bound_contributions(store, 2, "random")


def test_perplexity_selection_cache_and_touch(store, tmp_path):
    calls = []

    def score(texts):
        calls.append(len(texts))
        return [1.0 + len(t) for t in texts]

    ppl, touch = perplexity_scores(store, score, "model-A", cache_dir=tmp_path / "c", batch_size=8)
    assert sum(calls) == store.num_records and not touch.from_cache
    assert touch.records_touched == store.num_records and touch.users_touched == store.num_users
    assert "outside the DP mechanism" in touch.statement and touch.to_dict()["model_id"] == "model-A"
    ppl2, touch2 = perplexity_scores(store, score, "model-A", cache_dir=tmp_path / "c")
    assert sum(calls) == store.num_records and touch2.from_cache and np.array_equal(ppl, ppl2)
    perplexity_scores(store, score, "model-B", cache_dir=tmp_path / "c")  # a new model re-scores
    assert sum(calls) == 2 * store.num_records
    hi = bound_contributions(store, 2, "highest_ppl", scores=ppl)
    lo = bound_contributions(store, 2, "lowest_ppl", scores=ppl)
    ln = bound_contributions(store, 2, "longest")
    sh = bound_contributions(store, 2, "shortest")
    assert chosen(store, hi) == chosen(store, ln) and chosen(store, lo) == chosen(store, sh)


def test_perplexity_on_a_subset_and_errors(store, tmp_path):
    sub = bound_contributions(store, 1, "shortest")
    ppl, touch = perplexity_scores(store, lambda t: np.ones(len(t)) * 2.0, "m", subset=sub, cache_dir=tmp_path)
    assert touch.records_touched == store.num_users
    assert np.isnan(ppl).sum() == store.num_records - store.num_users
    with pytest.raises(UserError, match="no perplexity"):
        bound_contributions(store, 1, "lowest_ppl", scores=ppl)
    with pytest.raises(UserError, match="returned 1 values"):
        perplexity_scores(store, lambda t: [1.0], "m2", cache_dir=tmp_path)
    with pytest.raises(UserError, match="non-finite"):
        perplexity_scores(store, lambda t: [float("nan")] * len(t), "m3", cache_dir=tmp_path)
    with pytest.raises(UserError, match="strategy"):
        bound_contributions(store, 1, "best")
