"""Where the engine would combine work across processes (torch.distributed).

Per-unit work is independent: each rank computes the clipped updates of its share of the
step's units (``units[rank::world_size]``) and their sum. The clipped sum (plus a few scalar
statistics) is the ONLY thing combined, by one all-reduce. The noise is drawn ONCE per step for
the whole sum, on rank 0, and broadcast — never once per shard (per-shard draws would add
world_size independent noises, i.e. sqrt(world_size) times the accounted std, or, worse, let
each shard's noise be smaller than accounted).

All ranks must agree on the cohort, so the sampling generator must be identical on every rank
(the caller passes the same seed, or rank 0's entropy broadcast at start-up).
"""

from __future__ import annotations

from typing import Sequence

import torch


class LocalCombiner:
    """One process: nothing to combine."""

    rank = 0
    world_size = 1

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(tensors)

    def broadcast_from_main(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(tensors)


class TorchDistributedCombiner:
    """All-reduce of the clipped sum over an initialized ``torch.distributed`` process group."""

    def __init__(self, group=None):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized (call init_process_group first)")
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    @staticmethod
    def _flat(tensors):
        dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else tensors[0].dtype
        return torch.cat([t.reshape(-1).to(dtype) for t in tensors])

    @staticmethod
    def _split(flat, tensors):
        out, i = [], 0
        for t in tensors:  # each back to its own dtype and shape
            out.append(flat[i : i + t.numel()].to(t.dtype).view_as(t))
            i += t.numel()
        return out

    def all_reduce_sum(self, tensors):
        flat = self._flat(tensors)
        self._dist.all_reduce(flat, op=self._dist.ReduceOp.SUM, group=self.group)
        return self._split(flat, tensors)

    def broadcast_from_main(self, tensors):
        flat = self._flat(tensors)
        self._dist.broadcast(flat, src=0, group=self.group)
        return self._split(flat, tensors)
