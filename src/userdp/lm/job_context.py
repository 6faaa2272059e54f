"""What the phases of one ``userdp train`` job share, as two objects instead of loose arguments:
:class:`JobContext` (where the job writes, which process this is, how it talks, what the phases
note for the report) and :class:`JobData` (the data phase's results). The plan the phases train
by is the :class:`~userdp.lm.job_plan.JobPlan`; these hold everything else."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from userdp.lm.prepare import Log, Prepared
from userdp.lm.run_dir import RunDir


@dataclasses.dataclass(frozen=True)
class Launch:
    """How a job was launched, beyond its config: what ``userdp train`` (or ``userdp audit``) brings
    to :func:`userdp.lm.finetune.run`, and an API caller seldom needs.

    ``world``: the job's processes (:func:`userdp.world.init_world`; None: one process).
    ``plan_file``: a plan saved by ``userdp plan`` to apply (``--plan``).
    ``audit``: the empirical audit's hooks, needed when ``audit.canaries > 0``: a factory
    ``audit(audit_cfg, run_root, resume=, log=, steps_begun=)`` returning a session
    (``userdp.audit.session.AuditSession``); the LM job does not import the audit, a layer above it."""

    world: Any = None
    plan_file: str | None = None
    audit: Any = None


@dataclasses.dataclass(frozen=True)
class JobContext:
    """One job's surroundings, frozen: a phase that adds to them returns what it adds, and the job
    goes on with a new context (:meth:`with_`, :meth:`noted`), so each field is set once and a phase
    cannot change what an earlier one read. ``rd`` and ``audit`` come when the run directory is made
    (or found, on resume); ``device`` before the data; ``combiner`` when the model is placed on its
    device; ``notes`` are what the phases tell the report (the tokenizer folder, the chunk size's
    choice, ...), read-only."""

    world: Any  # userdp.world.World: this process among the job's
    log: Log
    progress: bool
    plan_file: str | None = None  # --plan
    resume_dir: str | None = None  # --resume
    rd: RunDir | None = None
    audit: Any = None  # the audit session (None: no canaries)
    engine_resume: bool = False  # the engine has a checkpoint to continue from
    combiner: Any = None  # sums across processes (None: one process)
    device: Any = None  # torch.device: model.device, resolved once before any data is read
    notes: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    t_start: float = dataclasses.field(default_factory=time.time)

    @property
    def main(self) -> bool:
        """Whether this process writes (rank 0, or the only one)."""
        return self.world.is_main

    def with_(self, **fields) -> JobContext:
        """This context with ``fields`` set (what a phase adds)."""
        return dataclasses.replace(self, **fields)

    def noted(self, notes: Mapping[str, Any] | None = None, **more) -> JobContext:
        """This context with ``notes`` and ``more`` added to its notes (a later note of the same name
        replaces an earlier one)."""
        return dataclasses.replace(self, notes=MappingProxyType({**self.notes, **(notes or {}), **more}))


@dataclasses.dataclass(frozen=True)
class JobData:
    """The data phase's results: the split and its counts, the tokenizer, the tokenized views."""

    prep: Prepared
    tok: Any
    train: Any
    eval: Any
