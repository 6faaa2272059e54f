"""Tokenization with Hugging Face ``tokenizers``, cached on disk and keyed by content.

- :func:`load_tokenizer`: a local ``tokenizer.json``, or a folder holding one (a transformers
  tokenizer folder), or any folder ``AutoTokenizer`` can load with ``local_files_only`` (a fast
  tokenizer's backend is used). Nothing is downloaded.
- :func:`train_bpe`: a byte-level BPE trained on :class:`PublicText` only. The caller states
  that the text is public by wrapping it (``PublicText(texts, description=...)``); texts read
  from a private :class:`~userdp.data.store.UserStore` (its ``texts()`` / ``gather_texts()``
  return a marked list), the store itself, a subset or a tokenized store are refused with a
  ``UserError``. Training a tokenizer on the private records would leak them outside the DP
  guarantee.
- :func:`tokenize_store`: ``truncate`` (one sequence per record, cut to ``seq_len``), ``pack``
  (each user's records joined with EOS and cut into consecutive ``seq_len`` windows), or
  ``full`` (one uncut sequence per record: random-chunk selection and token statistics). The
  result lives in ``cache_dir/tok-<key>/`` where ``key`` hashes the store fingerprint, the
  subset, the tokenizer, ``seq_len``, the mode and ``add_eos``; a second call with the same key
  memory-maps the cached arrays instead of re-tokenizing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from userdp import progress
from userdp.data.store import PrivateTexts, UserStore
from userdp.data.subset import UserSubset
from userdp.errors import UserError
from userdp.fileio import atomic_dir, sha256_file

MODES = ("truncate", "pack", "full")
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")
PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>")
ENCODE_BLOCK = 4_096


def load_tokenizer(path):
    """A ``tokenizers.Tokenizer`` from a local file or folder (never the hub).

    Raises:
        UserError: no tokenizer there, or one that cannot encode text (a vocabulary of fewer than
            two tokens, or one that turns a probe sentence into no tokens)."""
    tok = _load_tokenizer(path)
    size = tok.get_vocab_size(with_added_tokens=True)
    ids = tok.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False).ids
    unk = getattr(tok.model, "unk_token", None)
    unk_id = tok.token_to_id(unk) if unk else None
    if size < 2 or not ids or all(i == unk_id for i in ids) or len(set(ids)) == 1:
        raise UserError(
            f"tokenizer {path!s}: it cannot encode text (a vocabulary of {size} token(s)); the folder "
            "lacks its tokenizer files (tokenizer.json, or vocab/merges): add them, or set tokenizer.path"
        )
    return tok


def _load_tokenizer(path):
    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_file():
        try:
            return Tokenizer.from_file(str(p))
        except Exception as exc:
            raise UserError(f"{p}: not a tokenizers JSON file ({exc})") from None
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            return Tokenizer.from_file(str(p / "tokenizer.json"))
        try:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        except Exception as exc:
            raise UserError(f"{p}: no tokenizer.json and transformers cannot load a tokenizer here ({exc})") from None
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise UserError(f"{p}: only fast (Rust) tokenizers are supported; this folder holds a slow one")
        return backend
    raise UserError(f"tokenizer {path!s} does not exist (give a tokenizer.json or a tokenizer folder)")


def tokenizer_fingerprint(tok) -> str:
    return hashlib.blake2b(tok.to_str().encode("utf-8"), digest_size=12).hexdigest()


def special_id(tok, candidates) -> int | None:
    for c in candidates:
        i = tok.token_to_id(c)
        if i is not None:
            return int(i)
    return None


class PublicText:
    """Text the caller declares public (not any user's private data), e.g. held-out plays."""

    def __init__(self, texts: Iterable[str], *, description: str):
        if isinstance(texts, (PrivateTexts, UserStore, UserSubset, TokenizedStore)):
            raise UserError(
                "refusing to treat records of the private store as public text: a tokenizer trained "
                "on them leaks them outside the DP guarantee (train on public text, e.g. held-out plays)"
            )
        if not description or not str(description).strip():
            raise UserError("PublicText needs a description saying where the public text comes from")
        self.texts = texts
        self.description = str(description)


def train_bpe(
    public: PublicText, vocab_size: int = 8192, *, min_frequency: int = 2, special_tokens=("<|endoftext|>", "<pad>")
):
    """A byte-level BPE tokenizer trained on ``public`` (a :class:`PublicText`) only."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not isinstance(public, PublicText):
        raise UserError(
            "train_bpe takes PublicText(texts, description=...): state that the training text is public; "
            "it refuses the private store's records"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=int(vocab_size),
        min_frequency=int(min_frequency),
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = public.texts
    n = 0

    def gen():
        nonlocal n
        for t in texts:
            if isinstance(t, PrivateTexts):
                raise UserError("refusing to train a tokenizer on records of the private store")
            n += 1
            yield t

    tok.train_from_iterator(gen(), trainer=trainer)
    if n == 0:
        raise UserError(f"no public text to train a tokenizer on ({public.description})")
    return tok


@dataclasses.dataclass
class TokenizedStore:
    """Token sequences grouped by user: user i of the view holds sequences
    ``user_offsets[i]:user_offsets[i+1]``; sequence s is ``tokens[seq_offsets[s]:seq_offsets[s+1]]``.

    ``users[i]`` is the store user index. In ``pack`` mode a user's sequences are consecutive
    windows of one token stream; in ``truncate``/``full`` a sequence is one record.
    """

    tokens: np.ndarray  # int32 [T] (memory-mapped when loaded from cache)
    seq_offsets: np.ndarray  # int64 [S + 1]
    user_offsets: np.ndarray  # int64 [N + 1]
    users: np.ndarray  # int64 [N]
    seq_len: int
    mode: str
    eos_id: int | None
    pad_id: int
    key: str
    path: Path | None = None
    from_cache: bool = False
    seconds: float = 0.0

    @property
    def num_users(self) -> int:
        return int(len(self.users))

    @property
    def num_tokens(self) -> int:
        return int(self.seq_offsets[-1] - self.seq_offsets[0]) if self.mode != "pack" else int(len(self.tokens))

    def sizes(self) -> np.ndarray:
        return np.diff(self.user_offsets)

    def seq_lengths(self) -> np.ndarray:
        return np.diff(self.seq_offsets)

    def sequence(self, s: int) -> np.ndarray:
        return np.asarray(self.tokens[self.seq_offsets[s] : self.seq_offsets[s + 1]])

    def user_stream(self, i: int) -> np.ndarray:
        """All tokens of view user i, in order (pack/full: the concatenated records)."""
        a, b = self.user_offsets[i], self.user_offsets[i + 1]
        return np.asarray(self.tokens[self.seq_offsets[a] : self.seq_offsets[b]])


def _key(store: UserStore, subset: UserSubset, tok, seq_len: int, mode: str, add_eos: bool) -> str:
    parts = [
        store.fingerprint,
        subset.fingerprint(),
        tokenizer_fingerprint(tok),
        str(seq_len),
        mode,
        str(add_eos),
        "v1",
    ]
    return hashlib.blake2b("|".join(parts).encode(), digest_size=12).hexdigest()


#: the files of a tokenized cache entry beside its meta.json
ENTRY_FILES = ("tokens.bin", "seq_offsets.npy", "user_offsets.npy", "users.npy")


def _intact(folder: Path) -> bool:
    """Whether a cache entry is whole: meta.json readable, every file there with the size and
    sha256 meta.json recorded (an entry written before checksums: tokens.bin's size only)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        files = meta.get("files")
        if not isinstance(files, dict):  # an entry of an older userdp
            return (folder / "tokens.bin").stat().st_size == 4 * int(meta["num_tokens"]) and all(
                (folder / n).is_file() for n in ENTRY_FILES
            )
        for name in ENTRY_FILES:
            want, p = files[name], folder / name
            if p.stat().st_size != int(want["bytes"]) or sha256_file(p) != want["sha256"]:
                return False
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _load(folder: Path) -> TokenizedStore:
    meta = json.loads((folder / "meta.json").read_text())
    n_tok = meta["num_tokens"]
    tokens = (
        np.memmap(folder / "tokens.bin", dtype=np.int32, mode="r", shape=(n_tok,)) if n_tok else np.zeros(0, np.int32)
    )
    return TokenizedStore(
        tokens=tokens,
        seq_offsets=np.load(folder / "seq_offsets.npy"),
        user_offsets=np.load(folder / "user_offsets.npy"),
        users=np.load(folder / "users.npy"),
        seq_len=meta["seq_len"],
        mode=meta["mode"],
        eos_id=meta["eos_id"],
        pad_id=meta["pad_id"],
        key=meta["key"],
        path=folder,
        from_cache=True,
    )


@dataclasses.dataclass(frozen=True)
class TokenLayout:
    """How records become sequences: at most ``seq_len`` tokens each; ``mode`` ``truncate`` (one
    sequence a record, cut), ``pack`` (each user's records streamed into windows) or ``full`` (one
    sequence a record, whole); ``add_eos``: an end-of-text token after each record.

    Raises:
        UserError: an unknown mode, or ``seq_len`` below 2."""

    seq_len: int
    mode: str = "truncate"
    add_eos: bool = True

    def __post_init__(self):
        if self.mode not in MODES:
            raise UserError(f"tokenization mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.seq_len < 2:
            raise UserError(f"sequence length must be >= 2, got {self.seq_len}")


def tokenize_store(
    store: UserStore, tokenizer, layout: TokenLayout | int, *, subset: UserSubset | None = None, cache_dir=None
) -> TokenizedStore:
    """Tokenize the store (or a subset of it) as ``layout`` says (an int: ``TokenLayout(seq_len)``,
    truncated records with an end-of-text token), or load the cached result for the same key."""
    layout = TokenLayout(layout) if isinstance(layout, int) else layout
    seq_len, mode, add_eos = layout.seq_len, layout.mode, layout.add_eos
    t0 = time.perf_counter()
    subset = subset or UserSubset.full(store.sizes())
    key = _key(store, subset, tokenizer, seq_len, mode, add_eos)
    cache_root = Path(cache_dir) if cache_dir is not None else store.path / "tokenized"
    folder = cache_root / f"tok-{key}"
    if (folder / "meta.json").is_file():
        if _intact(folder):
            ts = _load(folder)
            ts.seconds = time.perf_counter() - t0
            return ts
        shutil.rmtree(folder)  # a damaged entry (a crash's leftover, a disk error, an edit): made again below
    eos_id = special_id(tokenizer, EOS_CANDIDATES)
    if add_eos and eos_id is None:
        raise UserError(
            "the tokenizer has no end-of-text token (<|endoftext|>, </s>, <eos>); use TokenLayout(..., add_eos=False)"
        )
    pad_id = special_id(tokenizer, PAD_CANDIDATES)
    if pad_id is None:
        pad_id = eos_id if eos_id is not None else 0
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer.to_str())
    tok.no_padding()
    if mode == "truncate":
        tok.enable_truncation(max_length=seq_len - (1 if add_eos else 0))
    else:
        tok.no_truncation()
    meta = dict(
        key=key,
        seq_len=int(seq_len),
        mode=mode,
        eos_id=eos_id,
        pad_id=int(pad_id),
        add_eos=add_eos,
        store=store.fingerprint,
        tokenizer=tokenizer_fingerprint(tokenizer),
    )
    with atomic_dir(folder) as tmp:  # renamed to folder when whole; another process's entry is kept
        _write_tokens(tmp, tok, store, subset, meta)
    ts = _load(folder)
    ts.from_cache = False
    ts.seconds = time.perf_counter() - t0
    return ts


def record_token_lengths(store: UserStore, tokenizer, *, cache_dir=None) -> np.ndarray:
    """int64 [num_records]: tokens per store record (no EOS), for longest/shortest selection.

    Reuses (and fills) the ``full`` tokenization cache of the whole store.
    """
    ts = tokenize_store(store, tokenizer, TokenLayout(2**30, "full", add_eos=False), cache_dir=cache_dir)
    return ts.seq_lengths().astype(np.int64)


def _write_tokens(tmp: Path, tok, store, subset, meta: dict) -> None:
    """Tokenize ``subset``'s records into the (temporary) cache folder ``tmp``, as ``meta`` (the
    cache entry's key, layout and special tokens) says, in blocks of :data:`ENCODE_BLOCK` records."""
    seq_len, mode, add_eos, eos_id, block = meta["seq_len"], meta["mode"], meta["add_eos"], meta["eos_id"], ENCODE_BLOCK
    rows = subset.rows(store.offsets)
    rec_lens = np.empty(len(rows), dtype=np.int64)
    n_tok = 0
    with (
        open(tmp / "tokens.bin", "wb") as out,
        progress.bar(len(rows), "tokenizing", "rec", lines=progress.LOOP_LINES) as shown,
    ):
        for a in range(0, len(rows), block):
            r = rows[a : a + block]
            texts = store._column_rows("text", r)
            encs = tok.encode_batch(texts, add_special_tokens=False)
            ids = [e.ids for e in encs]
            if add_eos:
                for x in ids:
                    x.append(eos_id)
            lens = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
            flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lens.sum()))
            out.write(flat.tobytes())
            rec_lens[a : a + len(r)] = lens
            n_tok += int(lens.sum())
            shown.update(len(r))
    rec_offsets = np.concatenate([[0], np.cumsum(rec_lens)]).astype(np.int64)
    rec_per_user = subset.sizes()
    if mode == "pack":
        # windows of seq_len over each user's stream; the last window may be shorter
        user_tok = np.add.reduceat(rec_lens, subset.rec_offsets[:-1]) if len(rec_lens) else np.zeros(0, np.int64)
        user_tok = np.where(rec_per_user > 0, user_tok, 0)
        n_win = -(-user_tok // seq_len)
        user_offsets = np.concatenate([[0], np.cumsum(n_win)]).astype(np.int64)
        user_start = np.concatenate([[0], np.cumsum(user_tok)])[:-1]
        starts = (
            np.repeat(user_start, n_win) + (np.arange(user_offsets[-1]) - np.repeat(user_offsets[:-1], n_win)) * seq_len
        )
        ends = np.minimum(starts + seq_len, np.repeat(user_start + user_tok, n_win))
        seq_offsets = np.concatenate([starts, ends[-1:]]).astype(np.int64) if len(starts) else np.zeros(1, np.int64)
        assert np.array_equal(seq_offsets[1:], ends)
    else:
        seq_offsets = rec_offsets
        user_offsets = subset.rec_offsets.astype(np.int64)
    np.save(tmp / "seq_offsets.npy", seq_offsets)
    np.save(tmp / "user_offsets.npy", user_offsets)
    np.save(tmp / "users.npy", subset.users.astype(np.int64))
    # each file's size and sha256: an entry is verified before it is read (_intact)
    files = {n: {"bytes": (tmp / n).stat().st_size, "sha256": sha256_file(tmp / n)} for n in ENTRY_FILES}
    meta = dict(meta, num_tokens=n_tok, files=files)
    (tmp / "meta.json").write_text(json.dumps(meta))  # written last: a folder with meta.json is whole
