"""Tokenization: public-only BPE training, local loading, truncate/pack/full, content-keyed cache."""

import json

import numpy as np
import pytest

import userdp.data.tokenize as tokmod
from userdp.data import build_store, open_source
from userdp.data.selection import bound_contributions
from userdp.data.tokenize import (
    PublicText,
    TokenLayout,
    load_tokenizer,
    record_token_lengths,
    tokenize_store,
    tokenizer_fingerprint,
    train_bpe,
)
from userdp.errors import UserError

PUBLIC = ["the quick brown fox jumps over the lazy dog", "a public sentence about foxes and dogs"] * 50


@pytest.fixture(scope="module")
def tok():
    return train_bpe(PublicText(PUBLIC, description="test sentences"), vocab_size=300, min_frequency=1)


@pytest.fixture
def store(tmp_path):
    rng = np.random.default_rng(0)
    words = ["fox", "dog", "quick", "lazy", "brown", "public", "sentence", "jumps", "over"]
    rows = [
        {"user": f"u{rng.integers(0, 9)}", "text": " ".join(rng.choice(words, rng.integers(1, 40)))} for _ in range(120)
    ]
    p = tmp_path / "a.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return build_store(open_source(str(p)), tmp_path / "s").store


def test_training_refuses_private_records(store):
    with pytest.raises(UserError, match="private"):
        PublicText(store.texts(0), description="oops")
    with pytest.raises(UserError, match="private"):
        PublicText(store, description="oops")
    with pytest.raises(UserError, match="PublicText"):
        train_bpe(["plain", "list"])
    with pytest.raises(UserError, match="description"):
        PublicText(["x"], description="")
    with pytest.raises(UserError, match="private"):  # smuggled inside an iterable
        train_bpe(PublicText(iter([store.texts(0)]), description="nested"))


def test_load_from_file_and_folder(tok, tmp_path):
    tok.save(str(tmp_path / "tokenizer.json"))
    a = load_tokenizer(tmp_path / "tokenizer.json")
    b = load_tokenizer(tmp_path)
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b) == tokenizer_fingerprint(tok)
    assert a.encode("quick fox").ids == tok.encode("quick fox").ids
    with pytest.raises(UserError):
        load_tokenizer(tmp_path / "nope")


def test_modes_and_cache(store, tok, tmp_path, monkeypatch):
    L = 16
    eos = tok.token_to_id("<|endoftext|>")
    full = tokenize_store(store, tok, TokenLayout(L, "full"), cache_dir=tmp_path / "c")
    # full: each record's ids + EOS, equal to a plain encode
    for u in (0, 3):
        texts = store.texts(u)
        ref = [tok.encode(t, add_special_tokens=False).ids + [eos] for t in texts]
        a = full.user_offsets[u]
        assert [full.sequence(a + j).tolist() for j in range(len(texts))] == ref
    tr = tokenize_store(store, tok, TokenLayout(L, "truncate"), cache_dir=tmp_path / "c")
    assert tr.seq_lengths().max() <= L
    assert np.array_equal(tr.seq_lengths(), np.minimum(full.seq_lengths(), L))
    pk = tokenize_store(store, tok, TokenLayout(L, "pack"), cache_dir=tmp_path / "c")
    for u in range(store.num_users):
        assert np.array_equal(pk.user_stream(u), full.user_stream(u))  # windows tile the stream
        lens = np.diff(pk.seq_offsets[pk.user_offsets[u] : pk.user_offsets[u + 1] + 1])
        assert np.all(lens[:-1] == L) and 1 <= lens[-1] <= L
    # second run: from the cache, no encoding
    monkeypatch.setattr(tokmod, "_key", tokmod._key)
    called = []
    orig = store._column_rows
    monkeypatch.setattr(store, "_column_rows", lambda *a, **k: called.append(1) or orig(*a, **k))
    again = tokenize_store(store, tok, TokenLayout(L, "pack"), cache_dir=tmp_path / "c")
    assert again.from_cache and not called and np.array_equal(np.asarray(again.tokens), np.asarray(pk.tokens))
    # a different seq_len, mode, tokenizer or subset is a different key
    keys = {
        full.key,
        tr.key,
        pk.key,
        tokenize_store(store, tok, TokenLayout(L + 1, "pack"), cache_dir=tmp_path / "c").key,
    }
    sub = bound_contributions(store, 2, "shortest")
    keys.add(tokenize_store(store, tok, TokenLayout(L, "pack"), subset=sub, cache_dir=tmp_path / "c").key)
    assert len(keys) == 5
    with pytest.raises(UserError, match="mode"):
        tokenize_store(store, tok, TokenLayout(L, "chunky"))


def test_token_lengths_drive_longest_selection(store, tok, tmp_path):
    lens = record_token_lengths(store, tok, cache_dir=tmp_path)
    assert len(lens) == store.num_records
    u = 0
    texts = store.texts(u)
    ref = [len(tok.encode(t, add_special_tokens=False).ids) for t in texts]
    assert lens[store.offsets[u] : store.offsets[u + 1]].tolist() == ref
    sub = bound_contributions(store, 1, "longest", scores=lens)
    assert lens[store.offsets[u] + sub.records_of(0)[0]] == max(ref)


@pytest.mark.parametrize(
    "damage", ["tokens truncated", "tokens flipped", "offsets truncated", "a file removed", "meta.json torn"]
)
def test_a_damaged_cache_entry_is_rebuilt_not_read(store, tok, tmp_path, damage):
    """A tokenized cache entry is verified (each file's size and sha256, recorded in meta.json when
    it was written) before it is read: a crash's truncated leftover gave `ValueError: mmap length is
    greater than file size`, and a flipped byte would have trained on other tokens silently. A
    damaged entry is made again, and the result equals a fresh tokenization."""
    layout = TokenLayout(16, "truncate")
    fresh = tokenize_store(store, tok, layout, cache_dir=tmp_path / "c")
    want = np.asarray(fresh.tokens).copy()
    folder = fresh.path
    meta = json.loads((folder / "meta.json").read_text())
    assert set(meta["files"]) == {"tokens.bin", "seq_offsets.npy", "user_offsets.npy", "users.npy"}
    if damage == "tokens truncated":
        raw = (folder / "tokens.bin").read_bytes()
        (folder / "tokens.bin").write_bytes(raw[: len(raw) // 2])
    elif damage == "tokens flipped":
        raw = bytearray((folder / "tokens.bin").read_bytes())
        raw[5] ^= 1
        (folder / "tokens.bin").write_bytes(bytes(raw))
    elif damage == "offsets truncated":
        (folder / "seq_offsets.npy").write_bytes((folder / "seq_offsets.npy").read_bytes()[:40])
    elif damage == "a file removed":
        (folder / "users.npy").unlink()
    else:
        (folder / "meta.json").write_text((folder / "meta.json").read_text()[:20])
    again = tokenize_store(store, tok, layout, cache_dir=tmp_path / "c")
    assert not again.from_cache and np.array_equal(np.asarray(again.tokens), want)
    assert tokenize_store(store, tok, layout, cache_dir=tmp_path / "c").from_cache  # whole again
