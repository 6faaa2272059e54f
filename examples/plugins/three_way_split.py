"""A new distribution in one file: three ranks' work, dealt out in one process.

A distribution decides how a step's clipped sums accumulate and how the noised sum reaches every
rank (userdp.engine.distributed.distribution). This one stands in for a data-parallel job of three ranks
without starting any: the step's chunks are dealt to three partial sums in turn (as three ranks
would each sum their share), the step's one noise draw is added to the first partial sum only (as
rank 0 adds it before the all-reduce), and the partial sums are added in rank order (the
all-reduce). What it releases is the replicated run's noised sum, up to the order of float32
additions; a test holds it to the neighbour bound and to the replicated model.

    userdp train config.yaml --plugin examples/plugins/three_way_split.py --set training.sharding=three_way_split
"""

from __future__ import annotations

import torch

from userdp.engine.distributed.distribution import DISTRIBUTIONS, Replicated
from userdp.engine.plugin_outputs import call as plugin_call
from userdp.engine.plugin_outputs import check_finite_release

RANKS = 3


class _Dealt:
    """Three partial sums; chunk k goes to partial k mod 3."""

    sink = None

    def __init__(self, params, dtype_of):
        self.params, self.dtype_of, self.partials, self.chunks = params, dtype_of, [None] * RANKS, 0

    def add(self, part) -> None:
        r = self.chunks % RANKS
        self.chunks += 1
        if self.partials[r] is None:
            self.partials[r] = [x.to(self.dtype_of(p.dtype)) for x, p in zip(part, self.params, strict=True)]
        else:
            for acc, x in zip(self.partials[r], part, strict=True):
                acc += x

    def result(self, device) -> list:
        zeros = [torch.zeros(p.shape, dtype=self.dtype_of(p.dtype), device=device) for p in self.params]
        return [sums if sums is not None else [z.clone() for z in zeros] for sums in self.partials]


class ThreeWaySplit(Replicated):
    """Three ranks' partial sums in one process (see the module docstring)."""

    name = "three_way_split"

    def draws_ahead(self) -> bool:
        return False

    def accumulator(self, params, dtype_of, acc) -> _Dealt:
        return _Dealt(params, dtype_of)

    def release(self, run, sums, std):
        first, *rest = sums
        if std > 0:  # rank 0 alone adds the step's one draw, before the all-reduce
            first, run.noise_state = plugin_call(
                "noise mechanism", run.noise, run.noise.update, first, run.noise_state, std
            )
            check_finite_release(first, run.noise)
        for partial in rest:  # the all-reduce, in rank order
            for total, x in zip(first, partial, strict=True):
                total += x
        return first


if ThreeWaySplit.name not in DISTRIBUTIONS:  # importing this file twice registers it once
    DISTRIBUTIONS.register(ThreeWaySplit, name=ThreeWaySplit.name)
