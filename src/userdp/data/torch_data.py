"""The engine adapter: a tokenized store as the engine's ``UserData`` (docs/ARCHITECTURE.md §2).

Batch keys: ``input_ids`` (long [n, L]) and ``labels`` (long [n, L], -100 on padding; the
causal LM shifts them). Sequences are right-padded with the tokenizer's pad id (EOS when it has
none); no attention mask is returned (a causal LM needs none for right padding,
and vmap cannot take one through HF's masking).

The record selection strategies (ranked, random chunk) subclass it in :mod:`userdp.data.selection`.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from userdp.data.tokenize import TokenizedStore
from userdp.engine.user_data import Batch, UserData
from userdp.errors import UserError


class TokenizedUserData(UserData):
    """User u's records are the tokenized sequences of view user u (cut to ``seq_len``)."""

    #: a statement of the non-private touch of the data that chose its records (perplexity-based
    #: selection, :func:`userdp.lm.prepare.build_datasets`), for the report; None: none
    data_touch: str | None = None

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

    def fingerprint(self) -> bytes:
        """The tokenized store's arrays (tokens, offsets, store user numbers) and the layout."""
        ts = self.ts
        h = hashlib.sha256(f"{self.seq_len}|{self.pad_id}|{ts.mode}|".encode())
        for a in (ts.users, ts.user_offsets, ts.seq_offsets):
            h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        tokens = ts.tokens
        for start in range(0, len(tokens), 1 << 24):  # a memory-mapped file: read in pieces
            h.update(np.ascontiguousarray(tokens[start : start + (1 << 24)]).tobytes())
        return h.digest()

    def num_tokens(self) -> int:
        """Real (unpadded) tokens over all records, each cut to ``seq_len``."""
        return int(np.minimum(self.ts.seq_lengths(), self.seq_len).sum())

    def _batch(self, starts: np.ndarray, lengths: np.ndarray) -> Batch:
        L = self.seq_len
        lengths = np.minimum(lengths, L)
        pos = np.arange(L)[None, :]
        valid = pos < lengths[:, None]
        idx = np.where(valid, starts[:, None] + pos, 0)
        toks = (
            np.asarray(self.ts.tokens[idx.reshape(-1)], dtype=np.int64).reshape(idx.shape)
            if idx.size
            else np.zeros(idx.shape, np.int64)
        )
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
