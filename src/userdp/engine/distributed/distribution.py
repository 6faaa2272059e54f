"""How a step's work and its release are shared out across the processes of a job: the
*distribution* part of a run (``Performance.sharding`` names it; docs/scaling.md).

A distribution decides, for a step whose cohort every rank has drawn alike:

* how the model is held (:meth:`Replicated.prepare`: whole on every rank, or 1/W of it each) and
  which per-unit strategy can train it;
* how each rank's clipped sums accumulate over its chunks (:meth:`Replicated.accumulator`) and how
  many chunks every rank runs;
* where the step's one noise draw is made and how the noised sums reach every rank
  (:meth:`Replicated.release`);
* whether the host may draw the noise ahead, and whether a device may defer zeroing bad units.

The loop asks these questions and branches on none of them. :class:`Replicated` is the plain
data-parallel variant (the noise added once, on rank 0, to its partial sum before the all-reduce,
as Opacus's ``DistributedDPOptimizer`` does); :class:`Sharded` overrides the stages that differ
under FSDP2 (Opacus's distributed optimizers are such overrides too). A new distribution is one
class registered in :data:`DISTRIBUTIONS`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from userdp.engine import checkpoint as ckpt
from userdp.engine.contraction import defers_zeroing
from userdp.engine.distributed.processes import broadcast_module_state
from userdp.engine.distributed.sharding import (
    GatheredCoverage,
    check_shardable,
    chunks_per_rank,
    is_sharded,
    load_shards,
    optimizer_state_like,
    reduce_scatter,
    save_shards,
    scatter_from_main,
    shard_like,
    shard_model,
)
from userdp.engine.ghost.coverage import Coverage
from userdp.engine.noise.flat import DrawCursor
from userdp.engine.noise.gaussian import draw_dtype
from userdp.engine.noise.mechanism import IIDGaussian, check_contract
from userdp.engine.plugin_outputs import call as plugin_call
from userdp.engine.plugin_outputs import check_finite_release
from userdp.errors import UserError
from userdp.registry import Registry


class _WholeSums:
    """A replicated rank's running clipped sums: the first chunk's sums become the accumulators
    (no extra model-sized buffer), later chunks are added to them."""

    sink = None  # the per-unit strategy returns each chunk's whole sums

    def __init__(self, params: Sequence[torch.Tensor], dtype_of):
        self.params, self.dtype_of = params, dtype_of
        self.sums: list[torch.Tensor] | None = None

    def add(self, part: Sequence[torch.Tensor]) -> None:
        if self.sums is None:  # the strategy's sums are fresh: keep them (.to: no-op, same dtype)
            self.sums = [x.to(self.dtype_of(p.dtype)) for x, p in zip(part, self.params, strict=True)]
        else:
            for j, x in enumerate(part):
                self.sums[j] += x

    def result(self, device) -> list[torch.Tensor]:
        if self.sums is None:  # an empty cohort (Poisson can draw none): the sum is zero
            return [torch.zeros(p.shape, dtype=self.dtype_of(p.dtype), device=device) for p in self.params]
        return self.sums


class _ShardSums:
    """A sharded rank's running totals: each parameter's clipped sum is reduce-scattered to its
    shards as soon as the strategy forms it (the sink), so a rank holds 1/W of the model's sums."""

    def __init__(self, params: Sequence[torch.Tensor], dtype_of, acc: torch.dtype):
        self.params, self.dtype_of, self.acc = params, dtype_of, acc
        self.shards: list = [None] * len(params)

    def sink(self, j: int, x: torch.Tensor | None) -> None:
        if x is not None:
            r = reduce_scatter(x.to(self.acc), self.params[j])
            self.shards[j] = r if self.shards[j] is None else self.shards[j].add_(r)

    def add(self, part) -> None:  # the sink has them
        pass

    def result(self, device) -> list[torch.Tensor]:  # zero where no chunk ran: an empty cohort
        return [
            x if x is not None else torch.zeros_like(p, dtype=self.dtype_of(p.dtype))
            for x, p in zip(self.shards, self.params, strict=True)
        ]


class Replicated:
    """Every rank holds the whole model and computes the clipped sums of its share of the cohort;
    rank 0 adds the step's one noise draw to its partial sum, and the sums are all-reduced, so every
    rank gets the whole noised sum."""

    name = "none"
    #: whether every rank writes its own part of a checkpoint (else the main rank alone writes)
    every_rank_writes = False
    #: the ghost strategy's coverage-check part: the whole parameters are the tensors in use
    coverage = Coverage

    def check(self, config, model: torch.nn.Module, combiner) -> None:
        """Refuse, before anything is written, a model or a job this distribution cannot train."""

    def prepare(self, config, model: torch.nn.Module, combiner) -> None:
        """Make ``model`` ready to train under this distribution (replicated: nothing to do)."""

    def per_unit(self, asked: str) -> str:
        """The per-unit strategy this distribution trains with, given the one asked for."""
        return asked

    def check_params(self, params: Sequence[torch.Tensor]) -> None:
        if is_sharded(params):
            raise UserError(
                "the model's parameters are DTensors (fully_shard): set sharding='fsdp' (training.sharding: fsdp)"
            )

    def check_noise(self, noise) -> None:
        """Refuse, before any step, a noise mechanism this distribution cannot release with."""
        check_contract(noise)

    def noise_init(self, run):
        """The noise mechanism's state, on the rank that adds the draw (the main rank: the others hold
        none), over the whole sum."""
        if run.combiner.rank != 0:
            return None
        return run.noise.init(run.sum_numel, draw_dtype(run.sum_dtypes), run.device)

    def draws_ahead(self) -> bool:
        """Whether the main rank's host source may draw a step's noise while its sums are computed
        (a model-sized buffer)."""
        return True

    def chunks(self, cohort_size: int, world_size: int, chunk_size: int) -> int | None:
        """How many chunks every rank runs at least (None: as many as its units need)."""
        return None

    def lazy_zeroing(self, device: torch.device) -> bool:
        """Whether the strategy may leave bad units' rows unzeroed on ``device`` and have the step
        computed again where any unit was bad."""
        return defers_zeroing(device)

    def accumulator(self, params: Sequence[torch.Tensor], dtype_of, acc: torch.dtype) -> _WholeSums | _ShardSums:
        """The running sums of a rank's chunks: a ``sink`` the strategy hands each parameter's sum to
        (None: it returns them), ``add(part)`` for each chunk's sums, ``result(device)`` for the step's."""
        return _WholeSums(params, dtype_of)

    def release(self, run, sums: list[torch.Tensor], std: float) -> list[torch.Tensor]:
        """The step's noised sums on every rank: rank 0 adds one draw of N(0, std²) (in place; a
        plugin's release must be finite), then the sums are all-reduced."""
        if run.combiner.rank == 0 and std > 0:  # std is proportional to the noise multiplier: 0 when non-private
            sums, run.noise_state = plugin_call(
                "noise mechanism", run.noise, run.noise.update, sums, run.noise_state, std
            )
            check_finite_release(sums, run.noise)
        return run.combiner.all_reduce_sum(sums)

    def noise_state(self, run) -> dict:
        """The noise mechanism's state for a seeded run's checkpoint (every rank that writes calls it)."""
        return run.noise.state_dict(run.noise_state)

    def load_noise_state(self, run, state: dict) -> None:
        """Restore :meth:`noise_state`'s output, whatever distribution wrote it."""
        run.noise_state = run.noise.load_state(state, run.noise_state)

    def share_initial_state(self, combiner, run) -> None:
        """Rank 0's initial values on every rank (e.g. a randomly initialised preset, LoRA's random A)."""
        broadcast_module_state(combiner, run.model, extra=run.master if run.master is not run.params else ())

    # ---------------------------------------------------------------- the checkpoint's layout
    def split_state(self, run, optimizer: dict) -> tuple[dict, dict]:
        """(the optimizer's state dict for the checkpoint, the tensors this rank writes as shards by
        name): replicated, the whole state and no shards (the weights go in the state)."""
        return optimizer, {}

    def save_shards(self, run, st: dict, tensors: dict):
        """Write this rank's shards, naming their folder in ``st`` (None: nothing to write)."""
        return None

    def optimizer_state_like(self, optimizer: dict, held: list) -> dict:
        """A whole saved optimizer state laid out as this run holds its parameters."""
        return optimizer


class Sharded(Replicated):
    """FSDP2 (:mod:`userdp.engine.distributed.sharding`): each rank holds 1/W of every parameter; each
    parameter's clipped sum is reduce-scattered to its shards as it is formed; every rank runs as
    many chunks as the rank with the most units (FSDP's gathers are collectives); the noise is
    drawn once on rank 0, in the replicated run's order, a parameter at a time, and scattered."""

    name = "fsdp"
    every_rank_writes = True
    coverage = GatheredCoverage  # the forward uses the gathered tensors, not the shards

    def check(self, config, model: torch.nn.Module, combiner) -> None:
        check_shardable(config, model, combiner)

    def prepare(self, config, model: torch.nn.Module, combiner) -> None:
        """Every rank starts from rank 0's whole model, then keeps its 1/W of it (a model the caller
        sharded keeps its own shards)."""
        self.check(config, model, combiner)
        if not is_sharded(model.parameters()):
            broadcast_module_state(combiner, model)
            shard_model(model, combiner)

    def per_unit(self, asked: str) -> str:
        return "ghost" if asked == "auto" else asked

    def check_params(self, params) -> None:
        pass

    def check_noise(self, noise) -> None:
        super().check_noise(noise)
        own = type(noise).update is not IIDGaussian.update
        if own or not all(callable(getattr(noise, m, None)) for m in ("filter", "advance", "draws")):
            raise UserError(
                f"sharding='fsdp': the noise mechanism {type(noise).__name__} "
                + ("overrides update()" if own else "has no filter(), advance() or draws()")
                + " (a sharded step scatters the draw and filters each rank's shards); use sharding='none'"
            )

    def noise_init(self, run):
        """Every rank holds the state of its own shards' coordinates."""
        held = [x.to_local() for x in run.params]
        return run.noise.init(sum(t.numel() for t in held), draw_dtype(run.sum_dtypes), run.device)

    def draws_ahead(self) -> bool:  # a model-sized buffer; the shards' noise is read a parameter at a time
        return False

    def chunks(self, cohort_size: int, world_size: int, chunk_size: int) -> int | None:
        return chunks_per_rank(cohort_size, world_size, chunk_size)

    def lazy_zeroing(self, device) -> bool:  # the collectives run inside the chunks: every rank zeroes
        return False

    def accumulator(self, params, dtype_of, acc) -> _ShardSums:
        return _ShardSums(params, dtype_of, acc)

    def release(self, run, sums: list, std: float) -> list:
        """Add the step's noise to the shards of the totals (DTensors; every rank calls this): rank 0
        reads the source's draw in the replicated run's order, a parameter at a time
        (:class:`userdp.engine.noise.flat.DrawCursor`: the same numbers as the replicated ``update``),
        and scatters each parameter's normals to the ranks holding its shards; every rank filters its
        shards' normals with its own part of the mechanism's state and adds ``std`` times them: the
        numbers of the replicated run, coordinate by coordinate."""
        if std <= 0:
            return sums
        noise, dtype = run.noise, draw_dtype(run.sum_dtypes)
        main = run.combiner.rank == 0
        cursor = DrawCursor(noise.draws(run.sum_numel, run.sum_dtypes, run.device)) if main else None
        lo = 0
        for p, x in zip(run.params, sums, strict=True):
            local = x.to_local()
            full = cursor.take(p.numel(), dtype, local.device) if cursor is not None else None
            z = scatter_from_main(full, p, dtype).reshape(-1)  # the draw's dtype, as the replicated run's
            w = noise.filter(z, lo, run.noise_state).mul_(float(std))
            local.add_(w.to(local.dtype).view_as(local))  # rounded as add_piece rounds it
            lo += local.numel()
        if cursor is not None:
            cursor.finish()
        run.noise_state = noise.advance(run.noise_state)
        return sums

    def share_initial_state(self, combiner, run) -> None:  # done before sharding: the ranks now hold different shards
        pass

    def noise_state(self, run) -> dict:
        """The noise mechanism's state made whole: each rank holds its shards' part of each past noise
        vector, and the checkpoint keeps whole vectors (every rank calls it: an all-gather per
        parameter), so that a resume on any W, or on one process, lays them out its own way."""
        state = run.noise.state_dict(run.noise_state)
        if state.get("past"):
            state["past"] = [_whole_flat(run.params, w) for w in state["past"]]
        return state

    def load_noise_state(self, run, state: dict) -> None:
        """Restore a whole state, each rank keeping its own shards of the past noise vectors."""
        if state.get("past"):
            state = {**state, "past": [_local_flat(run.params, w) for w in state["past"]]}
        run.noise_state = run.noise.load_state(state, run.noise_state)

    def split_state(self, run, optimizer: dict) -> tuple[dict, dict]:
        """Each optimizer state laid out as its parameter (Adam's moments) replaced by
        :data:`userdp.engine.checkpoint.IN_SHARDS`, and those states with the masters by name, for the
        shards (``param/NAME``, ``optim/INDEX/KEY``); scalars (Adam's step) stay in the state dict."""
        held = [p for g in run.optimizer.param_groups for p in g["params"]]
        shards = {f"param/{n}": m.detach() for n, m in zip(run.per_unit.names, run.master, strict=True)}
        kept = {}
        for i, entry in optimizer["state"].items():
            shape = tuple(held[int(i)].shape)
            moved = {
                k for k, v in entry.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) == shape
            }
            shards.update({f"optim/{i}/{k}": entry[k] for k in moved})
            kept[i] = {k: ckpt.IN_SHARDS if k in moved else v for k, v in entry.items()}
        return {**optimizer, "state": kept}, shards

    def save_shards(self, run, st: dict, tensors: dict):
        st["shards"] = ckpt.shards_folder(run.step)
        return st["shards"], save_shards(tensors, ckpt.pending_folder(run.dir, st["shards"]))

    def optimizer_state_like(self, optimizer: dict, held: list) -> dict:
        return optimizer_state_like(optimizer, held)


def _whole_flat(params, local_flat: torch.Tensor) -> torch.Tensor:
    """A vector laid out as ``params``' local shards, flat, made whole (every rank calls it)."""
    from torch.distributed.tensor import DTensor

    out, lo = [], 0
    for p in params:
        local = p.to_local()
        piece = local_flat[lo : lo + local.numel()].view(local.shape).to(local.device)
        out.append(
            DTensor.from_local(piece, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor().cpu()
        )
        lo += local.numel()
    return torch.cat([t.reshape(-1) for t in out])


def _local_flat(params, whole_flat: torch.Tensor) -> torch.Tensor:
    """This rank's local shards, flat, of a whole vector laid out as ``params``."""
    from torch.distributed.tensor import DTensor

    out = []
    for p, piece in zip(params, whole_flat.split([p.numel() for p in params]), strict=True):
        shard = shard_like(piece.view(p.shape), p)
        out.append((shard.to_local() if isinstance(shard, DTensor) else shard).reshape(-1).cpu())
    return torch.cat(out)


def read_params(run, st: dict, held: list) -> dict:
    """A checkpoint's weights read into ``run``'s masters (in place) and its optimizer state (returned),
    laid out as this run holds them, whatever layout wrote them: a sharded run's shards
    (:func:`_read_shards`) or whole tensors (each rank keeping its shard of them where sharded).

    Raises:
        UserError: a whole saved tensor of another shape than the model's parameter."""
    if st.get("shards") is not None:
        return _read_shards(run, st, held)
    for name, m, v in zip(run.per_unit.names, run.master, st["params"], strict=True):
        if tuple(v.shape) != tuple(m.shape):
            raise UserError(
                f"cannot resume from {ckpt.path(run.dir)}: parameter {name} has shape "
                f"{tuple(v.shape)} there and {tuple(m.shape)} in this model"
            )
    with torch.no_grad():
        for m, v in zip(run.master, st["params"], strict=True):
            m.copy_(shard_like(v, m))
    return run.distribution.optimizer_state_like(st["optimizer"], held)


def _read_shards(run, st: dict, held: list) -> dict:
    """Read a sharded checkpoint's shards into ``run``'s masters (in place) and its optimizer states
    (returned: ``st["optimizer"]`` with each :data:`userdp.engine.checkpoint.IN_SHARDS` filled),
    whatever the run's layout: sharded on any W, or whole (``torch.distributed.checkpoint``
    reshards). Every rank of the run calls it."""
    template = {f"param/{n}": m.detach() for n, m in zip(run.per_unit.names, run.master, strict=True)}
    opt = {**st["optimizer"], "state": {}}
    for i, entry in st["optimizer"]["state"].items():
        opt["state"][i] = dict(entry)
        for k, v in entry.items():
            if isinstance(v, str) and v == ckpt.IN_SHARDS:
                opt["state"][i][k] = template[f"optim/{i}/{k}"] = torch.zeros_like(held[int(i)].detach())
    load_shards(template, os.path.join(run.dir, st["shards"]), f"cannot resume from {run.dir}")
    return opt


#: ``Performance.sharding`` (and ``training.sharding``) -> the distribution class; plugins register more
DISTRIBUTIONS: Registry = Registry("sharding", {"none": Replicated, "fsdp": Sharded})
