"""The engine adapter: UserData over a tokenized store; random chunk draws fresh windows."""

import json

import numpy as np
import pytest
import torch

from userdp.data import build_store, open_source
from userdp.data.selection import RandomChunkUserData
from userdp.data.tokenize import PublicText, TokenLayout, tokenize_store, train_bpe
from userdp.data.torch_data import TokenizedUserData
from userdp.engine.user_data import UserData
from userdp.errors import UserError


@pytest.fixture(scope="module")
def tok():
    return train_bpe(PublicText(["abc def ghi jkl"] * 20, description="letters"), vocab_size=280, min_frequency=1)


@pytest.fixture
def store(tmp_path):
    rows = [{"user": "long", "text": " ".join(f"w{i}" for i in range(200))}]
    rows += [{"user": "short", "text": "abc"}, {"user": "short", "text": "def ghi"}]
    rows += [{"user": "mid", "text": f"abc def {i}"} for i in range(5)]
    p = tmp_path / "a.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return build_store(open_source(str(p)), tmp_path / "s").store


def test_gather_pads_and_masks_labels(store, tok):
    ts = tokenize_store(store, tok, TokenLayout(12, "truncate"))
    ud = TokenizedUserData(ts)
    assert isinstance(ud, UserData) and ud.num_users == 3
    assert np.array_equal(ud.sizes(), store.sizes())
    users = np.arange(3)
    b = ud.gather(users, np.zeros(3, dtype=np.int64))
    assert b["input_ids"].dtype == torch.long and b["input_ids"].shape == (3, 12)
    for k, u in enumerate(users):
        seq = ts.sequence(ts.user_offsets[u])
        n = len(seq)
        assert b["input_ids"][k, :n].tolist() == seq.tolist()
        assert (b["labels"][k, :n] == b["input_ids"][k, :n]).all()
        assert (b["labels"][k, n:] == -100).all() and (b["input_ids"][k, n:] == ts.pad_id).all()
    batch, mask = ud.draw_records(users, 3, np.random.default_rng(0))
    assert batch["input_ids"].shape == (3, 3, 12) and mask.shape == (3, 3)
    assert mask.sum(1).tolist() == np.minimum(store.sizes(), 3).tolist()
    with pytest.raises(IndexError):
        ud.gather(np.array([0]), np.array([99]))


def test_random_chunk_windows_are_fresh_uniform_slices(store, tok):
    L = 16
    ts = tokenize_store(store, tok, TokenLayout(L, "full"))
    ud = RandomChunkUserData(ts)
    u = store.user_index()["long"]
    stream = ts.user_stream(u)
    T = len(stream)
    assert T > 4 * L
    windows = np.lib.stride_tricks.sliding_window_view(stream, L)
    rng = np.random.default_rng(0)
    starts = []
    for _ in range(400):
        batch, mask = ud.draw_records(np.array([u]), 2, rng)
        assert mask.tolist() == [[1.0, 1.0]]
        for g in range(2):
            w = batch["input_ids"][0, g].numpy()
            hits = np.flatnonzero((windows == w).all(1))
            assert len(hits)  # a contiguous window of the user's stream
            starts.append(hits[0])
    starts = np.array(starts)
    span = T - L + 1
    # uniform offsets: mean and spread match a discrete uniform on [0, span)
    assert abs(starts.mean() - (span - 1) / 2) < 4 * np.sqrt((span**2 - 1) / 12 / len(starts))
    assert len(np.unique(starts)) > span // 3
    # a user with fewer tokens than L: one (padded) window, other slots masked
    s = store.user_index()["short"]
    batch, mask = ud.draw_records(np.array([s]), 3, rng)
    assert mask.tolist() == [[1.0, 0.0, 0.0]]
    n = len(ts.user_stream(s))
    assert batch["input_ids"][0, 0, :n].tolist() == ts.user_stream(s).tolist()
    assert (batch["labels"][0, 0, n:] == -100).all()


def test_random_chunk_needs_whole_streams(store, tok):
    with pytest.raises(UserError, match="full"):
        RandomChunkUserData(tokenize_store(store, tok, TokenLayout(8, "truncate")))


def test_lm_user_data_selections(store, tok):
    from userdp.data.selection import LMUserData, RankedUserData

    ts = tokenize_store(store, tok, TokenLayout(64, "truncate"))
    mid = store.user_index()["mid"]
    lens = ts.seq_lengths()[ts.user_offsets[mid] : ts.user_offsets[mid + 1]]
    for sel, pick in (("longest", np.argmax), ("shortest", np.argmin)):
        ud = LMUserData(ts, sel)
        assert isinstance(ud, RankedUserData)
        b1, m1 = ud.draw_records(np.array([mid]), 2, np.random.default_rng(0))
        b2, _ = ud.draw_records(np.array([mid]), 2, np.random.default_rng(1))
        assert torch.equal(b1["input_ids"], b2["input_ids"]) and m1.tolist() == [[1.0, 1.0]]
        top = ts.sequence(ts.user_offsets[mid] + int(pick(lens)))
        assert b1["input_ids"][0, 0, : len(top)].tolist() == top.tolist()
        assert torch.equal(ud.gather(np.array([mid]), np.array([0]))["input_ids"], b1["input_ids"][:, 0])
    # perplexity: the records with the lowest scores come first
    scores = np.arange(ts.user_offsets[-1], dtype=float)[::-1].copy()
    ud = LMUserData(ts, "lowest_ppl", scores=scores)
    b, m = ud.draw_records(np.array([mid]), 7, np.random.default_rng(0))
    last = ts.sequence(ts.user_offsets[mid + 1] - 1)
    assert b["input_ids"][0, 0, : len(last)].tolist() == last.tolist()
    assert m.tolist() == [[1.0] * 5 + [0.0] * 2]
    with pytest.raises(UserError, match="perplexities"):
        LMUserData(ts, "highest_ppl")
    with pytest.raises(UserError, match="full"):
        LMUserData(ts, "random_chunk")
    assert type(LMUserData(ts, "random")) is TokenizedUserData
    assert isinstance(
        LMUserData(tokenize_store(store, tok, TokenLayout(64, "full")), "random_chunk"), RandomChunkUserData
    )


def test_els_contribution_bound_honours_the_selection(store, tok):
    """ELS builds D' once through ``bounded_records``: a ranked selection (longest) must decide it,
    exactly as it decides ULS's draws, and no user may keep more than G records."""
    from userdp.data.selection import LMUserData
    from userdp.engine import ELS

    ts = tokenize_store(store, tok, TokenLayout(64, "truncate"))
    ud = LMUserData(ts, "longest")
    table = ELS(group_size=2, sampling_rate=0.5).units(ud, np.random.default_rng(0))
    sizes = ud.sizes()
    assert np.bincount(table.users, minlength=ud.num_users).tolist() == np.minimum(sizes, 2).tolist()
    mid = store.user_index()["mid"]
    lens = ts.seq_lengths()[ts.user_offsets[mid] : ts.user_offsets[mid + 1]]
    els_batch = ud.gather(table.users[table.users == mid], table.records[table.users == mid])
    uls_batch, _ = ud.draw_records(np.array([mid]), 2, np.random.default_rng(5))
    assert torch.equal(els_batch["input_ids"], uls_batch["input_ids"][0])
    longest = ts.sequence(ts.user_offsets[mid] + int(np.argmax(lens)))
    assert els_batch["input_ids"][0, : len(longest)].tolist() == longest.tolist()
