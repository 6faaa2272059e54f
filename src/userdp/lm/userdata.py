"""The LM batch view of a tokenized user store: ``input_ids`` and ``labels`` (-100 on padding).

``userdata(tstore, ...)`` returns the engine's ``UserData`` for a ``TokenizedStore``. It uses
``userdp.data.torch_data`` (the data layer's adapter, with its selection strategies) when that
module provides one; otherwise the minimal adapter below, which pads each record to
``seq_len`` on the right and draws records uniformly without replacement (the engine's
default ``draw_records``).
"""

from __future__ import annotations

import numpy as np
import torch

from userdp.engine.data import UserData
from userdp.errors import UserError

IGNORE_INDEX = -100


class TokenizedUserData(UserData):
    """Records of a ``truncate``-mode TokenizedStore, right-padded to ``seq_len``."""

    def __init__(self, tstore, seq_len: int | None = None):
        if tstore.mode not in ("truncate", "pack"):
            raise UserError(f"LM batches need a truncate- or pack-mode tokenization, got {tstore.mode!r}")
        self.t = tstore
        self.seq_len = int(seq_len or tstore.seq_len)
        self._sizes = np.diff(tstore.user_offsets).astype(np.int64)
        if (self._sizes < 1).any():
            raise UserError("a user of the tokenized view has no records")
        self.num_users = int(len(self._sizes))
        self.pad_id = int(tstore.pad_id)

    def sizes(self) -> np.ndarray:
        return self._sizes

    def gather(self, users, records):
        users = np.asarray(users, dtype=np.int64)
        records = np.asarray(records, dtype=np.int64)
        seqs = self.t.user_offsets[users] + records
        L = self.seq_len
        ids = np.full((len(seqs), L), self.pad_id, dtype=np.int64)
        lab = np.full((len(seqs), L), IGNORE_INDEX, dtype=np.int64)
        starts = self.t.seq_offsets[seqs]
        ends = np.minimum(self.t.seq_offsets[seqs + 1], starts + L)
        for i, (a, b) in enumerate(zip(starts, ends)):  # numpy copies; no model work here
            x = np.asarray(self.t.tokens[a:b], dtype=np.int64)
            ids[i, : len(x)] = x
            lab[i, : len(x)] = x
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(lab)}

    def num_tokens(self) -> int:
        return int(np.minimum(np.diff(self.t.seq_offsets), self.seq_len).sum())


def userdata(tstore, seq_len: int | None = None, selection: str = "random", scores=None) -> UserData:
    try:
        from userdp.data import torch_data  # the data layer's adapter, when present
    except ImportError:
        torch_data = None
    if torch_data is not None and hasattr(torch_data, "LMUserData"):
        return torch_data.LMUserData(tstore, selection=selection, seq_len=seq_len, scores=scores)
    if selection != "random":
        raise UserError(f"training.selection = {selection!r} needs userdp.data.torch_data "
                        "(not available in this build); use random")
    return TokenizedUserData(tstore, seq_len)
