"""How a run computes, apart from what it releases.

:class:`Performance` holds the choices that change a run's speed, memory and where its numbers are
computed, never its mechanism: the chunk of units a per-unit pass takes, the per-unit strategy, the
autocast precision, the distribution (replicated, or split over ranks), the checkpoint cadence and whether
epsilon is recomputed each step for the progress line. It rides on the
:class:`~userdp.engine.plan.TrainConfig` (``TrainConfig(..., performance=Performance(chunk_size=8))``)
but outside its equality and its ``repr``: a run's ledger journal and checkpoints are bound to the
config's ``repr`` (:func:`~userdp.engine.plan.privacy_repr`), so a resumed run may change any of these
and nothing else (jax_privacy keeps its execution plan's performance flags apart the same way).

A seeded run gives the same model whatever these say, up to the order of a float32 sum: a chunk
size or a distribution regroups the per-unit sums, and a precision rounds the forward differently.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from userdp.engine.distributed.distribution import DISTRIBUTIONS
from userdp.engine.per_unit import PER_UNIT_STRATEGIES
from userdp.engine.precision import PRECISIONS
from userdp.validation import check_bool, check_choice, check_fields, check_int, check_string


@dataclass(frozen=True)
class Performance:
    """The performance settings of a run (see the module docstring).

    ``chunk_size``: units per per-unit pass (memory against speed). ``per_unit``: the per-unit
    strategy (``"auto"`` or a name in :data:`~userdp.engine.per_unit.PER_UNIT_STRATEGIES`).
    ``precision``: the autocast dtype of the per-unit forward and backward (``float32``,
    ``bfloat16``, ``float16``; norms, sums and noise stay float32, :mod:`userdp.engine.precision`).
    ``sharding``: the distribution, ``"none"`` (every rank holds the whole model), ``"fsdp"``
    (FSDP2: each rank of a torchrun job holds 1/W of the parameters, gradients and optimizer state;
    :mod:`userdp.engine.distributed.sharding`) or a plugin's. ``checkpoint_every``: steps between
    checkpoints (0: none but the last). ``track_epsilon``: recompute the spent epsilon after each
    step for the callbacks (the ledger is kept either way).

    Raises:
        UserError: a value of the wrong type or out of range, or a name not registered.
    """

    chunk_size: int = 64
    per_unit: str = "auto"
    precision: str = "float32"
    sharding: str = "none"
    checkpoint_every: int = 0
    track_epsilon: bool = True

    def __post_init__(self):
        check_fields(
            self,
            chunk_size=(check_int, "chunk_size"),
            per_unit=(check_string, "per_unit"),
            precision=(check_string, "precision"),
            sharding=(check_string, "sharding"),
            checkpoint_every=(check_int, "checkpoint_every", 0),
            track_epsilon=(check_bool, "track_epsilon"),
        )
        if self.per_unit != "auto":
            PER_UNIT_STRATEGIES.lookup(self.per_unit)
        check_choice(self.precision, "precision", PRECISIONS)
        DISTRIBUTIONS.lookup(self.sharding)  # none, fsdp, or a plugin's distribution


#: the names of :class:`Performance`'s settings (a YAML config's ``training`` keys of the same names)
PERFORMANCE_FIELDS = tuple(f.name for f in fields(Performance))
