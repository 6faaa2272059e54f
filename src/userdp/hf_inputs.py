"""A ``userdp train`` run's inputs, for a Hugging Face ``Trainer`` (:func:`trainer_inputs`): the same
training users and records, the same starting model, the same privacy settings (sigma, q, G, the
chunk size, the seed) and the same optimizer, so that :class:`userdp.hf.PrivateTrainer` reproduces
the command line's run bit for bit (docs/hf.md, *Reproducing a ``userdp train`` run*).

The run's inputs are rebuilt by the command line's own phases, read from its run directory (its
``config.yaml``, with a plan's choices applied, its ``plan.json`` and its ``chunk_size.json``), so
nothing is re-derived by hand: the held-out users stay out, the tokenizer appends its EOS as it
did, q comes from N as it did. Nothing in the run directory is written.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from userdp.devices import resolve_device
from userdp.engine import TrainConfig
from userdp.errors import UserError
from userdp.lm import config as C
from userdp.lm.job_context import JobContext
from userdp.lm.job_plan import num_units, resolve, resolve_chunk_size
from userdp.lm.plan_auto import planned_config
from userdp.lm.prepare import build_datasets, prepare_data
from userdp.lm.run_dir import RunDir
from userdp.lm.starting_model import get_tokenizer_and_model, place_model
from userdp.world import World

#: the dataset column that names each record's author (``PrivateTrainer(user_field=...)``)
USER_FIELD = "user"


@dataclasses.dataclass(frozen=True)
class TrainerInputs:
    """What a ``PrivateTrainer`` is given to reproduce a ``userdp train`` run.

    ``model`` and ``tokenizer``: the run's starting model (LoRA applied where configured) and
    tokenizer; ``train_dataset``: one row a training record (``user``, ``input_ids`` and ``labels``,
    padded to ``tokenizer.seq_len`` as the engine pads them), users named in the run's order;
    ``privacy``: the run's engine config (its sigma, q, G, chunk size, seed and prior releases).
    """

    model: Any
    tokenizer: Any
    train_dataset: Any
    privacy: TrainConfig
    user_field: str = USER_FIELD

    def optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        """The run's optimizer over the model's trainable parameters, at a constant learning rate
        (``Trainer(optimizers=...)``): ``userdp train`` steps the engine's optimizer, not the
        Trainer's AdamW and its schedule."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = self.privacy.optimizer.build(params)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def trainer_inputs(run_dir: str | Path, log=lambda msg: None) -> TrainerInputs:
    """The inputs of the ``userdp train`` run in ``run_dir`` (a new or finished run's directory).

    Raises:
        UserError: ``run_dir`` is not a run directory of ``userdp train`` (no ``config.yaml``), or
            is an audit's (its canary users are not rebuilt)."""
    rd = RunDir(Path(run_dir))
    if not rd.config.is_file():
        raise UserError(f"{run_dir}: no config.yaml here (give the run directory `userdp train` made)")
    cfg = C.load_config(rd.config)
    if cfg.audit.canaries:
        raise UserError(
            f"{run_dir}: an audit run (audit.canaries: {cfg.audit.canaries}) trained on canary users "
            "as well, which are not rebuilt here; give a training run's directory"
        )
    device = resolve_device(cfg.model.device)
    prep = prepare_data(cfg.data, log)
    tok, model, _ = get_tokenizer_and_model(cfg.tokenizer, cfg.model, prep, log, False, device=device)
    world = World()
    model, _, _ = place_model(cfg.model, model, world, log, device=device)
    seq_len, selection = cfg.tokenizer.seq_len, cfg.training.selection
    train_data, _ = build_datasets(prep, tok, seq_len=seq_len, selection=selection, log=log, model=model)
    ctx = JobContext(world=world, log=log, progress=False, resume_dir=str(rd.root), rd=rd)
    cfg, plan = planned_config(cfg, ctx, prep, train_data, model)  # the run's saved plan: nothing planned anew
    chunk_size, _ = resolve_chunk_size(cfg, model, device, rd, log, world.world_size)  # the run's saved choice
    job = resolve(cfg, train_data.num_users, num_units(cfg, train_data), plan, device, chunk_size=chunk_size)
    dataset = records_dataset(train_data)
    return TrainerInputs(model=model, tokenizer=tok, train_dataset=dataset, privacy=job.engine.config)


def records_dataset(data, user_field: str = USER_FIELD):
    """A tokenized :class:`~userdp.engine.UserData` as a ``datasets.Dataset``: one row a record, in
    the data's order, each user's author name its number zero-padded (so the Trainer's grouping,
    which numbers authors in sorted order, numbers them as the data does)."""
    from datasets import Dataset

    sizes = np.asarray(data.sizes(), dtype=np.int64)
    users = np.repeat(np.arange(len(sizes)), sizes)  # every record once, user by user
    records = np.arange(len(users)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    batch = data.gather(users, records)
    width = len(str(len(sizes)))
    names = [f"{u:0{width}d}" for u in users]
    return Dataset.from_dict(
        {user_field: names, "input_ids": batch["input_ids"].tolist(), "labels": batch["labels"].tolist()}
    )
