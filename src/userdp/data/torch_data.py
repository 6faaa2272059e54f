"""The engine adapter: a tokenized store as the engine's ``UserData`` (docs/ARCHITECTURE.md §2).

Batch keys: ``input_ids`` (long [n, L]) and ``labels`` (long [n, L], -100 on padding; the
causal LM shifts them). Sequences are right-padded with the tokenizer's pad id (EOS when it has
none); no attention mask is returned (SHARP_EDGES: a causal LM needs none for right padding,
and vmap cannot take one through HF's masking).

:class:`RandomChunkUserData` overrides ``draw_records`` with random-chunk selection (SPEC §5.4):
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
