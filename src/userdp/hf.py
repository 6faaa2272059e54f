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
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from transformers import Trainer

from userdp.engine import PrivacyRecord, TensorUserData, TrainConfig, make_private
from userdp.engine.private_loop import PrivateTraining
from userdp.errors import UserError
from userdp.fileio import write_json
from userdp.lm.models import IGNORE_INDEX, causal_lm_loss
from userdp.validation import check_instance

#: TrainingArguments settings refused, with why: (name, is_set(value), reason)
REFUSED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("gradient_accumulation_steps", lambda v: v != 1,
     "each optimizer step is one userdp step (one cohort, noised once); a larger cohort is "
     "privacy.algorithm's sampling rate: set it to 1"),
    ("fp16", bool, "float16 loss scaling is not proven safe with per-user clipping; use "
     "TrainConfig(precision='bfloat16') (norms, sums and noise stay float32) or float32"),
    ("bf16", bool, "mixed precision is the engine's: use TrainConfig(precision='bfloat16') (norms, sums and "
     "noise stay float32) instead of the Trainer's autocast"),
    ("torch_compile", bool, "the per-user step runs the model under torch.func and hooks; a compiled model is "
     "not supported"),
    ("deepspeed", lambda v: v is not None, "DeepSpeed shards and reduces the gradient itself; userdp's noised "
     "sum must be the gradient"),
    ("fsdp", lambda v: bool(v), "sharded training is not supported by userdp.hf yet (issue 37)"),
    ("neftune_noise_alpha", lambda v: v is not None, "NEFTune changes the forward pass of every unit; not "
     "supported"),
    ("label_smoothing_factor", lambda v: v != 0.0, "the per-record loss is userdp's (loss_fn=); the Trainer's "
     "label smoothing would be silently ignored"),
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
        raise UserError(f"TrainingArguments: {args.n_gpu} GPUs in one process (DataParallel) is not supported: "
                        "run on one GPU (CUDA_VISIBLE_DEVICES)")
    if getattr(args, "world_size", 1) > 1:
        raise UserError(f"TrainingArguments: {args.world_size} processes is not supported by userdp.hf yet: "
                        "run one process, or `torchrun -m userdp train` for a config job")
    notes = []
    if args.max_grad_norm:
        notes.append(f"TrainingArguments.max_grad_norm={args.max_grad_norm} set aside: each user's update is "
                     "clipped to the privacy config's clip norm, and the noised sum is not clipped again")
    if args.max_steps > 0:
        notes.append(f"TrainingArguments.max_steps={args.max_steps} set aside: privacy.steps decides")
    notes.append(f"TrainingArguments.per_device_train_batch_size={args.per_device_train_batch_size} and "
                 f"num_train_epochs={args.num_train_epochs} set aside: each step is a Poisson cohort at the "
                 "privacy config's sampling rate, for privacy.steps steps")
    return notes


class UserRecords(TensorUserData):
    """A tokenized Hugging Face dataset (rows with ``input_ids``, optionally ``labels``) grouped by
    the column ``user_field``: the engine's :class:`~userdp.engine.TensorUserData`, rows regrouped
    by :meth:`~userdp.engine.TensorUserData.from_user_ids`. Rows are right-padded to the longest
    row with ``pad_token_id``; ``labels`` (a copy of ``input_ids`` when absent) are -100 on the
    padding. ``user_ids[u]`` is the author the engine numbers ``u``.

    Raises:
        UserError: a missing column, or a row with no tokens or no author (naming the row)."""

    def __init__(self, dataset, user_field: str, pad_token_id: int = 0):
        columns = list(getattr(dataset, "column_names", None) or [])
        for need in (user_field, "input_ids"):
            if need not in columns:
                raise UserError(f"train_dataset: no column {need!r} (columns: {', '.join(columns) or 'none'}); "
                                + ("give user_field= the column naming each record's author"
                                   if need == user_field else "give a tokenized dataset"))
        users = list(dataset[user_field])
        ids = list(dataset["input_ids"])
        labels = list(dataset["labels"]) if "labels" in columns else ids
        for i, row in enumerate(ids):
            if row is None or len(row) == 0:
                raise UserError(f"train_dataset row {i}: input_ids is empty (drop empty records before training)")
            if users[i] is None:
                raise UserError(f"train_dataset row {i}: {user_field} is empty (every record needs its author)")
        self.seq_len = max(len(r) for r in ids)
        self.max_token_id = int(max(max(r) for r in ids))
        padded_ids = torch.full((len(ids), self.seq_len), int(pad_token_id), dtype=torch.long)
        padded_labels = torch.full((len(ids), self.seq_len), IGNORE_INDEX, dtype=torch.long)
        for i, (row, lab) in enumerate(zip(ids, labels)):
            padded_ids[i, :len(row)] = torch.as_tensor(row, dtype=torch.long)
            padded_labels[i, :len(lab)] = torch.as_tensor(lab, dtype=torch.long)
        authors = np.asarray([str(u) for u in users])
        grouped = TensorUserData.from_user_ids({"input_ids": padded_ids, "labels": padded_labels}, authors)
        super().__init__(grouped.tensors, grouped.offsets)
        self.user_ids = np.unique(authors)


def _check_fits(data: UserRecords, config) -> None:
    """Refuse records the model cannot read (a traceback inside the per-user step otherwise).

    Raises:
        UserError: a row longer than the model's positions, or a token id outside its vocabulary."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit and data.seq_len > limit:
        raise UserError(f"train_dataset: its longest row has {data.seq_len} tokens, more than the model's {limit} "
                        f"positions: truncate when tokenizing (truncation=True, max_length={limit})")
    vocab = getattr(config, "vocab_size", None)
    top = int(data.max_token_id)
    if vocab and top >= vocab:
        raise UserError(f"train_dataset: token id {top} is outside the model's vocabulary of {vocab} "
                        "(tokenized with another tokenizer?)")


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

    After ``train()``: :meth:`epsilon`, :meth:`privacy_record`, and in ``args.output_dir`` the
    ledger journal and userdp's checkpoint (``userdp/``, written with each Trainer checkpoint, so
    that ``train(resume_from_checkpoint=...)`` continues the ledger) and ``privacy_record.json``.

    Raises:
        UserError: a refused ``TrainingArguments`` setting, a dataset without the user column, a bad
            privacy config, a fresh run in an output_dir that holds a run's ledger, or a resume from
            a Trainer checkpoint that is not at userdp's checkpoint's step.
    """

    def __init__(self, *args, privacy: TrainConfig, user_field: str = "user",
                 loss_fn: Callable = causal_lm_loss, **kwargs):
        super().__init__(*args, **kwargs)
        check_instance(privacy, "privacy", (TrainConfig,), "a userdp.engine.TrainConfig")
        if self.train_dataset is None:
            raise UserError("PrivateTrainer: give train_dataset (the tokenized records, with the user column)")
        self.userdp_notes = check_arguments(self.args)
        self.args = copy.copy(self.args)  # the caller's object stays as given (a copy: not re-initialised)
        self.args.max_grad_norm, self.args.max_steps = 0.0, privacy.steps
        self.privacy = privacy
        self.loss_fn = loss_fn
        pad = getattr(self.processing_class, "pad_token_id", None)
        self.user_data = UserRecords(self.train_dataset, user_field, pad if pad is not None else 0)
        _check_fits(self.user_data, getattr(self.model, "config", None))
        self._private: Optional[PrivateTraining] = None
        self._resuming = False
        self._steps = None
        self._last_metrics: Optional[dict] = None

    # ------------------------------------------------------------------ the Trainer's hooks
    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(_Steps(self.privacy.steps), batch_size=1)

    def log(self, logs: dict, *args, **kwargs) -> None:
        """The Trainer's log, with the epsilon spent so far (so log_history and report_to carry it)."""
        if self._last_metrics is not None and "epsilon_spent" in self._last_metrics and "loss" in logs:
            logs = dict(logs, epsilon=self._last_metrics["epsilon_spent"])
        super().log(logs, *args, **kwargs)

    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        """The Trainer's ``train``. ``resume_from_checkpoint`` (a ``checkpoint-N`` folder, or True
        for the latest) continues the run with its ledger: userdp's checkpoint in
        ``output_dir/userdp`` is written with every Trainer checkpoint, must be at the same step,
        and the steps begun after it are counted as lost (their noise never reused)."""
        self._resuming = bool(resume_from_checkpoint)
        out = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        self._finish()
        return out

    def _save_checkpoint(self, model, trial, *args, **kwargs):
        super()._save_checkpoint(model, trial, *args, **kwargs)
        if self._private is not None:  # userdp's checkpoint (ledger, model, optimizer) at the same step
            self._private.save()

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        if self._steps is None:
            self._private = make_private(self.model, getattr(self.optimizer, "optimizer", self.optimizer),
                                         self.user_data, self.loss_fn, self.privacy,
                                         checkpoint_dir=str(Path(self.args.output_dir) / "userdp"),
                                         resume=self._resuming)
            if self._private.step != self.state.global_step:
                raise UserError(f"resume_from_checkpoint: the Trainer's checkpoint is at step {self.state.global_step}, "
                                f"userdp's ({Path(self.args.output_dir) / 'userdp'}) at step {self._private.step}: "
                                f"resume from checkpoint-{self._private.step}")
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
            write_json(os.path.join(self.args.output_dir, "privacy_record.json"),
                       dict(self.privacy_record().to_dict(), userdp_notes=self.userdp_notes,
                            not_accounted=self.disclosures()))

    def epsilon(self, delta: Optional[float] = None) -> float:
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
        """The run's non-private touches of the training data, one line each."""
        out = ["monitoring: the training loss the Trainer logs (log_history, report_to) is computed on the "
               "private records without noise"]
        if self.eval_dataset is not None:
            out.append("evaluation: the Trainer's eval_dataset is scored without noise (outside the guarantee "
                       "unless its users are not among the training users)")
        return out

