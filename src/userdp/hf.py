"""User-level DP inside a Hugging Face ``Trainer`` script: :class:`PrivateTrainer`.

A script built on ``transformers.Trainer`` keeps its model, tokenizer, ``TrainingArguments``,
optimizer and schedule, callbacks and ``report_to``; it adds a user column to its tokenized dataset
and a userdp :class:`~userdp.engine.TrainConfig`, and swaps the class::

    from userdp.engine import ULS, FlatClip, TrainConfig
    from userdp.hf import PrivateTrainer

    privacy = TrainConfig(algorithm=ULS(group_size=4, sampling_rate=0.05), steps=200,
                          clipping=FlatClip(1.0), target_epsilon=3.0)
    trainer = PrivateTrainer(model=model, args=args, train_dataset=tokenized,  # rows: input_ids, user
                             privacy=privacy, user_field="user")
    trainer.train()
    print(trainer.epsilon(), trainer.privacy_record()["sampler_mode"])

What the Trainer no longer decides, because the guarantee depends on it: the batches (each step is
a Poisson cohort of users, ULS, or of records, ELS, drawn by userdp's sampler, not the Trainer's
shuffling), the gradient (each unit's update clipped, the sum noised once, by
:func:`userdp.engine.make_private`; the ledger counts the step before it is computed) and the
number of steps (``privacy.steps``, fewer if the budget runs out). ``TrainingArguments`` settings
that would change those are refused in one line naming the argument, or set aside and said
(:attr:`PrivateTrainer.userdp_notes`): see :data:`REFUSED` and docs/hf.md. The Trainer still steps
its optimizer and schedule on the privatized gradient (post-processing).

Each record is one row of the dataset, written by one user: a row that packs several people's text
cannot be told apart here and must not be given. Rows are right-padded to the longest row, with
``labels`` -100 on the padding (a ``labels`` column, e.g. prompt tokens masked, is kept as given).
The training loss the Trainer logs (and sends to ``report_to``) is computed on the private records
without noise: it is listed among the run's non-private touches of the data.
"""

from __future__ import annotations

import copy
import inspect
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import huggingface_hub
import numpy as np
import torch
import torch.distributed as dist
import yaml
from transformers import Trainer

from userdp.engine import PrivacyRecord, TensorUserData, TrainConfig, make_private
from userdp.engine.distributed.processes import combiner_for
from userdp.engine.plan import privacy_repr
from userdp.engine.private_loop import PrivateTraining
from userdp.engine.run.options import RunOptions
from userdp.errors import UserError
from userdp.fileio import write_atomic, write_json
from userdp.hf_boundary import (
    PlannedPrivacy,
    check_algorithm,
    check_dataset_kind,
    check_output_dir,
    check_push_to_hub,
    check_resume,
    check_rows,
    resolve_schedule,
)
from userdp.lm.export import export_release
from userdp.lm.models import IGNORE_INDEX, causal_lm_loss
from userdp.lm.release import save_released_model
from userdp.lm.report import write_report
from userdp.lm.run_dir import RunDir
from userdp.lm.statement import ReleaseFacts, privacy_record, statement_scope
from userdp.validation import check_instance

#: TrainingArguments settings refused, with why: (name, is_set(value), reason)
REFUSED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    (
        "gradient_accumulation_steps",
        lambda v: v != 1,
        "each optimizer step is one userdp step (one cohort, noised once); a larger cohort is "
        "privacy.algorithm's sampling rate: set it to 1",
    ),
    (
        "fp16",
        bool,
        "float16 loss scaling is not proven safe with per-user clipping; use "
        "TrainConfig(performance=Performance(precision='bfloat16')) (norms, sums and noise stay float32) or float32",
    ),
    (
        "mixed_precision",
        lambda v: v not in (None, "no"),
        "the Trainer's accelerator would run the model under its own "
        "autocast (set here by bf16/fp16 or ACCELERATE_MIXED_PRECISION): use "
        "TrainConfig(performance=Performance(precision='bfloat16'))",
    ),
    (
        "torch_compile",
        bool,
        "the per-user step runs the model under torch.func and hooks; a compiled model is not supported",
    ),
    (
        "deepspeed",
        lambda v: v is not None,
        "DeepSpeed shards and reduces the gradient itself; userdp's noised sum must be the gradient",
    ),
    ("fsdp", lambda v: bool(v), "sharded training is not supported by userdp.hf yet"),
    ("neftune_noise_alpha", lambda v: v is not None, "NEFTune changes the forward pass of every unit; not supported"),
    (
        "label_smoothing_factor",
        lambda v: v != 0.0,
        "the per-record loss is userdp's (loss_fn=); the Trainer's label smoothing would be silently ignored",
    ),
    # choosing which checkpoint to release, or keep, by an eval score computed without noise is not
    # post-processing: the released model would be an un-noised function of the data scored
    (
        "load_best_model_at_end",
        bool,
        "the released model would be the checkpoint with the best un-noised eval "
        "metric, a selection the guarantee does not cover: release the final model (set it to False), or tune "
        "with `userdp tune`, which accounts the selection",
    ),
    (
        "save_strategy",
        lambda v: str(getattr(v, "value", v)) == "best",
        "which checkpoints are kept would follow "
        "an un-noised eval metric (each kept checkpoint is a release): use 'steps' or 'epoch'",
    ),
)

#: Trainer entry points a private run refuses: each would run several trainings and choose among them by an
#: un-noised score (one certificate a trial, the selection outside every one of them)
SELECTION_REFUSAL = (
    "hyperparameter search runs several private trainings and keeps the best by an un-noised "
    "score: the selection is outside each trial's guarantee; use `userdp tune` (it accounts the "
    "selection, docs/tuning.md)"
)


def set_aside_bf16(args, privacy: TrainConfig):
    """``(args, note)``: arguments asking for the Trainer's bf16 autocast (``TrainingArguments.bf16``,
    on by default in TRL's ``SFTConfig``) as a copy with it off, and the note that says so; or
    ``(args, None)``. One rule for every entry point: mixed precision is the engine's
    (``Performance(precision=...)``), under which norms, sums and noise stay float32."""
    if not getattr(args, "bf16", False):
        return args, None
    args = copy.copy(args)
    args.bf16 = False
    if os.environ.get("ACCELERATE_MIXED_PRECISION", "no") == "no":  # set from bf16 alone
        args.mixed_precision = "no"
    return args, (
        f"{type(args).__name__}.bf16=True set aside: mixed precision is the engine's "
        f"(TrainConfig(performance=Performance(precision=...)), here {privacy.performance.precision!r}); "
        "norms, sums and noise stay float32"
    )


def check_arguments(args) -> list[str]:
    """Refuse the ``TrainingArguments`` a private run cannot honour; return what is set aside.

    Raises:
        UserError: one line naming the first refused argument and why."""
    for name, is_set, why in REFUSED:
        value = getattr(args, name, None)
        if value is not None and is_set(value):
            raise UserError(f"TrainingArguments.{name}={value!r}: {why}")
    if getattr(args, "n_gpu", 1) > 1:
        raise UserError(
            f"TrainingArguments: {args.n_gpu} GPUs in one process (DataParallel) is not supported: "
            "run on one GPU (CUDA_VISIBLE_DEVICES)"
        )
    notes = []
    if getattr(args, "world_size", 1) > 1:
        notes.append(
            f"{args.world_size} processes (torchrun): every process draws the same cohort, computes "
            "its share of the units' clipped updates, and userdp all-reduces the sums (the noise is "
            "drawn once, on rank 0); the model is not wrapped in DistributedDataParallel"
        )
    if args.max_grad_norm:
        notes.append(
            f"TrainingArguments.max_grad_norm={args.max_grad_norm} set aside: each user's update is "
            "clipped to the privacy config's clip norm, and the noised sum is not clipped again"
        )
    if args.max_steps > 0:
        notes.append(f"TrainingArguments.max_steps={args.max_steps} set aside: privacy.steps decides")
    notes.append(
        f"TrainingArguments.per_device_train_batch_size={args.per_device_train_batch_size} and "
        f"num_train_epochs={args.num_train_epochs} set aside: each step is a Poisson cohort at the "
        "privacy config's sampling rate, for privacy.steps steps"
    )
    return notes


class UserRecords(TensorUserData):
    """A tokenized Hugging Face dataset (rows with ``input_ids``, optionally ``labels``) grouped by
    the column ``user_field``: the engine's :class:`~userdp.engine.TensorUserData`, rows regrouped
    by :meth:`~userdp.engine.TensorUserData.from_user_ids`. Rows are right-padded to the longest
    row with ``pad_token_id``; ``labels`` (a copy of ``input_ids`` when absent) are -100 on the
    padding. ``user_ids[u]`` is the author the engine numbers ``u``.

    Raises:
        UserError: a missing column, or a row with no tokens or no author (naming the row)."""

    def __init__(self, dataset, user_field: str, pad_token_id: int = 0, collator=None):
        columns = list(getattr(dataset, "column_names", None) or [])
        for need in (user_field, "input_ids"):
            if need not in columns:
                raise UserError(
                    f"train_dataset: no column {need!r} (columns: {', '.join(columns) or 'none'}); "
                    + (
                        "give user_field= the column naming each record's author"
                        if need == user_field
                        else "give a tokenized dataset"
                    )
                )
        users = list(dataset[user_field])
        ids = list(dataset["input_ids"])
        labels = list(dataset["labels"]) if "labels" in columns else None
        if collator is not None:  # the script's data_collator, applied to each record on its own
            ids, labels = _collate_each(collator, ids, labels)
        check_rows(users, ids, labels, user_field)  # the HF boundary: one record a row, integer ids, an author
        labels = ids if labels is None else labels
        self.seq_len = max(len(r) for r in ids)
        self.max_token_id = int(max(max(r) for r in ids))
        padded_ids = torch.full((len(ids), self.seq_len), int(pad_token_id), dtype=torch.long)
        padded_labels = torch.full((len(ids), self.seq_len), IGNORE_INDEX, dtype=torch.long)
        for i, (row, lab) in enumerate(zip(ids, labels, strict=True)):
            padded_ids[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
            padded_labels[i, : len(lab)] = torch.as_tensor(lab, dtype=torch.long)
        authors = np.asarray([str(u) for u in users])
        grouped = TensorUserData.from_user_ids({"input_ids": padded_ids, "labels": padded_labels}, authors)
        super().__init__(grouped.tensors, grouped.offsets)
        self.user_ids = np.unique(authors)
        self._user_keys = grouped._user_keys  # the authors: a cyclic-Poisson group follows its user
        self.user_field = user_field
        self.pad_token_id = int(pad_token_id)
        self.num_records = len(ids)


def _collate_each(collator: Callable, ids: list, labels: list | None) -> tuple[list, list | None]:
    """The script's ``data_collator`` applied to each record alone (per-record post-processing: a
    label-masking collator masks what it masks in the private run as in a plain one). Returns the
    rows' ``input_ids`` and ``labels`` as the collator left them.

    Raises:
        UserError: the collator fails on a record, or returns no ``input_ids``."""
    out_ids, out_labels = [], []
    for i, row in enumerate(ids):
        feature = {"input_ids": list(row)} | ({"labels": list(labels[i])} if labels is not None else {})
        try:
            batch = collator([feature])
        except Exception as exc:  # noqa: BLE001 - the script's collator: one line naming it
            raise UserError(
                f"data_collator failed on train_dataset row {i} ({type(exc).__name__}: {str(exc)[:160]}); "
                "userdp applies it to each record alone"
            ) from None
        if "input_ids" not in batch:
            raise UserError(f"data_collator returned no input_ids for train_dataset row {i}")
        out_ids.append([int(t) for t in torch.as_tensor(batch["input_ids"])[0].tolist()])
        lab = batch.get("labels")
        out_labels.append([int(t) for t in torch.as_tensor(lab)[0].tolist()] if lab is not None else out_ids[-1])
    return out_ids, out_labels


#: Trainer methods whose work the private step does itself: a subclass's override would never run
OWN_HOOKS = ("compute_loss", "training_step", "get_train_dataloader")


def _check_overrides(trainer) -> None:
    """A subclass that overrides a hook the private step replaces is refused, never silently
    bypassed (its ``compute_loss`` would not be called: the loss is ``loss_fn``).

    Raises:
        UserError: naming the class and the method."""
    for name in OWN_HOOKS:
        module = getattr(getattr(type(trainer), name, None), "__module__", "") or ""
        if module.split(".")[0] not in ("transformers", "trl", "userdp"):
            raise UserError(
                f"{type(trainer).__name__}.{name} is overridden ({module}): the private step does that work itself "
                "and would never call it; give a per-record loss as loss_fn(model, batch) -> Tensor[n] instead"
            )


def _check_fits(data: UserRecords, config) -> None:
    """Refuse records the model cannot read (a traceback inside the per-user step otherwise).

    Raises:
        UserError: a row longer than the model's positions, or a token id outside its vocabulary."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit and data.seq_len > limit:
        raise UserError(
            f"train_dataset: its longest row has {data.seq_len} tokens, more than the model's {limit} "
            f"positions: truncate when tokenizing (truncation=True, max_length={limit})"
        )
    vocab = getattr(config, "vocab_size", None)
    top = int(data.max_token_id)
    if vocab and top >= vocab:
        raise UserError(
            f"train_dataset: token id {top} is outside the model's vocabulary of {vocab} "
            "(tokenized with another tokenizer?)"
        )
    if vocab and data.pad_token_id >= vocab:
        raise UserError(
            f"processing_class: its pad token id {data.pad_token_id} is outside the model's vocabulary of "
            f"{vocab} (a pad token added to the tokenizer without model.resize_token_embeddings(len(tokenizer)))"
        )


def _given(init: Callable, args: tuple, kwargs: dict) -> dict:
    """The arguments a Trainer's ``__init__`` was given, by name (its own signature: TRL's differs)."""
    try:
        return dict(inspect.signature(init).bind_partial(*args, **kwargs).arguments)
    except TypeError:  # the Trainer itself reports a wrong call
        return dict(kwargs)


class _Steps(torch.utils.data.Dataset):
    """The Trainer's "batches": one placeholder per userdp step (the data is drawn by userdp)."""

    def __init__(self, steps: int):
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> dict:
        return {"userdp_step": torch.tensor(i)}


class PrivateTrainer(Trainer):
    """A ``transformers.Trainer`` whose training steps are userdp's (see the module docstring).

    Args (beyond the Trainer's own):
        privacy: the run's :class:`~userdp.engine.TrainConfig` (algorithm, steps, clipping, sigma or
            target epsilon, delta, sampler, seed, precision); its optimizer is not used (the
            Trainer's is).
        user_field: the dataset column naming each record's author (the privacy unit).
        loss_fn: ``loss_fn(model, batch) -> Tensor[n]``, one loss per record (default: next-token
            cross-entropy averaged over each record's target tokens).

    After ``train()``: :meth:`epsilon`, :meth:`privacy_record`, and ``args.output_dir`` laid out as
    a ``userdp train`` run directory, so that ``userdp report OUTPUT_DIR`` verifies it:
    ``config.yaml`` (the privacy config the ledger journal is bound to), ``checkpoints/`` (the
    ledger journal and userdp's checkpoint, written with each Trainer checkpoint, so that
    ``train(resume_from_checkpoint=...)`` continues the ledger), ``privacy.json``, ``report.md`` and
    ``report.json``, ``state.json``, and ``model/`` (the trained model with its manifest and a model
    card stating the guarantee). The Trainer's own files (``checkpoint-N/``, ``save_model``) sit
    beside them.

    Raises:
        UserError: a refused ``TrainingArguments`` setting, a dataset without the user column, a bad
            privacy config, a fresh run in an output_dir that holds a run's ledger, or a resume from
            a Trainer checkpoint that is not at userdp's checkpoint's step.
    """

    def __init__(
        self,
        *args,
        privacy: TrainConfig | PlannedPrivacy,
        user_field: str = "user",
        loss_fn: Callable = causal_lm_loss,
        cohort_size: int | None = None,
        epochs: float | None = None,
        **kwargs,
    ):
        # the HF boundary (userdp.hf_boundary), before the Trainer builds anything from its inputs
        planned = privacy.disclosures if isinstance(privacy, PlannedPrivacy) else ()
        privacy = privacy.config if isinstance(privacy, PlannedPrivacy) else privacy
        check_instance(privacy, "privacy", (TrainConfig,), "a userdp.engine.TrainConfig (or userdp.hf_plan's plan)")
        check_algorithm(privacy)
        given = _given(super().__init__, args, kwargs)
        bf16_note = None
        if given.get("args") is not None:
            given["args"], bf16_note = set_aside_bf16(given["args"], privacy)
            if "args" in kwargs:
                kwargs["args"] = given["args"]
            else:  # Trainer(model, args, ...)
                args = (args[0], given["args"], *args[2:])
            check_arguments(given["args"])
            check_output_dir(getattr(given["args"], "output_dir", None))
            check_push_to_hub(given["args"])
        check_dataset_kind(given.get("train_dataset"))
        if given.get("compute_loss_func") is not None:
            raise UserError(
                "compute_loss_func: the private step computes one loss per record with loss_fn= (the Trainer's "
                "would never be called); pass it as loss_fn(model, batch) -> Tensor[n]"
            )
        collator = given.get("data_collator")
        super().__init__(*args, **kwargs)  # a subclass's own data preparation (TRL's) runs here
        _check_overrides(self)
        check_dataset_kind(self.train_dataset)  # as the subclass prepared it
        self.userdp_notes = check_arguments(self.args) + ([bf16_note] if bf16_note else [])
        if collator is not None:
            self.userdp_notes.append(
                f"data_collator ({type(collator).__name__}) applied to each record alone before training (per-record "
                "post-processing; a collator that combines records of a batch is not supported)"
            )
        self.loss_fn = loss_fn
        pad = getattr(self.processing_class, "pad_token_id", None)
        self.user_data = UserRecords(self.train_dataset, user_field, pad if pad is not None else 0, collator)
        privacy, schedule = resolve_schedule(privacy, self.user_data, cohort_size, epochs)
        self.userdp_notes += schedule
        self.planned = tuple(planned)  # the plan's looks at the data: in the statement's "Not accounted"
        self.args = copy.copy(self.args)  # the caller's object stays as given (a copy: not re-initialised)
        self.args.max_grad_norm, self.args.max_steps = 0.0, privacy.steps
        self.privacy = privacy
        _check_fits(self.user_data, getattr(self.model, "config", None))
        self._private: PrivateTraining | None = None
        self._resuming = False
        self._steps = None
        self._last_metrics: dict | None = None

    # ------------------------------------------------------------------ the Trainer's hooks
    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        # not the accelerator's: every process runs every step (each computes its share of the cohort)
        return torch.utils.data.DataLoader(_Steps(self.privacy.steps), batch_size=1)

    def _wrap_model(self, model, training=True, dataloader=None):
        """The model itself, never DistributedDataParallel: userdp sums the clipped updates across
        processes (and the per-unit step never runs DDP's forward and backward)."""
        return model

    def log(self, logs: dict, *args, **kwargs) -> None:
        """The Trainer's log, with the epsilon spent so far (so log_history and report_to carry it)."""
        if self._last_metrics is not None and "epsilon_spent" in self._last_metrics and "loss" in logs:
            logs = dict(logs, epsilon=self._last_metrics["epsilon_spent"])
        super().log(logs, *args, **kwargs)

    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        """The Trainer's ``train``. ``resume_from_checkpoint`` (a ``checkpoint-N`` folder, or True
        for the latest) continues the run with its ledger: userdp's checkpoint in
        ``output_dir/checkpoints`` is written with every Trainer checkpoint, must be at the same step,
        and the steps begun after it are counted as lost (their noise never reused)."""
        if trial is not None:
            raise UserError(f"PrivateTrainer.train(trial=...): {SELECTION_REFUSAL}")
        check_resume(resume_from_checkpoint, self.args.output_dir)
        self._resuming = bool(resume_from_checkpoint)
        out = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        self._finish()
        return out

    def hyperparameter_search(self, *args, **kwargs):
        """Refused (:data:`SELECTION_REFUSAL`).

        Raises:
            UserError: always."""
        raise UserError(f"PrivateTrainer.hyperparameter_search: {SELECTION_REFUSAL}")

    def _save_checkpoint(self, model, trial, *args, **kwargs):
        super()._save_checkpoint(model, trial, *args, **kwargs)
        if self._private is not None:  # userdp's checkpoint (ledger, model, optimizer) at the same step
            self._private.save()

    @property
    def run_dir(self) -> RunDir:
        """``args.output_dir`` as a userdp run directory (its layout: :mod:`userdp.lm.run_dir`)."""
        return RunDir(Path(self.args.output_dir))

    def _config_yaml(self) -> dict:
        """config.yaml's content: the privacy config (what the ledger journal is bound to) and the
        Trainer's settings that shaped the run (for the reader; performance settings may change)."""
        a = self.args
        return {
            "hf_trainer": {
                "privacy": privacy_repr(self.privacy),
                "user_field": self.user_data.user_field,
                "model": type(self.model).__name__,
                "training_arguments": {
                    "learning_rate": a.learning_rate,
                    "optim": str(a.optim),
                    "lr_scheduler_type": str(a.lr_scheduler_type),
                    "warmup_steps": a.warmup_steps,
                    "weight_decay": a.weight_decay,
                    "seed": a.seed,
                },
                "userdp_notes": list(self.userdp_notes),
            }
        }

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        if self._steps is None:
            rd = self.run_dir
            if self.is_world_process_zero() and not self._resuming and not rd.config.is_file():
                write_atomic(rd.config, yaml.safe_dump(self._config_yaml(), sort_keys=False))
            self._private = make_private(
                self.model,
                getattr(self.optimizer, "optimizer", self.optimizer),
                self.user_data,
                self.loss_fn,
                self.privacy,
                RunOptions(
                    checkpoint_dir=str(rd.checkpoints),
                    resume=self._resuming,
                    combiner=combiner_for(self.args.world_size > 1),
                    journal_context={"statement": statement_scope(self._release_facts())},
                ),
            )
            if self._private.step != self.state.global_step:
                raise UserError(
                    f"resume_from_checkpoint: the Trainer's checkpoint is at step {self.state.global_step}, "
                    f"userdp's ({rd.checkpoints}) at step {self._private.step}: "
                    f"resume from checkpoint-{self._private.step}"
                )
            self._steps = iter(self._private)
        step = next(self._steps, None)
        if step is None:  # the next step would pass the target epsilon: the run ends here
            self.control.should_training_stop = True
            return torch.zeros((), device=self.args.device)
        self._last_metrics = step.backward()
        return torch.tensor(float(self._last_metrics["loss"]), device=self.args.device)

    # ------------------------------------------------------------------ after training
    def _finish(self) -> None:
        if self._steps is None:
            return
        if self._private.step >= self._private.steps:
            next(self._steps, None)  # the loop's end: the final checkpoint and "completed"
        elif self._private.stopped is None:  # a callback stopped the Trainer early
            self._steps.close()
            self._private.stopped = "stopped by the Trainer (a callback)"
        self._steps = None
        if self.is_world_process_zero():
            self._release()

    def _release_facts(self, sampler_mode: str = "") -> ReleaseFacts:
        """The run's facts for its statement (``sampler_mode``: the run's, once it has run; the
        journal binds the statement's scope before the first step without it)."""
        cfg = self.privacy
        algo = cfg.algorithm
        return ReleaseFacts(
            algorithm=algo.name,
            accountant=cfg.accountant,
            sampler_assumed=sampler_mode,  # one config here: the run's plan is what was assumed
            epsilon_target=cfg.target_epsilon,
            steps_planned=cfg.steps,
            group_size=getattr(algo, "group_size", None),
            num_records=self.user_data.num_records,
            clipping=type(cfg.clipping).__name__,
            seq_len=self.user_data.seq_len,
            not_accounted=tuple(self.disclosures()),
            compute={
                "driver": "transformers.Trainer (userdp.hf.PrivateTrainer)",
                "device": str(self.args.device),
                "chunk_size": cfg.performance.chunk_size,
                "processes": {
                    "world_size": self.args.world_size,
                    "backend": dist.get_backend() if self.args.world_size > 1 else None,
                },
            },
        )

    def _release(self) -> None:
        """privacy.json, the model with its manifest, state.json and the report with the model card,
        as ``userdp train`` writes them (the report re-derives every figure from the ledger)."""
        rd, record = self.run_dir, self.privacy_record()
        algo = self.privacy.algorithm
        priv = privacy_record(record, self._release_facts(record.sampler_mode))
        priv["userdp_notes"] = list(self.userdp_notes)
        # this script's evaluation is its own (disclosed above when it scores the training data)
        priv["data_accesses_covered"] = "training only (the sequence of noised aggregated updates)"
        write_json(rd.privacy, priv)
        save_released_model(rd, self.model, self.processing_class)
        rd.write_state(
            status="done",
            summary={
                "epsilon": priv["epsilon"],
                "delta": priv["delta"],
                "steps": record.steps_applied,
                "stopped": record.get("stopped"),
                "algorithm": algo.name,
                "train_users": self.user_data.num_users,
            },
        )
        write_report(rd.root)

    def push_to_hub(self, commit_message: str = "userdp release bundle", blocking: bool = True, **kwargs):
        """Push the run's release bundle (:func:`userdp.lm.export.export_release`: the model with its
        card at the root, the evidence ``userdp report`` verifies under ``userdp/``) to
        ``args.hub_model_id`` (else the output folder's name), and nothing else: never the records,
        the Trainer's checkpoints and loss log, or userdp's resume state. ``token`` and ``revision``
        are the Hub's; the bundle is verified before it leaves.

        Raises:
            UserError: the run has not released a model yet."""
        if not self.run_dir.privacy.is_file():
            raise UserError("push_to_hub(): train() has not released a model yet (nothing verified to push)")
        token = kwargs.get("token") or self.args.hub_token
        repo_id = self.args.hub_model_id or Path(self.args.output_dir).name
        with tempfile.TemporaryDirectory(prefix="userdp-bundle-") as tmp:
            bundle = export_release(self.run_dir.root, Path(tmp) / "bundle")
            huggingface_hub.create_repo(repo_id, token=token, private=self.args.hub_private_repo, exist_ok=True)
            return huggingface_hub.upload_folder(
                repo_id=repo_id,
                folder_path=str(bundle),
                commit_message=commit_message,
                token=token,
                revision=kwargs.get("revision"),
                run_as_future=not blocking,
            )

    def epsilon(self, delta: float | None = None) -> float:
        """The epsilon spent (at the run's delta, or at ``delta``), from the ledger's DpEvent."""
        if self._private is None:
            raise UserError("PrivateTrainer.epsilon(): train() has not run")
        return self._private.epsilon(delta)

    def privacy_record(self) -> PrivacyRecord:
        """The engine's privacy record of the run (:class:`~userdp.engine.PrivacyRecord`)."""
        if self._private is None:
            raise UserError("PrivateTrainer.privacy_record(): train() has not run")
        return self._private.record()

    def disclosures(self) -> list[str]:
        """The run's non-private touches of the data and what it declares public, one line each: the
        same sections ``userdp train``'s statement has (the starting model and its tokenizer, the
        settings chosen outside the record, monitoring, evaluation)."""
        model = getattr(getattr(self.model, "config", None), "_name_or_path", "") or type(self.model).__name__
        tok = getattr(self.processing_class, "name_or_path", "") or (
            type(self.processing_class).__name__ if self.processing_class is not None else ""
        )
        out = [
            f"starting model {model} declared public by the script (its training data is outside the guarantee)",
            "monitoring: the training loss the Trainer logs (log_history, report_to, the Trainer's checkpoint-N/"
            "trainer_state.json) is computed on the private records without noise",
            "the privacy settings (G, the sampling rate, steps, clip norm) and the Trainer's hyperparameters were "
            "chosen by the script: any look at the private data that chose them is not accounted",
        ]
        if tok:
            out.insert(1, f"tokenizer {tok} declared public by the script (its training text is outside the guarantee)")
        if self.eval_dataset is not None:
            out.append(self._evaluation_disclosure())
        return out + list(self.planned)

    def _evaluation_disclosure(self) -> str:
        """What the Trainer's eval_dataset is, checked by its user column: held-out users, or (named)
        training users whose un-noised scores are outside the guarantee."""
        field = self.user_data.user_field
        columns = list(getattr(self.eval_dataset, "column_names", None) or [])
        if field not in columns:
            return (
                f"evaluation: the Trainer's eval_dataset (no {field!r} column, so its users cannot be checked) is "
                "scored without noise: outside the guarantee if any of its records are training users'"
            )
        shared = set(map(str, self.eval_dataset[field])) & set(map(str, self.user_data.user_ids))
        if shared:
            return (
                f"evaluation: the Trainer's eval_dataset holds records of {len(shared)} training users (a record-level "
                "split); its scores are un-noised statistics of training users' data, outside the guarantee"
            )
        return (
            "evaluation: the Trainer's eval_dataset holds no training user (checked by user); it is scored "
            "without noise"
        )
