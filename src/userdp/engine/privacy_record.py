"""The engine's privacy record: one frozen type, made once by the run, read by everyone after it.

:class:`PrivacyRecord` is what :func:`userdp.engine.train` returns as ``result.record``, what
``make_private(...).record()`` returns, and what the LM job serialises into ``privacy.json``
(under ``engine_record``, by :meth:`PrivacyRecord.to_dict`). The fields are typed and every one
is set by the run (none has a default the run could forget); the LM report renders and verifies
the file, it does not rebuild the record. It reads like the JSON it becomes
(``record["epsilon"]``, ``record.get("noise_tail")``: a read-only :class:`~collections.abc.Mapping`),
so scripts that index it keep working; a change is a new record (:meth:`PrivacyRecord.replace`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

#: fields that are written only when they apply (absent from :meth:`PrivacyRecord.to_dict` when None)
WHEN_THEY_APPLY = (
    "noise_tail",
    "warning",
    "epsilon_no_amplification",
    "epsilon_assuming_poisson",
    "sampling_warning",
    "stopped",
    "broken_build",
    "correlated_noise",
    "cycle",
)


@dataclass(frozen=True)
class PrivacyRecord(Mapping):
    """What one run released and how it was accounted (see the module docstring).

    The privacy facts: the algorithm and its unit, N and the units sampled from, the sampler (as
    run and as accounted), the noise (mechanism, accounted and update multipliers, the count
    query's std), the clipping and its final norm, the accountant, the steps (applied, accounted,
    lost to crashes), epsilon and delta with delta's rule, the target, the step's and the whole
    run's DpEvent (as dicts), the ledger journal it cites, how the randomness was keyed, and the
    counts used without noise. The computing facts (precision, per-unit strategy, noise kernel)
    are recorded beside them; they do not change the guarantee.
    """

    algorithm: dict
    unit: str
    num_users: int
    num_units: int
    expected_units_per_step: float
    denominator: float
    denominator_kind: str
    sampler_mode: str
    sampler: dict
    noise_mechanism: str
    noise_multiplier: float
    update_noise_multiplier: float
    count_noise_stddev: float | None
    clipping: dict
    final_clip_norm: float
    optimizer: dict
    accountant: str
    steps_applied: int
    steps_accounted: int
    steps_lost_to_crashes: int
    epsilon: float
    delta: float
    delta_rule: str
    target_epsilon: float | None
    calibrated: bool
    step_event: dict | None
    adjacency: str | None
    dp_event_total: dict | None
    journal: dict | None
    seeded: bool
    randomness: str
    noise_generator: str
    noise_kernel: str
    precision: dict
    per_unit: dict
    nonfinite_units: int
    nonfinite_units_note: str
    counts_treated_as_public: tuple[str, ...]
    # written only when they apply (WHEN_THEY_APPLY)
    noise_tail: dict | None = None
    warning: str | None = None
    epsilon_no_amplification: float | None = None
    epsilon_assuming_poisson: float | None = None
    sampling_warning: str | None = None
    stopped: str | None = None
    broken_build: str | None = None
    correlated_noise: dict | None = None
    cycle: dict | None = None

    def __post_init__(self):
        object.__setattr__(self, "counts_treated_as_public", tuple(self.counts_treated_as_public))

    @property
    def private(self) -> bool:
        """False for a run with noise_multiplier = 0 (no guarantee)."""
        return self.step_event is not None

    def replace(self, **changes) -> PrivacyRecord:
        """The same record with ``changes`` (e.g. ``stopped``)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The JSON form (``privacy.json``'s ``engine_record``): a deep copy, the fields that do
        not apply left out."""
        return {key: copy.deepcopy(self[key]) for key in self}

    # ------------------------------------------------------------ read-only Mapping
    def __getitem__(self, key: str) -> Any:
        if key not in _FIELD_NAMES or not self._applies(key):
            raise KeyError(key)
        value = getattr(self, key)
        return list(value) if key == "counts_treated_as_public" else value

    def __iter__(self) -> Iterator[str]:
        return (key for key in _FIELD_NAMES if self._applies(key))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def _applies(self, key: str) -> bool:
        return key not in WHEN_THEY_APPLY or getattr(self, key) is not None


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(PrivacyRecord))
