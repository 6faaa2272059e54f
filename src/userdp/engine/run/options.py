"""How one run is kept and watched: its checkpoint folder, the processes it runs on, the facts its
journal is bound to and the caller's hooks (:class:`RunOptions`).

None of it changes what a run releases: the privacy of a run is its :class:`~userdp.engine.plan.RunPlan`
(made from a :class:`~userdp.engine.plan.TrainConfig`). :func:`userdp.engine.train` and
:func:`userdp.engine.make_private` take both, as jax_privacy's trainers take an execution plan
beside their checkpointing and callbacks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from userdp.errors import UserError
from userdp.validation import check_bool, check_callable, check_instance


@dataclass(frozen=True)
class RunOptions:
    """Where a run keeps its state, which processes run it and whom it tells.

    ``checkpoint_dir``: where the ledger's journal and the checkpoints go (None: the ledger lives
    in memory only); ``resume``: continue the run in it. ``combiner``: the job's processes
    (:mod:`userdp.engine.distributed.processes`; None: one process). ``journal_context``: facts (e.g. config
    and data fingerprints) the journal is bound to; a resume with other facts is refused.
    ``callbacks``: each gets every step's metrics dict. ``checkpoint_extra(run) -> {name:
    writer(path)}``: files committed with each checkpoint as one unit (:mod:`userdp.engine.checkpoint`).
    ``on_start(info)``: called once before the first step with what the run will do. The last three
    are :func:`~userdp.engine.train`'s (a loop of one's own, ``make_private``, is its own caller).

    Raises:
        UserError: a field of the wrong kind, named in one line.
    """

    checkpoint_dir: str | os.PathLike | None = None
    resume: bool = False
    combiner: Any = None
    journal_context: Mapping[str, Any] | None = None
    callbacks: Sequence[Callable[[dict], Any]] = ()
    checkpoint_extra: Callable[[Any], dict] | None = None
    on_start: Callable[[dict], Any] | None = None

    def __post_init__(self):
        check_bool(self.resume, "resume")
        if self.journal_context is not None:
            check_instance(self.journal_context, "journal_context", Mapping, "a dict of facts (or None)")
        if self.checkpoint_dir is not None:
            check_instance(self.checkpoint_dir, "checkpoint_dir", (str, os.PathLike), "a directory path (or None)")
            path = os.fspath(self.checkpoint_dir)
            if not path:
                raise UserError("checkpoint_dir must be a directory path (got an empty string)")
            if os.path.exists(path) and not os.path.isdir(path):
                raise UserError(f"checkpoint_dir {path} exists and is not a directory")
            object.__setattr__(self, "checkpoint_dir", path)
        if self.resume and self.checkpoint_dir is None:
            raise UserError("resume=True needs a checkpoint_dir")
        if isinstance(self.callbacks, (str, bytes)) or not hasattr(self.callbacks, "__iter__"):
            raise UserError(f"callbacks must be a sequence of callables (got {type(self.callbacks).__name__})")
        object.__setattr__(self, "callbacks", tuple(self.callbacks))
        for i, cb in enumerate(self.callbacks):
            check_callable(cb, f"callbacks[{i}]")
        for name in ("checkpoint_extra", "on_start"):
            if getattr(self, name) is not None:
                check_callable(getattr(self, name), name)

    @property
    def hooks(self) -> list[str]:
        """The names of the hooks that are set (those only :func:`~userdp.engine.train` calls)."""
        return [n for n in ("callbacks", "checkpoint_extra", "on_start") if getattr(self, n)]


def run_options(options) -> RunOptions:
    """``options`` checked: a :class:`RunOptions`, or None for the defaults.

    Raises:
        UserError: anything else."""
    if options is None:
        return RunOptions()
    check_instance(options, "options", RunOptions, "a userdp.engine.RunOptions (or None)")
    return options
