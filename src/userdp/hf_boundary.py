"""The Hugging Face boundary: what a Trainer script hands :class:`userdp.hf.PrivateTrainer` (and
TRL's prepared rows) is checked here, in one place, before any step is counted.

Each refusal is one line naming the argument by the Trainer's own name for it (``train_dataset``,
``TrainingArguments.output_dir``, ``resume_from_checkpoint``) and what to do. The rules, by class:

* **the Trainer's arguments**: an ``output_dir`` that is a file, ``push_to_hub`` (the output folder
  holds private files; what may be published is the model and its statement), an algorithm the
  Trainer path cannot run (FedAvg's local SGD);
* **the dataset's kind**: absent, empty, or iterable (userdp samples users by index);
* **each row** (:func:`check_rows`): ``input_ids`` a flat list of integer token ids ≥ 0 (a float id
  would be truncated to another token; a nested row is not one record), ``labels`` as long as
  ``input_ids`` with integer ids ≥ 0 or -100, an author that is present (no None, NaN or empty
  string: all of them would merge into one "user"), and at least one label to learn from in the
  whole dataset (all -100, e.g. every completion empty, would release a model trained on nothing);
* **a resume**: ``resume_from_checkpoint`` names a checkpoint folder that exists (or ``True`` with
  one in ``output_dir``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from pathlib import Path
from typing import Any

import numpy as np

from userdp.engine.journal import JOURNAL
from userdp.errors import UserError
from userdp.validation import MAX_STEPS, check_int, check_positive

#: the label that marks a position as not learned from (the Trainer's and userdp's)
IGNORE = -100


def check_output_dir(output_dir: Any) -> None:
    """Raises: UserError: ``TrainingArguments.output_dir`` is a file."""
    if output_dir is not None and Path(str(output_dir)).is_file():
        raise UserError(
            f"TrainingArguments.output_dir={str(output_dir)!r} is a file: give a folder (the run's "
            "ledger, checkpoints and statement are written there)"
        )


def check_push_to_hub(args: Any) -> None:
    """Raises: UserError: ``push_to_hub`` is set (the output folder holds private files)."""
    if getattr(args, "push_to_hub", False):
        raise UserError(
            "TrainingArguments.push_to_hub=True: the output folder holds private files (userdp's "
            "checkpoint state, the Trainer's un-noised loss log); call trainer.push_to_hub() after train(): "
            "it pushes the release bundle only (the model, its card and the evidence; `userdp export`)"
        )


def check_algorithm(privacy: Any) -> None:
    """Raises: UserError: an algorithm the Trainer path cannot run."""
    name = getattr(getattr(privacy, "algorithm", None), "name", None)
    if name == "fedavg":
        raise UserError(
            "privacy.algorithm: FedAvg (local SGD per user) is not supported by PrivateTrainer: use ULS "
            "or ELS here, or `userdp train` with training.algorithm: fedavg"
        )


def check_dataset_kind(dataset: Any) -> None:
    """Raises: UserError: no ``train_dataset``, an empty one, or an iterable (streaming) one."""
    if dataset is None:
        raise UserError("PrivateTrainer: give train_dataset (the tokenized records, with the user column)")
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise UserError(
            f"train_dataset: a {type(dataset).__name__} (iterable or streaming) cannot be sampled by user: "
            "give a map-style datasets.Dataset (e.g. Dataset.from_generator, or load without "
            "streaming=True)"
        )
    if len(dataset) == 0:
        raise UserError("train_dataset: it holds no rows: nothing to train on")


def _is_id(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _bad_author(u: Any) -> bool:
    if u is None:
        return True
    if isinstance(u, float) and math.isnan(u):
        return True
    return isinstance(u, str) and not u.strip()


def check_rows(users: list, ids: list, labels: list | None, user_field: str) -> None:
    """Every row of the tokenized dataset (see the module docstring).

    Raises:
        UserError: naming the first bad row, its column and what is wrong."""
    learnable = False
    for i, row in enumerate(ids):
        if _bad_author(users[i]):
            raise UserError(
                f"train_dataset row {i}: {user_field} is {users[i]!r} (every record needs its author; "
                "rows without one would merge into one user)"
            )
        if row is None or not hasattr(row, "__len__") or len(row) == 0:
            raise UserError(f"train_dataset row {i}: input_ids is empty (drop empty records before training)")
        for t in row:
            if not _is_id(t):
                what = "a list" if isinstance(t, (list, tuple)) else f"{type(t).__name__} {t!r}"
                raise UserError(
                    f"train_dataset row {i}: input_ids holds {what}: a row must be a flat list of integer "
                    "token ids (one record; floats would be truncated to other tokens)"
                )
            if t < 0:
                raise UserError(f"train_dataset row {i}: input_ids holds the negative token id {t}")
        lab = row if labels is None else labels[i]
        if labels is not None:
            if lab is None or not hasattr(lab, "__len__") or len(lab) != len(row):
                n = None if lab is None or not hasattr(lab, "__len__") else len(lab)
                raise UserError(
                    f"train_dataset row {i}: labels has {n} entries for {len(row)} input_ids (one "
                    "label per token, -100 where nothing is learned)"
                )
            for t in lab:
                if not _is_id(t) or (t < 0 and t != IGNORE):
                    raise UserError(f"train_dataset row {i}: labels holds {t!r}: a token id >= 0, or -100")
        learnable = learnable or any(t != IGNORE for t in lab)
    if not learnable:
        raise UserError(
            "train_dataset: every label is -100 (e.g. every completion empty, or everything masked): "
            "there is nothing to learn, and a model would be released trained on nothing"
        )


def check_resume(resume_from_checkpoint: Any, output_dir: Any) -> None:
    """``Trainer.train(resume_from_checkpoint=...)``: a folder that exists (not a file), or True with
    a ``checkpoint-N`` folder in ``output_dir``.

    Raises:
        UserError: naming the argument and what was found."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        began = Path(str(output_dir)) / "checkpoints" / JOURNAL
        if output_dir is not None and began.is_file():  # a fresh start would overwrite a private run's ledger
            raise UserError(
                f"TrainingArguments.output_dir={str(output_dir)!r} already holds a private run (its ledger "
                "journal counts the steps it spent): continue it with trainer.train(resume_from_checkpoint=True), "
                "or give an empty output_dir"
            )
        return
    if resume_from_checkpoint is True:
        out = Path(str(output_dir))
        found = sorted(p for p in out.glob("checkpoint-*") if p.is_dir()) if out.is_dir() else []
        if not found:
            raise UserError(
                f"resume_from_checkpoint=True: no checkpoint-N folder in {out} to resume from "
                "(start without resume_from_checkpoint)"
            )
        return
    if not isinstance(resume_from_checkpoint, (str, Path)):
        raise UserError(f"resume_from_checkpoint={resume_from_checkpoint!r}: give a checkpoint-N folder or True")
    p = Path(str(resume_from_checkpoint))
    if p.is_file():
        raise UserError(f"resume_from_checkpoint={str(p)!r} is a file: give the checkpoint-N folder the Trainer saved")
    if not p.is_dir():
        raise UserError(f"resume_from_checkpoint={str(p)!r}: no such folder (a checkpoint-N folder of output_dir)")


@dataclasses.dataclass(frozen=True)
class PlannedPrivacy:
    """A privacy config chosen by ``userdp.hf_plan.plan_privacy`` and the non-private looks at the data
    that chose it: ``PrivateTrainer(privacy=...)`` takes it as a config, and its statement lists
    ``disclosures`` under "Not accounted" (what ``userdp train --plan`` does)."""

    config: Any
    disclosures: tuple[str, ...]
    plan: Any = None


def resolve_schedule(privacy: Any, data: Any, cohort_size: Any, epochs: Any) -> tuple[Any, list[str]]:
    """The privacy config with the Trainer's ``cohort_size`` (expected units a step: users for ULS,
    records for ELS, as ``training.cohort_size``) turned into the sampling rate over ``data``'s units,
    and ``epochs`` (expected participations of each unit) into the steps, with one note each for
    ``userdp_notes`` (the unit count is treated as public, as ``userdp train`` does).

    Raises:
        UserError: a cohort that is not a whole number in [1, units], or epochs that are not positive
            or need more than MAX_STEPS steps."""
    notes: list[str] = []
    algo = privacy.algorithm
    if cohort_size is not None:
        m = check_int(cohort_size, "cohort_size")
        per_user = np.minimum(data.sizes(), algo.group_size) if algo.unit == "record" else np.ones(data.num_users)
        units, kind = int(per_user.sum()), "records (at most G a user)" if algo.unit == "record" else "users"
        if m > units:
            raise UserError(f"cohort_size = {m}: more than the {units} {kind} of train_dataset")
        algo = dataclasses.replace(algo, sampling_rate=m / units)
        notes.append(
            f"cohort_size={m}: sampling rate {m / units:.6g} = {m}/{units} {kind} of train_dataset (a count "
            "treated as public, as userdp train treats it)"
        )
    steps = privacy.steps
    if epochs is not None:
        e = check_positive(epochs, "epochs")
        steps = math.ceil(e / algo.sampling_rate)
        if steps > MAX_STEPS:
            raise UserError(
                f"epochs = {e:g} at sampling rate {algo.sampling_rate:.3g} needs {steps} steps (> {MAX_STEPS})"
            )
        notes.append(
            f"epochs={e:g}: {steps} steps = ceil(epochs / sampling rate) (each unit takes part {e:g} times "
            "in expectation)"
        )
    return dataclasses.replace(privacy, algorithm=algo, steps=steps), notes
