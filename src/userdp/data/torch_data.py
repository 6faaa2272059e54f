"""The engine adapter: a tokenized store as the engine's ``UserData`` (docs/ARCHITECTURE.md §2).

Batch keys: ``input_ids`` (long [n, L]) and ``labels`` (long [n, L], -100 on padding; the
causal LM shifts them). Sequences are right-padded with the tokenizer's pad id (EOS when it has
none); no attention mask is returned (a causal LM needs none for right padding,
and vmap cannot take one through HF's masking).

:class:`RandomChunkUserData` overrides ``draw_records`` with random-chunk selection (Chua et al. 2024, §4.1):
the user's records concatenated into one token stream, and a window of ``seq_len`` tokens at a
uniformly random offset, fresh on every draw.
"""

from __future__ import annotations

import numpy as np
import torch

from userdp.data.tokenize import TokenizedStore
from userdp.engine.data import Batch, UserData
from userdp.errors import UserError


class TokenizedUserData(UserData):
    """User u's records are the tokenized sequences of view user u (cut to ``seq_len``)."""

    def __init__(self, tokenized: TokenizedStore, seq_len: int | None = None):
        self.ts = tokenized
        self.seq_len = int(seq_len or tokenized.seq_len)
        sizes = tokenized.sizes().astype(np.int64)
        if len(sizes) == 0:
            raise UserError("the tokenized data holds no users")
        if (sizes < 1).any():
            bad = int(np.flatnonzero(sizes < 1)[0])
            raise UserError(f"user {bad} of the tokenized data has no sequences (drop empty users first)")
        self._sizes = sizes
        self.num_users = len(sizes)
        self.pad_id = int(tokenized.pad_id)

    def sizes(self) -> np.ndarray:
        return self._sizes

    def num_tokens(self) -> int:
        """Real (unpadded) tokens over all records, each cut to ``seq_len``."""
        return int(np.minimum(self.ts.seq_lengths(), self.seq_len).sum())

    def _batch(self, starts: np.ndarray, lengths: np.ndarray) -> Batch:
        L = self.seq_len
        lengths = np.minimum(lengths, L)
        pos = np.arange(L)[None, :]
        valid = pos < lengths[:, None]
        idx = np.where(valid, starts[:, None] + pos, 0)
        toks = np.asarray(self.ts.tokens[idx.reshape(-1)], dtype=np.int64).reshape(idx.shape) if idx.size else np.zeros(idx.shape, np.int64)
        input_ids = np.where(valid, toks, self.pad_id)
        labels = np.where(valid, toks, -100)
        return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels)}

    def gather(self, users: np.ndarray, records: np.ndarray) -> Batch:
        users = np.asarray(users, dtype=np.int64)
        records = np.asarray(records, dtype=np.int64)
        if users.shape != records.shape:
            raise ValueError("gather: users and records must have the same shape")
        if len(users) and ((records < 0).any() or (records >= self._sizes[users]).any()):
            raise IndexError("gather: record index out of range")
        seq = self.ts.user_offsets[users] + records
        starts = self.ts.seq_offsets[seq]
        return self._batch(starts, self.ts.seq_offsets[seq + 1] - starts)


class RandomChunkUserData(TokenizedUserData):
    """Random chunk: each draw is a ``seq_len`` window at a fresh random offset of the user's stream.

    Needs a tokenization whose user streams are contiguous (``full`` or ``pack`` mode). A user
    gets ``min(G, ceil(T_u / seq_len))`` windows (T_u = the user's tokens), each at an
    independent uniform offset in ``[0, max(0, T_u - seq_len)]``; the other slots are masked.
    """

    def __init__(self, tokenized: TokenizedStore, seq_len: int | None = None):
        if tokenized.mode not in ("full", "pack"):
            raise UserError("random-chunk selection needs a 'full' or 'pack' tokenization (whole user streams)")
        super().__init__(tokenized, seq_len)
        so, uo = tokenized.seq_offsets, tokenized.user_offsets
        self.stream_start = so[uo[:-1]]
        self.stream_len = so[uo[1:]] - self.stream_start

    def draw_records(self, users: np.ndarray, group_size: int, rng: np.random.Generator):
        users = np.asarray(users, dtype=np.int64)
        g = int(group_size)
        if g < 1:
            raise UserError(f"group size G must be >= 1, got {group_size}")
        L = self.seq_len
        T = self.stream_len[users]
        k = np.minimum(g, np.maximum(1, -(-T // L)))
        span = np.maximum(0, T - L)
        offs = np.floor(rng.random((len(users), g)) * (span[:, None] + 1)).astype(np.int64)
        mask = (np.arange(g)[None, :] < k[:, None]).astype(np.float32)
        starts = (self.stream_start[users][:, None] + offs).reshape(-1)
        lengths = np.repeat(np.minimum(T, L), g)
        flat = self._batch(starts, lengths)
        m = len(users)
        batch = {kk: v.reshape(m, g, L) for kk, v in flat.items()}
        return batch, torch.from_numpy(mask)


class RankedUserData(TokenizedUserData):
    """Fixed per-user preference order: record 0 of a user is its top-ranked sequence.

    ``draw_records`` returns each user's first ``min(G, n_u)`` ranked sequences (the same every
    call: longest / shortest / lowest or highest perplexity, Chua et al. 2024, §4.1); ``gather`` indexes in
    ranked order too, so an ELS table that takes records ``0..G-1`` of a user honours the choice.
    ``key`` has one entry per sequence of the view; lower keys rank first; ties keep dataset order.
    """

    def __init__(self, tokenized: TokenizedStore, key: np.ndarray, seq_len: int | None = None):
        super().__init__(tokenized, seq_len)
        key = np.asarray(key, dtype=np.float64)
        n_seq = int(tokenized.user_offsets[-1])
        if key.shape != (n_seq,):
            raise UserError(f"selection scores must have one entry per sequence ({n_seq}), got {key.shape}")
        if np.isnan(key).any():
            raise UserError("selection scores contain NaN")
        owner = np.repeat(np.arange(self.num_users), self._sizes)
        order = np.lexsort((np.arange(n_seq), key, owner))
        self._ranked = order - np.repeat(tokenized.user_offsets[:-1], self._sizes)  # within-user index

    def gather(self, users: np.ndarray, records: np.ndarray) -> Batch:
        users = np.asarray(users, dtype=np.int64)
        records = np.asarray(records, dtype=np.int64)
        if len(users) and ((records < 0).any() or (records >= self._sizes[users]).any()):
            raise IndexError("gather: record index out of range")
        mapped = self._ranked[self.ts.user_offsets[users] + records]
        return super().gather(users, mapped)

    def draw_records(self, users: np.ndarray, group_size: int, rng: np.random.Generator):
        users = np.asarray(users, dtype=np.int64)
        g = int(group_size)
        if g < 1:
            raise UserError(f"group size G must be >= 1, got {group_size}")
        n = self._sizes[users]
        rec = np.minimum(np.arange(g)[None, :], n[:, None] - 1)  # pad by repeating the last real one
        mask = (np.arange(g)[None, :] < n[:, None]).astype(np.float32)
        flat = self.gather(np.repeat(users, g), rec.reshape(-1))
        m = len(users)
        return {k: v.reshape(m, g, *v.shape[1:]) for k, v in flat.items()}, torch.from_numpy(mask)

    def bounded_records(self, group_size: int, rng: np.random.Generator):
        """ELS's D': each user's top min(G, n_u) ranked records (the same choice ULS draws)."""
        g = int(group_size)
        if g < 1:
            raise UserError(f"group size G must be >= 1, got {group_size}")
        counts = np.minimum(self._sizes, g).astype(np.int64)
        users = np.repeat(np.arange(self.num_users, dtype=np.int64), counts)
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        records = np.arange(int(counts.sum()), dtype=np.int64) - starts
        return users, records


SELECTIONS = ("random", "longest", "shortest", "highest_ppl", "lowest_ppl", "random_chunk")


def LMUserData(tokenized: TokenizedStore, selection: str = "random", seq_len: int | None = None,
               scores: np.ndarray | None = None) -> TokenizedUserData:
    """The engine's ``UserData`` for a tokenized store under a selection strategy (Chua et al. 2024, §4.1).

    - ``random``: the engine's default draw (uniform without replacement, fresh every call);
    - ``longest`` / ``shortest``: by the sequence's token length (in ``truncate`` mode lengths are
      capped at ``seq_len``; for exact lengths select before tokenizing with
      :func:`userdp.data.selection.bound_contributions` and ``record_token_lengths``);
    - ``highest_ppl`` / ``lowest_ppl``: ``scores`` = perplexity per sequence of this view
      (from :func:`userdp.data.selection.perplexity_scores`, whose ``DataTouch`` goes in the report);
    - ``random_chunk``: needs a ``full`` or ``pack`` tokenization.
    """
    if selection not in SELECTIONS:
        raise UserError(f"selection must be one of {', '.join(SELECTIONS)}, got {selection!r}")
    if selection == "random":
        return TokenizedUserData(tokenized, seq_len)
    if selection == "random_chunk":
        return RandomChunkUserData(tokenized, seq_len)
    if selection in ("longest", "shortest"):
        lens = tokenized.seq_lengths().astype(np.float64)
        return RankedUserData(tokenized, -lens if selection == "longest" else lens, seq_len)
    if scores is None:
        raise UserError(
            f"selection {selection!r} needs perplexities of the records (userdp.data.selection.perplexity_scores "
            "under the initial model); pass scores=..."
        )
    s = np.asarray(scores, dtype=np.float64)
    return RankedUserData(tokenized, -s if selection == "highest_ppl" else s, seq_len)
