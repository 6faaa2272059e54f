"""Fully sharded training (FSDP2, ``torch.distributed.fsdp.fully_shard``; docs/scaling.md).

Under ``Performance(sharding="fsdp")`` each of the W ranks of a ``torch.distributed`` job holds
1/W of every parameter, of its gradient and of the optimizer's state: FSDP2 gathers a block's
weights for its forward and backward only. The private step is unchanged in what it releases:

- **Per-unit clipping** is the ghost strategy's (:mod:`userdp.engine.ghost`): it reads each
  layer's captured input and output gradient, never the weights, so its norms and clipped sums of a
  sharded model are the unsharded model's (tests/engine/test_fsdp.py).
- **One reduce-scatter per parameter and chunk** (:func:`reduce_scatter`: a ``Partial`` DTensor
  redistributed to the parameter's own placement): the ghost strategy hands each parameter's
  clipped sum over as soon as it is formed (its ``sink``), so a rank holds its shard's running total
  (1/W of the model, float32) and one parameter's whole sum at a time, never the model's whole sums.
- **The noise is drawn once for the whole vector**, on rank 0, in the replicated run's order and
  with its numbers, one parameter at a time (:class:`userdp.engine.noise.flat.DrawCursor`), and each
  parameter's noise is scattered to its shards (:func:`scatter_from_main`): the shards of the noise
  are one draw whatever W, and the key never leaves rank 0.
- **Every rank runs the same number of forward and backward passes** (FSDP's gathers are
  collectives): a rank with fewer units this step runs zero-weight padding chunks
  (:func:`chunks_per_rank`).

Only what no library does is written here: FSDP2 does the sharding, DTensor the reduce-scatter.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

from userdp.engine.ghost.coverage import Check, Coverage
from userdp.engine.ghost.factors import GhostUnsupported
from userdp.errors import UserError
from userdp.fileio import sha256_file


def is_sharded(params) -> bool:
    """Whether any of ``params`` is a DTensor shard (a model already passed through ``fully_shard``).
    None can be before DTensor's module is imported, so a run that does not shard never pays that
    import."""
    if "torch.distributed.tensor" not in sys.modules:
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)


def gathered_blocks(model: nn.Module) -> list[nn.Module]:
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
    _check_process_group(combiner)
    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in gathered_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _check_process_group(combiner) -> None:
    if not dist.is_initialized() or getattr(combiner, "world_size", 1) != dist.get_world_size():
        raise UserError(
            "sharding='fsdp' needs torch.distributed: launch with torchrun (a process group and the "
            "engine's TorchDistributedCombiner), or use sharding='none'"
        )


def unshardable(update: str, per_unit: str) -> str | None:
    """Why a run whose units' update is ``update`` (an algorithm's ``update``: ``"gradient"`` or
    ``"local_sgd"``) and whose per-unit strategy is ``per_unit`` cannot be sharded; None when it can.
    The one statement of these rules: the engine's check and the CLI's (before any work) read it."""
    if update != "gradient":
        return "a local-SGD update (FedAvg's) needs each user's whole model on one process"
    if per_unit not in ("auto", "ghost"):
        return f"clips per unit with the ghost strategy only (per_unit {per_unit!r} needs whole weights)"
    return None


def check_shardable(config, model: nn.Module, combiner) -> None:
    """Refuse, in one line each and before any work, what the sharded step does not do (yet), and a
    run with no process group.

    Raises:
        UserError: naming the setting."""
    why = unshardable(config.algorithm.update, config.performance.per_unit)
    if why:
        raise UserError(f"sharding='fsdp': {why}; use sharding='none' (or ULS/ELS with per_unit='auto' or 'ghost')")
    if any(p.requires_grad and p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters()):
        raise UserError(
            "sharding='fsdp' trains float32 parameters (bfloat16 or float16 weights would need sharded "
            "float32 masters): load the model in float32; precision='bfloat16' autocast is allowed"
        )
    _check_process_group(combiner)


def chunks_per_rank(cohort_size: int, world_size: int, chunk_size: int) -> int:
    """How many chunks every rank runs at a step whose cohort has ``cohort_size`` units: that of the
    rank with the most units (``ceil(cohort / W)``); the others pad with zero-weight chunks, so that
    FSDP's collectives in forward and backward pair up across ranks."""
    return math.ceil(math.ceil(cohort_size / world_size) / chunk_size)


def reduce_scatter(x: torch.Tensor, param):
    """Each rank's whole partial sum ``x`` of ``param``, reduced across ranks and scattered to the
    parameter's own shards: a DTensor of its placement (one reduce-scatter; every rank calls it)."""
    from torch.distributed.tensor import DTensor, Partial

    partial = DTensor.from_local(x, param.device_mesh, [Partial()] * len(param.placements), run_check=False)
    return partial.redistribute(param.device_mesh, param.placements)


def scatter_from_main(full: torch.Tensor | None, param, dtype: torch.dtype) -> torch.Tensor:
    """This rank's shard (a local tensor) of the main rank's whole tensor ``full`` laid out as
    ``param`` is (one scatter; every rank calls it; ``full`` is read on rank 0 only, None elsewhere):
    how a sharded step hands each rank its part of the one noise draw (the key stays on rank 0)."""
    from torch.distributed.tensor import distribute_tensor

    if full is None:
        full = torch.empty(param.shape, dtype=dtype, device=param.device)
    return distribute_tensor(full.view(param.shape), param.device_mesh, param.placements, src_data_rank=0).to_local()


def save_shards(tensors: dict, folder: str) -> dict:
    """Write ``tensors`` (name -> tensor: DTensor shards, or whole tensors) to ``folder`` with
    ``torch.distributed.checkpoint``, every rank its own shards (every rank calls it); returns every
    rank's files as ``{file: {"sha256", "bytes"}}`` (each rank hashes its own files; all ranks get
    the union), for the checkpoint's manifest. ``folder`` is emptied first (a failed attempt's)."""
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
    dist.barrier()
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(folder, sync_files=True))
    mine = {
        f: {"sha256": sha256_file(os.path.join(folder, f)), "bytes": os.path.getsize(os.path.join(folder, f))}
        for f in sorted(os.listdir(folder))
        if f.startswith(f"__{rank}_") or (rank == 0 and f == ".metadata")
    }
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for part in every for k, v in part.items()}


def load_shards(template: dict, folder: str, where: str) -> None:
    """Read a :func:`save_shards` folder into ``template``'s tensors, in place, whatever their layout
    (DTensor shards of any W, or whole tensors in one process): ``torch.distributed.checkpoint``
    reshards. Every rank of a process group calls it.

    Raises:
        UserError: a tensor the folder lacks, or of another shape (named, with ``where``)."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(folder)
    try:
        meta = reader.read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001 - an unreadable metadata file: one line
        raise UserError(f"{where}: unreadable sharded checkpoint ({type(exc).__name__})") from None
    for name, t in template.items():
        got = meta.get(name)
        if got is None or tuple(getattr(got, "size", ())) != tuple(t.shape):
            raise UserError(
                f"{where}: {name} is {'missing' if got is None else f'of shape {tuple(got.size)}'} "
                f"there and of shape {tuple(t.shape)} in this run"
            )
    with warnings.catch_warnings():  # one process with no group (a resume unsharded): what we intend
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(template, storage_reader=reader)


def whole(t):
    """``t`` itself, or the whole tensor of a DTensor shard (an all-gather: every rank calls it)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def shard_like(full: torch.Tensor, param) -> torch.Tensor:
    """The whole tensor ``full`` laid out as ``param`` is: a DTensor of its mesh and placements for a
    sharded parameter (every rank calls it, with the same ``full``), else ``full`` on its device."""
    if not hasattr(param, "device_mesh"):
        return full.to(param.device)
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)


def optimizer_state_like(state_dict: dict, params) -> dict:
    """An optimizer state dict of whole tensors (:func:`gathered`) with each per-parameter tensor of
    the parameter's shape laid out as the parameter (:func:`shard_like`); scalars (Adam's step) stay."""
    out = dict(state_dict)
    out["state"] = {}
    for idx, entry in state_dict["state"].items():
        p = params[int(idx)]
        out["state"][idx] = {
            k: shard_like(v, p) if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape) else v
            for k, v in entry.items()
        }
    return out


def _plain_class(module: nn.Module) -> type:
    """The class ``fully_shard`` derived ``type(module)`` from (itself for a module it did not shard)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if issubclass(c, nn.Module) and not issubclass(c, FSDPModule))


def _empty_like(model: nn.Module) -> nn.Module:
    """A model of ``model``'s (unsharded) class and architecture with its tensors on the meta device:
    a Hugging Face model from its config, a PEFT model as its base with the same adapters.

    Raises:
        UserError: neither (nothing to build the whole model from)."""
    try:  # an optional library: a PEFT model is one only where peft is installed
        from peft import PeftModel, get_peft_model
    except ImportError:
        PeftModel = get_peft_model = None
    with torch.device("meta"):  # no second copy in host memory, no random initialisation of it
        if PeftModel is not None and isinstance(model, PeftModel):
            base = model.get_base_model()
            peft = None
            for name, cfg in model.peft_config.items():
                if peft is None:
                    peft = get_peft_model(_plain_class(base)(base.config), cfg, adapter_name=name)
                else:
                    peft.add_adapter(name, cfg)
            return peft
        config = getattr(model, "config", None)
        if config is None:
            raise UserError(
                f"sharding='fsdp': cannot rebuild a whole {_plain_class(model).__name__} after training "
                "(not a Hugging Face or PEFT model with a config); gather it yourself with full_tensor()"
            )
        return _plain_class(model)(config)


def gathered_model(model: nn.Module) -> nn.Module:
    """A whole (unsharded) copy of a ``fully_shard``-ed Hugging Face or PEFT model, on every rank (an
    all-gather per tensor: every rank calls it); ``model`` itself when it is not sharded. What the
    phases after training (evaluation, the released model) run on.

    Raises:
        UserError: a sharded model that is not a Hugging Face ``PreTrainedModel`` (no config to
            build the whole copy from)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return model
    plain = _empty_like(model)
    state = {k: whole(v).detach() for k, v in model.state_dict().items()}
    plain.load_state_dict(state, assign=True)  # the gathered tensors become its parameters
    for name, buf in model.named_buffers():  # the buffers a state dict leaves out (rotary frequencies, ...)
        owner, _, leaf = name.rpartition(".")
        plain.get_submodule(owner)._buffers[leaf] = buf.detach().clone()
    if hasattr(plain, "tie_weights"):
        plain.tie_weights()  # tied weights (GPT-2's head) are one tensor again, as in the trained model
    plain.train(model.training)
    return plain


class GatheredCoverage(Coverage):
    """The coverage check on a sharded model: the parameters are DTensor shards and the forward uses
    the whole tensors FSDP2 gathers, so autograd's batch gradient is taken with respect to the
    gathered tensors the hooks saw in use (autograd gives None for the shards), each mapped back to
    the parameter it stands for. A rank compares a group of at most 1/W of the model at a time (the
    whole batch gradients of that group), so the check never holds the model's whole gradient; a
    padding chunk (no unit in it) proves nothing and checks nothing; a parameter no hook saw has no
    gathered tensor to compare and is refused."""

    def __init__(self, params: list, layers: list):
        super().__init__(params, layers)
        index = {id(p): j for j, p in enumerate(params)}
        # (layer, attribute) -> the parameter's index: while a module is unsharded its attribute holds
        # the gathered tensor (the root's stays so from its forward to its backward)
        self._owner = {
            (id(mod), n): index[id(p)]
            for mod in layers
            for n, p in mod.named_parameters(recurse=False)
            if id(p) in index
        }
        self._in_use: list = []  # (module, name, tensor in use) while a checked forward runs
        world = params[0].device_mesh.size()  # a DTensor's mesh
        self._budget = max(max(p.numel() for p in params), math.ceil(sum(p.numel() for p in params) / world))

    def saw(self, module) -> None:
        if not self.verified:
            self._in_use.extend((module, n, t) for n, t in module.named_parameters(recurse=False) if t.requires_grad)

    def start(self, weights: torch.Tensor) -> Check | None:
        in_use, self._in_use = self._in_use, []
        if self.verified or not bool(weights.any()):
            return None
        group: set[int] = set()
        size = 0
        for j in self.unchecked:
            n = self.params[j].numel()
            if group and size + n > self._budget:
                break
            group.add(j)
            size += n
        seen = {id(t): (mod, a, t) for mod, a, t in in_use}.values()
        picked = [(self._owner[(id(mod), a)], t) for mod, a, t in seen if self._owner.get((id(mod), a)) in group]
        return Check(group, [t for _, t in picked], [j for j, _ in picked])

    def unseen(self, name: str) -> None:
        raise GhostUnsupported(
            f"sharding=fsdp: parameter {name!r} is trainable but not used through the forward of a layer "
            "that owns it; freeze it (requires_grad=False) or use sharding: none"
        )
