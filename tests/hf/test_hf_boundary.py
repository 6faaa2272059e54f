"""The Hugging Face boundary (userdp.hf_boundary): what a Trainer script gives PrivateTrainer is
used or refused in one line naming the argument, before any step is counted and before anything is
written. Written from the classes: the Trainer's own arguments, the dataset's kind, every way a
row can be wrong (its author, its ids, its labels), the whole dataset having nothing to learn,
a resume that names nothing, and a budget that admits no step."""

import math
import warnings

import pytest
import torch
from _hf_helpers import hf_args as _args
from _hf_helpers import hf_dataset as _dataset
from _hf_helpers import hf_model as _model
from datasets import Dataset, IterableDataset

from userdp.engine import ULS, FedAvg, FlatClip
from userdp.errors import UserError
from userdp.hf import PrivateTrainer

from _engine_helpers import train_config

warnings.filterwarnings("ignore", module="transformers")


def _privacy(**kw):
    base = dict(
        algorithm=ULS(group_size=2, sampling_rate=0.3),
        steps=2,
        clipping=FlatClip(0.5),
        noise_multiplier=1.0,
        delta=1e-4,
    )
    return train_config(**{**base, **kw})


def _rows(**columns):
    n = len(next(iter(columns.values())))
    base = {"input_ids": [[1, 2, 3]] * n, "user": [f"u{i % 3}" for i in range(n)]}
    return Dataset.from_dict({**base, **columns})


def _gen():
    yield {"input_ids": [1, 2], "user": "a"}


CASES = {
    # the dataset's kind
    "no train_dataset": (dict(train_dataset=None), "give train_dataset"),
    "an empty train_dataset": (
        dict(train_dataset=lambda: Dataset.from_dict({"input_ids": [], "user": []})),
        "holds no rows",
    ),
    "an iterable dataset": (dict(train_dataset=lambda: IterableDataset.from_generator(_gen)), "iterable or streaming"),
    # each row
    "input_ids nested one level too deep": (
        dict(train_dataset=lambda: _rows(input_ids=[[[1, 2], [3]]] * 4)),
        "input_ids holds a list",
    ),
    "input_ids stored as floats": (
        dict(train_dataset=lambda: _rows(input_ids=[[1.0, 2.7, 3.0]] * 4)),
        "input_ids holds float",
    ),
    "a negative token id": (dict(train_dataset=lambda: _rows(input_ids=[[1, -4, 3]] * 4)), "negative token id -4"),
    "labels longer than input_ids": (
        dict(train_dataset=lambda: _rows(labels=[[1, 2, 3, 4]] * 4)),
        "labels has 4 entries",
    ),
    "a label below -100": (dict(train_dataset=lambda: _rows(labels=[[1, -7, 3]] * 4)), "labels holds -7"),
    "every label -100": (dict(train_dataset=lambda: _rows(labels=[[-100, -100, -100]] * 4)), "every label is -100"),
    "a NaN author": (dict(train_dataset=lambda: _rows(user=[1.0, math.nan, 2.0, 3.0])), "user is nan"),
    "an empty author": (dict(train_dataset=lambda: _rows(user=["a", " ", "b", "c"])), "user is ' '"),
    # the Trainer's arguments
    "fsdp on one process": (dict(args=dict(fsdp="full_shard")), "TrainingArguments.fsdp="),
    "push_to_hub offline": (dict(args=dict(push_to_hub=True, hub_model_id="me/model")), "push_to_hub=True"),
    "FedAvg as the algorithm": (dict(privacy=_privacy(algorithm=FedAvg(2, 0.3))), "FedAvg"),
    "a fixed sigma whose first step passes the target": (
        dict(privacy=_privacy(noise_multiplier=0.3, target_epsilon=1.0)),
        "not one step fits",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_bad_trainer_input_is_one_line_naming_it_before_any_step(tmp_path, case):
    given, needle = CASES[case]
    ds = given.get("train_dataset", _dataset)
    kw = dict(train_dataset=ds() if callable(ds) else ds, privacy=given.get("privacy", _privacy()))
    try:
        args = _args(tmp_path, **given.get("args", {}))
    except Exception as exc:  # noqa: BLE001 - transformers' own TrainingArguments refused it (not ours to word)
        pytest.skip(f"TrainingArguments itself refuses this here: {exc}")
    with pytest.raises(UserError) as exc:
        trainer = PrivateTrainer(model=_model(), args=args, user_field="user", **kw)
        trainer.train()
    msg = str(exc.value)
    assert needle in msg and "\n" not in msg, msg
    assert not (tmp_path / "out" / "checkpoints" / "ledger_journal.jsonl").exists()  # no step counted
    assert not (tmp_path / "out" / "privacy.json").exists() and not (tmp_path / "out" / "model").exists()


def test_a_pad_token_added_without_resizing_the_model_is_refused(tmp_path):
    class Tok:  # a tokenizer whose added pad token is past the model's 64 embeddings
        pad_token_id = 64

    with pytest.raises(UserError, match=r"pad token id 64 is outside the model's vocabulary of 64.*resize_token"):
        PrivateTrainer(
            model=_model(),
            args=_args(tmp_path),
            train_dataset=_dataset(),
            processing_class=Tok(),
            privacy=_privacy(),
            user_field="user",
        )


def test_an_output_dir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "out"
    f.write_text("a file")
    with pytest.raises(UserError, match="output_dir=.* is a file"):
        PrivateTrainer(
            model=_model(), args=_args(tmp_path), train_dataset=_dataset(), privacy=_privacy(), user_field="user"
        )
    assert f.read_text() == "a file"


@pytest.mark.parametrize(
    "resume, needle",
    [
        ("missing", "no such folder"),
        ("file", "is a file"),
        (True, "no checkpoint-N folder"),
        (3.5, "give a checkpoint-N"),
    ],
)
def test_a_resume_that_names_nothing_is_refused_before_any_step(tmp_path, resume, needle):
    trainer = PrivateTrainer(
        model=_model(), args=_args(tmp_path), train_dataset=_dataset(), privacy=_privacy(), user_field="user"
    )
    if resume == "missing":
        resume = str(tmp_path / "checkpoint-9")
    elif resume == "file":
        resume = tmp_path / "a-file"
        resume.write_text("x")
    with pytest.raises(UserError, match=needle):
        trainer.train(resume_from_checkpoint=resume)
    assert trainer._private is None


def test_good_rows_still_train(tmp_path):
    """The boundary refuses what is wrong, not what is unusual: masked prompts, one-token rows, integer
    author ids and numpy ints all train."""
    import numpy as np

    ds = Dataset.from_dict(
        {
            "input_ids": [[1, 2, 3], [4], [5, 6]] * 4,
            "labels": [[-100, 2, 3], [4], [-100, 6]] * 4,
            "user": [int(x) for x in np.arange(12) % 5],
        }
    )
    trainer = PrivateTrainer(
        model=_model(), args=_args(tmp_path), train_dataset=ds, privacy=_privacy(), user_field="user"
    )
    trainer.train()
    assert trainer.state.global_step == 2 and torch.isfinite(next(trainer.model.parameters())).all()


def _mask_first_two(features):
    """A label-masking collator: the first two tokens of each record are not learned from."""
    ids = [f["input_ids"] for f in features]
    width = max(len(r) for r in ids)
    out = torch.zeros(len(ids), width, dtype=torch.long)
    lab = torch.full((len(ids), width), -100, dtype=torch.long)
    for i, r in enumerate(ids):
        out[i, : len(r)] = torch.tensor(r)
        lab[i, 2 : len(r)] = torch.tensor(r[2:])
    return {"input_ids": out, "labels": lab}


def test_the_scripts_data_collator_changes_what_is_learned_as_in_a_plain_run(tmp_path):
    """The collator was silently ignored (0 calls). It is applied to each record, so a label-masking
    collator gives the same run as the same masking written into the dataset's labels column."""
    ds = _dataset()
    privacy = _privacy(seed=5, steps=3)
    with_collator = PrivateTrainer(
        model=_model(),
        args=_args(tmp_path / "a"),
        train_dataset=ds,
        data_collator=_mask_first_two,
        privacy=privacy,
        user_field="user",
    )
    assert any("data_collator (function) applied to each record" in n for n in with_collator.userdp_notes)
    with_collator.train()
    masked = ds.map(lambda r: {"labels": [-100, -100] + r["input_ids"][2:]})
    with_labels = PrivateTrainer(
        model=_model(), args=_args(tmp_path / "b"), train_dataset=masked, privacy=privacy, user_field="user"
    )
    with_labels.train()
    plain = PrivateTrainer(
        model=_model(), args=_args(tmp_path / "c"), train_dataset=ds, privacy=privacy, user_field="user"
    )
    plain.train()
    for a, b in zip(with_collator.model.parameters(), with_labels.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert any(
        not torch.allclose(a, c)
        for a, c in zip(with_collator.model.parameters(), plain.model.parameters(), strict=True)
    )


def test_a_collator_that_fails_on_a_record_is_one_line(tmp_path):
    def broken(features):
        raise KeyError("attention_mask")

    with pytest.raises(UserError, match="data_collator failed on train_dataset row 0 \\(KeyError"):
        PrivateTrainer(
            model=_model(),
            args=_args(tmp_path),
            train_dataset=_dataset(),
            data_collator=broken,
            privacy=_privacy(),
            user_field="user",
        )


def test_a_subclass_whose_compute_loss_would_never_run_is_refused(tmp_path):
    class MyTrainer(PrivateTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            return super().compute_loss(model, inputs, return_outputs, **kw)

    with pytest.raises(UserError, match="MyTrainer.compute_loss is overridden.*loss_fn"):
        MyTrainer(model=_model(), args=_args(tmp_path), train_dataset=_dataset(), privacy=_privacy(), user_field="user")
