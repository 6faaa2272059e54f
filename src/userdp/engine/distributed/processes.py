"""How the engine combines work across processes (``torch.distributed``; docs/scaling.md).

Per-unit work is independent: each rank computes the clipped updates of its share of the
step's units (``units[rank::world_size]``) and their sum. Two all-reduces per step combine them:

1. the step's **statistics** (a handful of float64 numbers: units, clipped count, the noisy
   centred count of adaptive clipping, the realized weight, ...), small and first, because the
   denominator may depend on the realized weight;
2. the **clipped sums**, in their own dtype (float32, or float64 for a float64 model — never
   widened: a model-sized float64 buffer would double the traffic and the memory), reduced
   in place in buckets of at most :data:`BUCKET_BYTES`.

The noise is drawn ONCE per step for the whole sum, on rank 0, and added to rank 0's partial
sum before the all-reduce (as Opacus's ``DistributedDPOptimizer`` does) — never once per rank,
which would add ``world_size`` independent noises. All ranks must agree on the cohort, so the
sampling generator is identical on every rank (the same seed, or rank 0's entropy broadcast at
start-up).

A combiner is any object with ``rank``, ``world_size``, ``all_reduce_sum(tensors)`` and
``broadcast_from_main(tensors)``; each returns one tensor per input, of the input's dtype,
shape and device (the torch combiner works in place: it returns its inputs, updated).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

#: the largest flat buffer a bucketed collective allocates (tensors beyond it go alone, in place)
BUCKET_BYTES = 32 << 20


class LocalCombiner:
    """One process: nothing to combine."""

    rank = 0
    world_size = 1

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(tensors)

    def broadcast_from_main(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return list(tensors)


def _buckets(tensors: Sequence[torch.Tensor], limit: int) -> list[list[int]]:
    """Indices of ``tensors`` grouped into runs of one dtype and device of at most ``limit`` bytes."""
    out: list[list[int]] = []
    size = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        prev = tensors[out[-1][-1]] if out else None
        if prev is None or prev.dtype != t.dtype or prev.device != t.device or size + nbytes > limit or nbytes > limit:
            out.append([i])
            size = nbytes
        else:
            out[-1].append(i)
            size += nbytes
    return out


class TorchDistributedCombiner:
    """All-reduce and broadcast over an initialized ``torch.distributed`` process group.

    Args:
        group: the process group (None: the default one).
        device: where the collectives run — a CUDA device under NCCL, the CPU under gloo.
            None: the CPU for gloo, else the current CUDA device. Inputs elsewhere are moved
            there and back.

    Raises:
        RuntimeError: torch.distributed is not initialized.
    """

    def __init__(self, group=None, device: torch.device | str | None = None):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized (call init_process_group first)")
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if device is None:
            gloo = dist.get_backend(group) == "gloo"
            device = torch.device("cpu") if gloo else torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)

    def _collective(self, tensors: Sequence[torch.Tensor], op) -> list[torch.Tensor]:
        out = list(tensors)
        for idx in _buckets(out, BUCKET_BYTES):
            first = out[idx[0]]
            here = first.device == self.device
            if len(idx) == 1 and here and first.is_contiguous():
                op(first)  # in place, no copy
                continue
            flat = torch.cat([out[i].reshape(-1) for i in idx]).to(self.device)
            op(flat)
            pos = 0
            for i in idx:
                n = out[i].numel()
                out[i].copy_(flat[pos : pos + n].view_as(out[i]))  # back in place (across devices too)
                pos += n
        return out

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The element-wise sum over ranks of each tensor (in its own dtype)."""
        return self._collective(
            tensors, lambda t: self._dist.all_reduce(t, op=self._dist.ReduceOp.SUM, group=self.group)
        )

    def broadcast_from_main(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Rank 0's value of each tensor, on every rank."""
        return self._collective(tensors, lambda t: self._dist.broadcast(t, src=self._main(), group=self.group))

    def _main(self) -> int:
        return self._dist.get_global_rank(self.group, 0) if self.group is not None else 0


def combiner_for(distributed: bool):
    """The combiner of a job: torch.distributed's across its processes, a no-op for one process."""
    return TorchDistributedCombiner() if distributed else LocalCombiner()


def broadcast_module_state(combiner, module: torch.nn.Module, extra: Sequence[torch.Tensor] = ()) -> None:
    """Give every rank rank 0's floating-point parameters and buffers of ``module`` (and the
    ``extra`` tensors, e.g. float32 master weights), in place: the ranks of a job must start from
    one model (a random initialisation differs per process)."""
    if combiner.world_size == 1:
        return
    with torch.no_grad():
        tensors = [p.data for p in module.parameters() if p.is_floating_point()]
        tensors += [b for b in module.buffers() if b.is_floating_point()] + [t.data for t in extra]
        for t, v in zip(tensors, combiner.broadcast_from_main(tensors), strict=True):
            if v is not t:
                t.copy_(v)
