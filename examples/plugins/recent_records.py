"""A new algorithm in one file: ULS whose users contribute their G most recent records.

ULS draws up to G of a user's records afresh each step. Some data holders want each user's
update to reflect what the user wrote last (their G latest messages): that is a different unit
*update* over the same unit (a user), so the accounting is ULS's unchanged — the run plan derives
the mechanism from ``unit = "user"`` and the sampler, and this file touches nothing else.
Records are taken in store order (the order the data file lists them; sort it by time).

    # load this file, then
    train(model, data, loss_fn, TrainConfig(algorithm=ULSRecent(group_size=4, sampling_rate=0.1), ...))

    # or, with no edit to userdp:
    userdp train config.yaml --plugin examples/plugins/recent_records.py --set training.algorithm=uls_recent
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from userdp.engine import ALGORITHMS, ULS, register_algorithm


@dataclass(frozen=True)
class ULSRecent(ULS):
    """ULS over each user's last ``group_size`` records (fixed, not redrawn each step)."""

    name = "uls_recent"
    unit_text = "user (ULS over each user's G most recent records: their mean gradient, clipped once)"

    def load(self, data, table, ids, rng):
        """[m, G, ...] tensors of each user's last min(n_u, G) records, real records first, and the mask."""
        users = table.users[ids]
        g = int(self.group_size)
        n = data.sizes()[users].astype(np.int64)  # records per user
        take = np.minimum(n, g)
        slot = np.arange(g)[None, :]
        records = np.where(slot < take[:, None], n[:, None] - take[:, None] + slot, 0)  # padding reads record 0
        flat = data.gather(np.repeat(users, g), records.reshape(-1))
        batch = {k: v.reshape(len(users), g, *v.shape[1:]) for k, v in flat.items()}
        return batch, torch.from_numpy((slot < take[:, None]).astype(np.float32))


if ULSRecent.name not in ALGORITHMS:  # importing this file twice registers it once
    register_algorithm(ULSRecent)
