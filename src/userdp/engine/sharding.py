"""Fully sharded training (FSDP2, ``torch.distributed.fsdp.fully_shard``; docs/scaling.md, issue 37).

Under ``TrainConfig(sharding="fsdp")`` each of the W ranks of a ``torch.distributed`` job holds
1/W of every parameter, of its gradient and of the optimizer's state: FSDP2 gathers a block's
weights for its forward and backward only. The private step is unchanged in what it releases:

- **Per-unit clipping** is the ghost strategy's (:mod:`userdp.engine.ghost`): it reads each
  layer's captured input and output gradient, never the weights, so its norms and clipped sums of a
  sharded model are the unsharded model's (tests/test_engine_fsdp.py). Each rank's sums are whole
  (one float32 buffer the size of the model) until the release.
- **One collective per step for the sums**: a reduce-scatter (:func:`reduce_scatter_sums`: a
  ``Partial`` DTensor redistributed to the parameter's own placement) leaves on each rank the total
  of its shard, where the replicated run all-reduces the whole sum to every rank.
- **The noise is drawn once for the whole vector**, on rank 0, and added to rank 0's partial sum
  before the reduce-scatter, exactly as in the replicated run: the shards of the noised total are
  one draw whatever W.
- **Every rank runs the same number of forward and backward passes** (FSDP's gathers are
  collectives): a rank with fewer units this step runs zero-weight padding chunks
  (:func:`chunks_per_rank`).

Only what no library does is written here: FSDP2 does the sharding, DTensor the reduce-scatter.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from userdp.engine.ghost import has_dtensors
from userdp.errors import UserError

#: the choices of ``TrainConfig.sharding`` (and ``training.sharding``)
SHARDINGS = ("none", "fsdp")


def is_sharded(params) -> bool:
    """Whether any of ``params`` is a DTensor shard (a model already passed through ``fully_shard``)."""
    return has_dtensors(params)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one: those whose class a Hugging Face model lists in
    ``_no_split_modules`` (its transformer blocks), else none (the root holds every parameter)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names and m is not model]


def shard_model(model: nn.Module, combiner) -> None:
    """``fully_shard`` each block of ``model`` and then its root, in place, over the combiner's
    process group (a no-op for a model whose parameters are already DTensors).

    Raises:
        UserError: no ``torch.distributed`` process group (sharding needs one, even for W = 1)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if is_sharded(model.parameters()):
        return
    if not dist.is_initialized() or getattr(combiner, "world_size", 1) != dist.get_world_size():
        raise UserError("sharding='fsdp' needs torch.distributed: launch with torchrun (a process group and the "
                        "engine's TorchDistributedCombiner), or use sharding='none'")
    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in _blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def check_shardable(config, model: nn.Module, checkpoint_dir) -> None:
    """Refuse, in one line each and before any work, what the sharded step does not do (yet).

    Raises:
        UserError: naming the setting."""
    if config.algorithm.update != "gradient":
        raise UserError(f"sharding='fsdp': {type(config.algorithm).__name__}'s local SGD needs each user's whole "
                        "model on one rank; use sharding='none' (or ULS/ELS)")
    if config.per_unit not in ("auto", "ghost"):
        raise UserError(f"sharding='fsdp' clips per unit with the ghost strategy only (per_unit={config.per_unit!r} "
                        "needs whole weights): set per_unit='ghost' or 'auto'")
    if any(p.requires_grad and p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters()):
        raise UserError("sharding='fsdp' trains float32 parameters (bfloat16 or float16 weights would need sharded "
                        "float32 masters): load the model in float32; precision='bfloat16' autocast is allowed")
    if checkpoint_dir is not None:
        raise UserError("sharding='fsdp' does not write checkpoints yet (the sharded state would need "
                        "torch.distributed.checkpoint): train without a checkpoint directory, or use sharding='none'")


def chunks_per_rank(cohort_size: int, world_size: int, chunk_size: int) -> int:
    """How many chunks every rank runs at a step whose cohort has ``cohort_size`` units: that of the
    rank with the most units (``ceil(cohort / W)``); the others pad with zero-weight chunks, so that
    FSDP's collectives in forward and backward pair up across ranks."""
    return math.ceil(math.ceil(cohort_size / world_size) / chunk_size)


def reduce_scatter_sums(sums: list[torch.Tensor], params) -> list:
    """Each rank's whole partial sums, reduced across ranks and scattered to the parameters' own
    shards: one DTensor per parameter, of its placement (a reduce-scatter per tensor)."""
    from torch.distributed.tensor import DTensor, Partial

    out = []
    for x, p in zip(sums, params):
        partial = DTensor.from_local(x, p.device_mesh, [Partial()] * len(p.placements), run_check=False)
        out.append(partial.redistribute(p.device_mesh, p.placements))
    return out
