"""Reproducing a ``userdp train`` run with a Hugging Face Trainer (issue 61, item 8): the run's
inputs rebuilt from its run directory (userdp.hf_inputs) and given to PrivateTrainer train the
command line's model bit for bit, with the same epsilon, and nothing in the run directory moves."""

import hashlib
import json

import pytest
import torch
from _hf_helpers import hf_args
from safetensors.torch import load_file

from userdp.cli import main as cli
from userdp.errors import UserError
from userdp.hf import PrivateTrainer
from userdp.hf_inputs import records_dataset, trainer_inputs

from _lm_corpus import write_tiny_run


def _hashes(folder):
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_private_trainer_given_a_runs_inputs_reproduces_the_cli_run_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.setenv("USERDP_CACHE", str(tmp_path / "cache"))
    cfg, _ = write_tiny_run(tmp_path, "  seed: 3\n")
    run = tmp_path / "run"
    assert cli(["train", str(cfg), "--output", str(run), "--no-progress"]) == 0
    before = _hashes(run)
    inputs = trainer_inputs(run)
    assert _hashes(run) == before  # the run directory is read, never written
    start = {k: v.clone() for k, v in inputs.model.state_dict().items()}
    trainer = PrivateTrainer(
        model=inputs.model,
        args=hf_args(tmp_path),
        train_dataset=inputs.train_dataset,
        optimizers=inputs.optimizers(),
        privacy=inputs.privacy,
        user_field=inputs.user_field,
    )
    trainer.train()
    cli_model = load_file(str(run / "model" / "model.safetensors"))
    ours = inputs.model.state_dict()
    assert set(cli_model) <= set(ours)
    for name, tensor in cli_model.items():
        assert torch.equal(ours[name], tensor), name  # bit for bit
    assert any(not torch.equal(ours[n], start[n]) for n in cli_model)  # and training moved it
    record = trainer.privacy_record()
    assert record.steps_applied == inputs.privacy.steps
    assert record.epsilon == pytest.approx(json.loads((run / "privacy.json").read_text())["epsilon"], rel=1e-12)


def test_the_datasets_rows_are_the_runs_records_in_the_runs_user_order():
    class Two:  # two users, of 2 and 1 records of 3 tokens
        def sizes(self):
            return torch.tensor([2, 1]).numpy()

        def gather(self, users, records):
            ids = torch.tensor([[10 * int(u) + int(r)] * 3 for u, r in zip(users, records, strict=True)])
            return {"input_ids": ids, "labels": ids.clone()}

    ds = records_dataset(Two())
    assert ds["user"] == ["0", "0", "1"]
    assert ds["input_ids"] == [[0, 0, 0], [1, 1, 1], [10, 10, 10]]


def test_a_folder_that_is_not_a_run_directory_is_refused_in_one_line(tmp_path):
    with pytest.raises(UserError, match="no config.yaml"):
        trainer_inputs(tmp_path)


def test_an_audit_runs_directory_is_refused_in_one_line(tmp_path):
    # its canary users trained beside the data: a Trainer given the data alone would not reproduce it
    cfg, _ = write_tiny_run(tmp_path, "  seed: 3\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(cfg.read_text().rstrip("\n") + "\naudit:\n  canaries: 4\n")
    with pytest.raises(UserError, match="audit run"):
        trainer_inputs(run)
