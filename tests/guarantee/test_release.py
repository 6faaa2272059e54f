"""What is released with a model depends on nothing its epsilon leaves out: properties over every
released file and every release path, not the cases that were shown.

1. **Release invariance.** The same seeded job run into folders of other names (a tuning trial's
   index was in its folder's name, and the name was in the model card's title) releases the same
   bytes; two unseeded jobs whose cohorts differ in size but whose released sums are forced equal
   release the same bytes. What may differ is listed, with why: the ledger journal's random run
   id and the hashes of its chain (public bookkeeping, drawn from OS entropy), the wall-clock start
   and duration (a side channel the report names). Everything a run writes is classified public or
   private by docs/threat_model.md, and a file it does not classify fails the test.
2. **Normalisation as accounted.** The noisy sum is divided by a public constant, never by a
   realised count, on every path (the engine's ULS, ELS and FedAvg, ``make_private``, two
   processes, the HF Trainer): two cohorts of different sizes given the same released sum move the
   parameters identically.
"""

import fnmatch
import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from _paths import REPO

from userdp.cli import main as cli
from userdp.engine import ELS, SGD, ULS, FedAvg, FlatClip, RunOptions, TrainConfig, make_private, train
from userdp.engine.noise.mechanism import NOISE_MECHANISMS, IIDGaussian
from userdp.engine.performance import Performance

from _engine_helpers import Mean, run_ranks, user_data
from _lm_corpus import write_tiny_run

DOC = (REPO / "docs" / "threat_model.md").read_text()

#: keys whose values may differ between two releases of the same model, and why (nothing else may)
VOLATILE = {
    "journal": "the ledger journal's head: a random run id (OS entropy) and the hashes of its chain",
    "run": "the ledger journal's random run id (ledger_head.json)",
    "head": "the hash of the ledger journal's last line, a chain from the random run id (ledger_head.json)",
    "started": "the wall-clock time the job started",
    "seconds": "the job's wall time (a side channel the report names)",
}


def _classes() -> dict[str, list[str]]:
    """docs/threat_model.md's classification of every path a run directory holds."""
    block = DOC.split("<!-- run-files: begin -->")[1].split("<!-- run-files: end -->")[0]
    out: dict[str, list[str]] = {"public": [], "private": []}
    for line in block.strip().splitlines():
        m = re.match(r"- \*\*(public|private)\*\*: (.*)", line.strip())
        if m:
            out[m.group(1)] += re.findall(r"`([^`]+)`", m.group(2))
    return out


def _class_of(rel: str, classes: dict) -> str | None:
    for kind, patterns in classes.items():
        if any(fnmatch.fnmatch(rel, p) for p in patterns):
            return kind
    return None


def _scrub(value):
    """A released JSON value with the volatile keys' values blanked (everything else kept)."""
    if isinstance(value, dict):
        return {k: ("<volatile>" if k in VOLATILE else _scrub(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value


def _released(run: Path) -> dict[str, object]:
    """Every public file of ``run`` (by the document's classification), volatile keys blanked."""
    classes = _classes()
    out = {}
    for p in sorted(run.rglob("*")):
        rel = p.relative_to(run).as_posix()
        if not p.is_file() or _class_of(rel, classes) != "public":
            continue
        if rel.endswith(".jsonl"):
            lines = p.read_text().splitlines()
            if rel.endswith("ledger_journal.jsonl"):  # a chain of random-nonce hashes: its shape only
                out[rel] = [sorted(json.loads(x)) for x in lines]
            else:
                out[rel] = [_scrub(json.loads(x)) for x in lines]
        elif rel.endswith(".json"):
            out[rel] = _scrub(json.loads(p.read_text()))
        elif rel.endswith(".safetensors"):  # its header orders the metadata at random: the content, compared
            from safetensors import safe_open

            with safe_open(str(p), "pt") as f:
                out[rel] = (f.metadata(), {k: f.get_tensor(k).numpy().tobytes() for k in sorted(f.keys())})
        else:
            out[rel] = p.read_bytes()
    return out


def _differences(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A folder for the tiny corpus; write_tiny_run seeds ``folder/cache`` with the session's model."""

    def corpus(name: str, training_extra: str = "", **kw):
        cfg, _ = write_tiny_run(tmp_path / name, training_extra, **kw)
        monkeypatch.setenv("USERDP_CACHE", str(tmp_path / name / "cache"))
        return cfg

    return tmp_path, corpus


def test_no_released_file_depends_on_the_run_folders_name(tiny):
    """C1, as a property: a tuning trial's folder carried its index (the card's title, report.md's
    heading and report.json's run_dir printed it, and the index tells K >= index + 1). The same
    seeded job run as "trials/trial-000" and as "elsewhere/trial-<random>" releases the same bytes;
    and a tuning plan names its trial folders at random, not by position."""
    tmp, corpus = tiny
    cfg = corpus("named", "  seed: 5\n")
    runs = [tmp / "named" / "trials" / "trial-000", tmp / "named" / "elsewhere" / "trial-7f3a0c9e51d2b864"]
    for out in runs:
        assert cli(["train", str(cfg), "--set", "training.steps=2", "--output", str(out), "--no-progress"]) == 0
    a, b = (_released(r) for r in runs)
    assert _differences(a, b) == []
    for r in runs:  # and no public file names the folder at all
        for p in r.rglob("*"):
            rel = p.relative_to(r).as_posix()
            if p.is_file() and _class_of(rel, _classes()) == "public":
                assert r.name.encode() not in p.read_bytes(), rel


def test_a_tuning_plan_names_its_trial_folders_at_random():
    from userdp.tuning.job import trial_dir_name

    names = {trial_dir_name() for _ in range(200)}
    assert len(names) == 200 and all(re.fullmatch(r"trial-[0-9a-f]{16}", n) for n in names)


ZERO_SUM_PLUGIN = '''
from userdp.engine.noise.mechanism import NOISE_MECHANISMS, IIDGaussian


class ZeroSum(IIDGaussian):
    """A broken mechanism for a test: the released sum is 0 whatever the cohort."""

    name = "zero_sum_for_test"

    def update(self, sums, state, std):
        for t in sums:
            t.zero_()
        return sums, state


if ZeroSum.name not in NOISE_MECHANISMS:
    NOISE_MECHANISMS.register(ZeroSum, name=ZeroSum.name)
'''


def test_no_public_file_is_a_function_of_the_cohort(tiny, isolated_registries):
    """H2 (fraction_clipped gave the cohort size back), as a property: two unseeded runs draw
    different cohorts (their private diagnostics differ), but a mechanism forces every released sum
    to 0, so the model is the same; then every public file must be the same too. A public file that
    held the loss, the fraction clipped, a non-finite count, a cohort size or a token count would
    differ. L1: the statement names the plugin mechanism that ran, not Gaussian noise."""
    tmp, corpus = tiny
    plugin = tmp / "zero_sum.py"
    plugin.write_text(ZERO_SUM_PLUGIN)
    cfg = corpus("cohorts")
    runs = [tmp / "cohorts" / "run", tmp / "cohorts" / "run2"]
    for out in runs:
        assert (
            cli(
                [
                    "train",
                    str(cfg),
                    "--plugin",
                    str(plugin),
                    "--set",
                    "privacy.noise=zero_sum_for_test",
                    "--set",
                    "training.steps=3",
                    "--set",
                    "training.cohort_size=12",
                    "--output",
                    str(out),
                    "--no-progress",
                ]
            )
            == 0
        )
    diag = [[json.loads(x) for x in (r / "diagnostics.jsonl").read_text().splitlines()] for r in runs]
    assert [d["loss"] for d in diag[0]] != [d["loss"] for d in diag[1]]  # the cohorts did differ
    a, b = (_released(r) for r in runs)
    assert _differences(a, b) == []
    priv = json.loads((runs[0] / "privacy.json").read_text())
    said = " ".join(priv["assumptions"])
    assert "plugin mechanism 'zero_sum_for_test'" in said and "userdp does not verify" in said
    assert "Gaussian with standard deviation sigma*C on the sum" not in said
    card = (runs[0] / "model" / "README.md").read_text()
    assert "zero_sum_for_test" in card


def test_every_file_a_run_writes_is_classified_public_or_private(tiny):
    """docs/threat_model.md classifies every path a run directory holds: public (released, each key
    justified in the released-keys list) or private (the data holder's: never released). A new file
    nobody classified fails here."""
    tmp, corpus = tiny
    board = importlib.util.find_spec("tensorboard") is not None  # the extra: its folder too, where installed
    cfg = corpus("classified", tail=f"output:\n  tensorboard: {str(board).lower()}\n  cache: run\n")
    out = tmp / "classified" / "run"
    assert cli(["train", str(cfg), "--set", "training.steps=2", "--output", str(out), "--no-progress"]) == 0
    classes = _classes()
    unclassified = [
        p.relative_to(out).as_posix()
        for p in out.rglob("*")
        if p.is_file() and _class_of(p.relative_to(out).as_posix(), classes) is None
    ]
    assert unclassified == []
    for must in ("diagnostics.jsonl", "tensorboard/x", "curves.png", "cache/x"):
        assert _class_of(must, classes) == "private", must
    for must in ("metrics.jsonl", "privacy.json", "report.md", "model/README.md", "model/model.safetensors"):
        assert _class_of(must, classes) == "public", must
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert set().union(*map(set, metrics)) == {"step", "epsilon", "clip_norm", "journal"}


# ---------------------------------------------------------------------- normalisation as accounted


class _OnesSum(IIDGaussian):
    """The released sum is 1 in every coordinate, whatever the cohort (on the rank that adds noise)."""

    name = "ones_sum_for_test"

    def update(self, sums, state, std):
        for t in sums:
            t.fill_(1.0)
        return sums, state


def _zero_grad_loss(model, batch):
    """A loss whose gradient is 0 for every unit: the clipped sum is 0, the released sum is the
    mechanism's alone."""
    x = next(iter(batch.values()))
    return (model.theta.sum() * 0.0).expand(x.shape[0]).clone()


SIZES = [3, 1, 5, 2, 8, 4, 6, 7] * 5


@pytest.mark.parametrize(
    "algorithm", [ULS(4, 0.3), ELS(2, 0.2), FedAvg(2, 0.3, local_epochs=1, local_lr=0.1)], ids=["uls", "els", "fedavg"]
)
@pytest.mark.parametrize("path", ["train", "make_private", "two_processes"])
def test_the_sum_is_divided_by_a_public_constant_whatever_the_cohorts_size(isolated_registries, algorithm, path):
    """Two seeds draw cohorts of different sizes; the released sum is forced to 1 in both. A
    denominator that followed the realised cohort (Opacus 0.9-1.5.4 divided by the batch's size)
    would move the parameters by different amounts; a public one moves them alike."""
    NOISE_MECHANISMS.register(_OnesSum, name=_OnesSum.name, replace=True)

    def run(seed):
        cfg = TrainConfig(
            algorithm=algorithm,
            steps=3,
            clipping=FlatClip(0.5),
            optimizer=SGD(1.0),
            noise_multiplier=1.0,
            delta=1e-5,
            seed=seed,
            noise=_OnesSum.name,
            accountant="rdp",
            performance=Performance(track_epsilon=False),
        )
        if path == "train":
            model = Mean(4)
            res = train(model, user_data(SIZES, d=4, seed=1), _zero_grad_loss, cfg)
            return model.theta.detach().clone(), [h["units"] for h in res.history]
        if path == "make_private":
            model = Mean(4)
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            with make_private(model, opt, user_data(SIZES, d=4, seed=1), _zero_grad_loss, cfg) as private:
                for step in private:
                    opt.zero_grad()
                    step.backward()
                    opt.step()
            return model.theta.detach().clone(), [h["units"] for h in private.history]
        models = [Mean(4), Mean(4)]
        results, _ = run_ranks(
            2,
            lambda r, comb: train(
                models[r], user_data(SIZES, d=4, seed=1), _zero_grad_loss, cfg, RunOptions(combiner=comb)
            ),
        )
        assert torch.equal(models[0].theta, models[1].theta)
        return models[0].theta.detach().clone(), [h["units"] for h in results[0].history]

    (theta_a, units_a), (theta_b, units_b) = run(1), run(2)
    assert units_a != units_b  # the cohorts' sizes differ
    assert torch.equal(theta_a, theta_b)
    assert not torch.equal(theta_a, torch.zeros_like(theta_a))  # and the step did move the model


def test_the_hf_trainer_divides_by_a_public_constant_whatever_the_cohorts_size(tmp_path, isolated_registries):
    """The same property through userdp.hf.PrivateTrainer (its optimizer and schedule are the
    Trainer's; the sum reaching them must not carry the cohort's size)."""
    pytest.importorskip("transformers")
    from _hf_helpers import hf_args as _args
    from _hf_helpers import hf_dataset as _dataset
    from _hf_helpers import hf_model as _model

    from userdp.hf import PrivateTrainer

    NOISE_MECHANISMS.register(_OnesSum, name=_OnesSum.name, replace=True)

    def loss(model, batch):  # one loss per record, with no gradient
        return (sum(p.sum() for p in model.parameters()) * 0.0).expand(batch["input_ids"].shape[0]).clone()

    out = []
    for seed in (1, 2):
        privacy = TrainConfig(
            algorithm=ULS(group_size=2, sampling_rate=0.3),
            steps=2,
            clipping=FlatClip(0.5),
            noise_multiplier=1.0,
            delta=1e-4,
            seed=seed,
            noise=_OnesSum.name,
        )
        trainer = PrivateTrainer(
            model=_model(),
            args=_args(tmp_path / str(seed)),
            train_dataset=_dataset(),
            privacy=privacy,
            user_field="user",
            loss_fn=loss,
        )
        trainer.train()
        out.append(
            ([h["units"] for h in trainer._private.history], [p.detach().clone() for p in trainer.model.parameters()])
        )
    assert out[0][0] != out[1][0]
    for a, b in zip(out[0][1], out[1][1], strict=True):
        assert torch.equal(a, b)
    assert np.isfinite(float(out[0][1][0].sum()))


def test_the_trainers_output_folder_is_classified_and_its_statement_names_what_it_declares(tmp_path):
    """The HF path: every file PrivateTrainer's output_dir holds (the Trainer's checkpoint-N/ folders
    included) is classified, and its statement has the sections `userdp train`'s has: the starting
    model and tokenizer declared public, the settings chosen outside the record, and an eval set
    checked by user (a record-level split that put training users into it is named)."""
    pytest.importorskip("transformers")
    from _hf_helpers import hf_args as _args
    from _hf_helpers import hf_dataset as _dataset
    from _hf_helpers import hf_model as _model
    from datasets import Dataset

    from userdp.hf import PrivateTrainer

    train_ds = _dataset()
    overlapping = Dataset.from_dict({"input_ids": [[1, 2, 3]] * 4, "user": ["u0", "u7", "stranger", "u14"]})
    held_out = Dataset.from_dict({"input_ids": [[1, 2, 3]] * 2, "user": ["x1", "x2"]})
    privacy = TrainConfig(
        algorithm=ULS(group_size=2, sampling_rate=0.3),
        steps=2,
        clipping=FlatClip(0.5),
        noise_multiplier=1.0,
        delta=1e-4,
    )
    for name, ev in (("overlap", overlapping), ("held", held_out)):
        out = tmp_path / name
        trainer = PrivateTrainer(
            model=_model(),
            args=_args(None, output_dir=str(out), save_strategy="steps", save_steps=1),
            train_dataset=train_ds,
            eval_dataset=ev,
            privacy=privacy,
            user_field="user",
        )
        trainer.train()
        classes = _classes()
        files = [p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()]
        assert any(f.startswith("checkpoint-") for f in files)
        assert [f for f in files if _class_of(f, classes) is None] == []
        said = json.loads((out / "privacy.json").read_text())["not_accounted"]
        assert any(n.startswith("starting model GPT2LMHeadModel declared public") for n in said), said
        assert any("chosen by the script" in n for n in said)
        evaluation = [n for n in said if n.startswith("evaluation:")]
        if name == "overlap":
            assert "holds records of 3 training users" in evaluation[0]
        else:
            assert "holds no training user" in evaluation[0]
        assert cli(["report", str(out)]) == 0  # the statement verifies against its journal
