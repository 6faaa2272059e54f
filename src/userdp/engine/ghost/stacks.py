"""Parameters of one shape stacked and handled as one (launches: the package docstring): the
materialized-only vectors by size (:func:`vector_groups`), the single-use dense ghosts by their
factors' shapes (:func:`factor_groups`, :class:`FactorStack`), each group capped by
:data:`GROUP_ELEMENTS`."""

from __future__ import annotations

import torch

from userdp.engine import contraction as cx
from userdp.engine.ghost import bound, grams
from userdp.engine.ghost.factors import Factored
from userdp.engine.rounding import unit_roundoff

#: the most elements a stacked group's largest temporary may hold (64 MB in float32): groups form where
#: a chunk's per-layer kernels are small (launch-bound), and a chunk whose layers are big enough to
#: fill the device on their own keeps one layer at a time, so stacking never adds much memory
GROUP_ELEMENTS = 1 << 24


def _cap_groups(by_key: dict, per_member: dict) -> list[list[int]]:
    """Split each key's members into groups of at most ``GROUP_ELEMENTS // per_member[key]``, keeping
    those of two or more; ``GROUP_ELEMENTS = 0`` stacks nothing (one parameter at a time, the
    reference the tests compare with)."""
    if GROUP_ELEMENTS <= 0:
        return []
    groups: list[list[int]] = []
    for key, members in by_key.items():
        cap = max(1, GROUP_ELEMENTS // max(1, per_member[key]))
        groups.extend(g for g in (members[i : i + cap] for i in range(0, len(members), cap)) if len(g) > 1)
    return groups  # a group of one would only copy its member: it is left to the per-parameter path


def vector_groups(dense: list, factored: list, m: int) -> list[list[int]]:
    """Indices of the parameters with a materialized part only, grouped by (size, dtype): each group
    is stacked ``[m, k, size]`` so its norms and clipped sums take a few kernels, not a few per
    parameter (GPT-2 small: 98 biases and LayerNorm vectors in 3 groups)."""
    by_key: dict = {}
    per_member: dict = {}
    for j, (d, fs) in enumerate(zip(dense, factored, strict=True)):
        if d is not None and not fs:
            key = (d[0].numel(), d.dtype)
            by_key.setdefault(key, []).append(j)
            per_member[key] = m * key[0]
    return _cap_groups(by_key, per_member)


#: where single-use dense ghosts are stacked: "auto" follows the device (CUDA, and the meta device
#: that stands in for it in the tests: launches cost there); on the CPU, which has no launch to save,
#: a batched product over a stack measured slower than one product per layer (gpt2-small, ELS: 2.27 s
#: against 2.01 s of GEMM a chunk), so it keeps one layer at a time. Tests force "on".
STACK_FACTORS = "auto"


def stack_factors(device: torch.device) -> bool:
    return STACK_FACTORS == "on" or (STACK_FACTORS == "auto" and device.type in cx.TC_DEVICES)


def factor_groups(dense: list, factored: list, m: int) -> list[list[int]]:
    """Indices of the parameters whose one use is a dense ghost (no materialized part, not an
    embedding), grouped by the shapes and dtypes of their factors: the twelve ``c_fc`` of GPT-2
    small, say. A group's Gram matrices and clipped sums are then one batched product each
    (where :data:`STACK_FACTORS` says so)."""
    by_key: dict = {}
    per_member: dict = {}
    for j, (d, fs) in enumerate(zip(dense, factored, strict=True)):
        if d is None and len(fs) == 1 and not fs[0].index and stack_factors(fs[0].y.device):
            f = fs[0]
            key = (tuple(f.x.shape), tuple(f.y.shape), f.x.dtype, f.y.dtype, f.compute_dtype, f.tc)
            by_key.setdefault(key, []).append(j)
            _, t, wx = f.x.shape
            per_member[key] = m * t * max(t, wx, 2 * f.y.shape[2])  # Grams; x upcast; c·y split in two
    return _cap_groups(by_key, per_member)


class FactorStack:
    """A group of single-use dense ghosts stacked ``[k, m, T, ·]``: one batched Gram product per
    factor for the group's norms, one batched product for its clipped sums. Stacking replaces each
    member's factors by views of the stack, one factor at a time, so the originals are freed as the
    copies are made."""

    def __init__(self, members: list[int], factored: list):
        self.members = members
        f0 = factored[members[0]][0]  # the members share shapes, dtypes and the tensor-core setting
        self.size_x, self.dtype, self.tc, self.narrow = f0.size_x, f0.dtype, f0.tc, f0.narrow
        x = torch.stack([factored[j][0].x for j in members])
        for i, j in enumerate(members):
            factored[j] = [Factored(x[i], factored[j][0].y, self.size_x, False, self.dtype, self.tc)]
        y = torch.stack([factored[j][0].y for j in members])
        for i, j in enumerate(members):
            factored[j] = [Factored(x[i], y[i], self.size_x, False, self.dtype, self.tc)]
        self.x, self.y = x, y

    def norm2(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list | None]:
        """``[k, m]`` each: the members' squared per-unit norms, their rounding-error bounds, their
        magnitudes and, with the rounded operand, each member's spread term (else None; the stack as
        k·m units of one use; see :func:`inner`)."""
        k, m = self.x.shape[:2]
        flat = Factored(
            self.x.reshape(k * m, *self.x.shape[2:]),
            self.y.reshape(k * m, *self.y.shape[2:]),
            self.size_x,
            False,
            self.dtype,
            self.tc,
        )
        value, err = grams.inner(flat, flat)
        mag, smag = grams.magnitude(flat)
        spread = grams.spread_term(flat).split(k) if flat.rounds_operand else None
        return value.view(k, m), err.view(k, m), (mag * smag).view(k, m), spread

    def bounds(self) -> list[bound.Bound]:
        """Each member's norm and what bounds a unit's contribution to its sum
        (:class:`~userdp.engine.ghost.bound.Bound`), from :meth:`norm2`: the clipped sum contracts
        m·T terms at the stack's unit roundoff, its operand rounded as
        :func:`~userdp.engine.contraction.operand_roundoff` says."""
        value, err, mag, spread = self.norm2()
        k_len = int(self.x.shape[1]) * int(self.y.shape[2])
        u = unit_roundoff(self.dtype or self.y.dtype, self.narrow)
        r = cx.operand_roundoff(self.narrow)
        return [
            bound.Bound(value[i], err[i], mag[i], k_len, u, None, r, None if spread is None else [spread[i]])
            for i in range(len(self.members))
        ]

    def weighted_sums(self, c: torch.Tensor, bad: torch.Tensor | None) -> torch.Tensor:
        """``[k, X, Y]``: each member's ``Σ_u c[u, member] · (unit u's gradient)``, units ``bad`` zeroed
        (masked_fill writes the zeros, so a non-finite unit cannot turn the sum into NaN; None: no unit
        is bad). ``c`` ``[m, L]``: on tensor cores already rounded down to bf16 numbers, as one use's are."""
        x, y = self.x, self.y
        if bad is not None:  # y's rows are zeroed where the contraction reads them
            x = x.masked_fill(bad.view(1, -1, 1, 1), 0)
        del self.x, self.y  # the stack's tensors go with this sum
        cg = torch.stack([c[:, j] for j in self.members])  # [k, m]
        return cx.clipped_contraction(x, y, cg, self.narrow, self.dtype or y.dtype, bad)
