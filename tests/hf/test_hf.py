"""userdp.hf.PrivateTrainer (issue 38): a Hugging Face Trainer script made user-level private. The
Trainer-driven run is the engine's own-loop run (same seed: same cohorts, parameters and epsilon),
the settings that would break the guarantee are refused in one line, and a batch holds only the
records of the users it names."""

import dataclasses
import json
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from _hf_helpers import hf_args as _args
from _hf_helpers import hf_dataset as _dataset
from _hf_helpers import hf_model as _model
from _paths import REPO, TESTS
from datasets import Dataset
from transformers import TrainingArguments

from userdp.engine import ELS, ULS, FlatClip, TrainConfig, make_private
from userdp.errors import UserError
from userdp.hf import REFUSED, PrivateTrainer, UserRecords, check_arguments
from userdp.lm.models import causal_lm_loss

warnings.filterwarnings("ignore", module="transformers")


def _own_loop(ds, privacy):
    """The same run as ``make_private`` in a plain loop with SGD(0.2), as a script would write it:
    (the model, the PrivateTraining)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    with make_private(model, opt, UserRecords(ds, "user"), causal_lm_loss, privacy) as private:
        for step in private:
            opt.zero_grad()
            step.backward()
            opt.step()
    return model, private


@pytest.mark.parametrize(
    "algorithm", [ULS(group_size=2, sampling_rate=0.3), ELS(group_size=2, sampling_rate=0.15)], ids=["uls", "els"]
)
def test_a_trainer_run_is_the_engines_own_loop_run(tmp_path, algorithm):
    """Same seed: the Trainer-driven run and make_private in a plain loop with the same optimizer
    draw the same cohorts and end with the same parameters and epsilon; the Trainer's log carries
    epsilon, and the output folder holds the ledger journal and the record."""
    ds = _dataset()
    privacy = TrainConfig(
        algorithm=algorithm, steps=4, clipping=FlatClip(0.5), noise_multiplier=1.0, delta=1e-4, seed=11
    )
    trainer = PrivateTrainer(model=_model(), args=_args(tmp_path), train_dataset=ds, privacy=privacy, user_field="user")
    trainer.train()

    model, private = _own_loop(ds, privacy)

    assert trainer.state.global_step == 4
    assert [h["units"] for h in trainer._private.history] == [h["units"] for h in private.history]
    for a, b in zip(trainer.model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)
    assert trainer.epsilon() == pytest.approx(private.epsilon(), rel=1e-12) and trainer.epsilon() > 0
    assert all("epsilon" in h for h in trainer.state.log_history if "loss" in h)
    rec = json.loads((tmp_path / "out" / "privacy.json").read_text())
    eng = rec["engine_record"]
    assert eng["steps_accounted"] == 4 and eng["stopped"] == "completed" and eng["journal"] is not None
    assert rec["epsilon"] == pytest.approx(trainer.epsilon(), rel=1e-12)
    assert any("max_grad_norm" in n for n in rec["userdp_notes"])  # the default 1.0 was set aside, and said
    assert any("training loss" in n for n in rec["not_accounted"])
    assert (tmp_path / "out" / "checkpoints" / "ledger_journal.jsonl").is_file()


@pytest.mark.parametrize(
    "name, value",
    [
        ("gradient_accumulation_steps", 2),
        ("fp16", True),
        ("torch_compile", True),
        ("deepspeed", "ds.json"),
        ("fsdp", "full_shard"),
        ("neftune_noise_alpha", 5.0),
        ("label_smoothing_factor", 0.1),
        ("mixed_precision", "bf16"),
        ("n_gpu", 2),
        ("load_best_model_at_end", True),
        ("save_strategy", "best"),
    ],
)
def test_each_setting_that_would_break_the_guarantee_is_one_line_naming_it(name, value):
    args = types.SimpleNamespace(
        gradient_accumulation_steps=1,
        fp16=False,
        bf16=False,
        mixed_precision="no",
        torch_compile=False,
        load_best_model_at_end=False,
        save_strategy="steps",
        deepspeed=None,
        fsdp=None,
        neftune_noise_alpha=None,
        label_smoothing_factor=0.0,
        n_gpu=1,
        world_size=1,
        max_grad_norm=0.0,
        max_steps=-1,
        per_device_train_batch_size=8,
        num_train_epochs=3.0,
    )
    check_arguments(args)  # the defaults pass
    setattr(args, name, value)
    with pytest.raises(UserError) as exc:
        check_arguments(args)
    msg = str(exc.value)
    assert "\n" not in msg and (f"TrainingArguments.{name}=" in msg or f"{value} " in msg), msg
    assert {n for n, _, _ in REFUSED} <= {
        "gradient_accumulation_steps",
        "fp16",
        "mixed_precision",
        "torch_compile",
        "deepspeed",
        "fsdp",
        "neftune_noise_alpha",
        "label_smoothing_factor",
        "load_best_model_at_end",
        "save_strategy",
    }


def test_a_checkpoint_or_trial_chosen_by_an_unnoised_score_is_refused_before_any_step(tmp_path):
    """Choosing the released checkpoint (load_best_model_at_end, save_strategy="best") or a trial
    (hyperparameter_search, train(trial=...)) by an eval score computed without noise is not
    post-processing: each is refused in one line, and nothing is written or counted."""
    ds = _dataset()
    privacy = TrainConfig(
        algorithm=ULS(group_size=2, sampling_rate=0.3),
        steps=2,
        clipping=FlatClip(0.5),
        noise_multiplier=1.0,
        delta=1e-4,
    )
    for kw in (
        dict(
            load_best_model_at_end=True,
            eval_strategy="steps",
            save_strategy="steps",
            eval_steps=1,
            save_steps=1,
            metric_for_best_model="loss",
        ),
        dict(save_strategy="best", eval_strategy="steps", eval_steps=1, metric_for_best_model="loss"),
    ):
        with pytest.raises(UserError, match=f"TrainingArguments.{next(iter(kw))}=") as exc:
            PrivateTrainer(
                model=_model(),
                args=_args(tmp_path, **kw),
                train_dataset=ds,
                eval_dataset=ds,
                privacy=privacy,
                user_field="user",
            )
        assert "\n" not in str(exc.value) and "un-noised" in str(exc.value)
    trainer = PrivateTrainer(model=_model(), args=_args(tmp_path), train_dataset=ds, privacy=privacy, user_field="user")
    with pytest.raises(UserError, match="hyperparameter_search: .*userdp tune"):
        trainer.hyperparameter_search(n_trials=2)
    with pytest.raises(UserError, match=r"train\(trial=...\): .*userdp tune"):
        trainer.train(trial={"learning_rate": 0.1})
    assert trainer._private is None and not (tmp_path / "out" / "checkpoints").exists()


_TORCHRUN_SCRIPT = """
import sys, warnings
warnings.filterwarnings("ignore")
import torch
sys.path.insert(0, {tests!r})
from _hf_helpers import hf_args as _args, hf_dataset as _dataset, hf_model as _model
from userdp.engine import ULS, FlatClip, TrainConfig
from userdp.hf import PrivateTrainer

out = sys.argv[1]
privacy = TrainConfig(algorithm=ULS(group_size=2, sampling_rate=0.3), steps=4, clipping=FlatClip(0.5),
                      noise_multiplier=1.0, delta=1e-4, seed=11)
trainer = PrivateTrainer(model=_model(), args=_args(None, output_dir=out), train_dataset=_dataset(), privacy=privacy,
                         user_field="user")
trainer.train()
torch.save({{"params": [p.detach() for p in trainer.model.parameters()], "epsilon": trainer.epsilon(),
            "units": [h["units"] for h in trainer._private.history], "world": trainer.args.world_size}},
           out + f"/result-{{trainer.args.process_index}}.pt")
"""


@pytest.mark.heavy(counterpart="tests/hf/test_hf.py::test_a_trainer_run_is_the_engines_own_loop_run")
@pytest.mark.slow
def test_a_trainer_script_under_torchrun_is_the_one_process_run(tmp_path):
    """The same script on two processes (torchrun, gloo): every process draws the same cohorts,
    computes its share, and userdp sums them (the model is not wrapped in DDP): both processes end
    with one process's parameters and epsilon; rank 0 alone writes the run folder, which `userdp
    report` verifies and which says two processes ran."""
    import os
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(_TORCHRUN_SCRIPT.format(tests=str(TESTS)))
    env = dict(os.environ, OMP_NUM_THREADS="1", USERDP_CACHE=str(tmp_path / "cache"))
    privacy = TrainConfig(
        algorithm=ULS(group_size=2, sampling_rate=0.3),
        steps=4,
        clipping=FlatClip(0.5),
        noise_multiplier=1.0,
        delta=1e-4,
        seed=11,
    )  # the script's, in this one process
    one = PrivateTrainer(
        model=_model(),
        args=_args(None, output_dir=str(tmp_path / "one")),
        train_dataset=_dataset(),
        privacy=privacy,
        user_field="user",
    )
    one.train()
    ref = {
        "params": [p.detach() for p in one.model.parameters()],
        "epsilon": one.epsilon(),
        "units": [h["units"] for h in one._private.history],
        "world": one.args.world_size,
    }
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(script),
            str(tmp_path / "two"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert ref["world"] == 1
    for rank in (0, 1):
        got = torch.load(tmp_path / "two" / f"result-{rank}.pt")
        assert got["world"] == 2 and got["units"] == ref["units"] and got["epsilon"] == ref["epsilon"]
        for a, b in zip(got["params"], ref["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # float32 sums in another order
    rec = json.loads((tmp_path / "two" / "privacy.json").read_text())
    assert rec["compute"]["processes"] == {"world_size": 2, "backend": "gloo"}
    assert any(n.startswith("2 processes (torchrun)") for n in rec["userdp_notes"])
    report = subprocess.run(
        [sys.executable, "-m", "userdp", "report", str(tmp_path / "two")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr[-2000:]


def test_a_real_trainer_refuses_accumulation_and_records_it_cannot_read(tmp_path):
    ds = _dataset()
    privacy = TrainConfig(algorithm=ULS(2, 0.3), steps=2, noise_multiplier=1.0, delta=1e-4)
    with pytest.raises(UserError, match="gradient_accumulation_steps=2"):
        PrivateTrainer(
            model=_model(), args=_args(tmp_path, gradient_accumulation_steps=2), train_dataset=ds, privacy=privacy
        )
    with pytest.raises(UserError, match="no column 'author'"):
        PrivateTrainer(model=_model(), args=_args(tmp_path), train_dataset=ds, privacy=privacy, user_field="author")
    empty = Dataset.from_dict({"input_ids": [[1, 2], []], "user": ["a", "b"]})
    with pytest.raises(UserError, match="row 1: input_ids is empty"):
        UserRecords(empty, "user")
    long = Dataset.from_dict({"input_ids": [[1] * 17, [2, 3]], "user": ["a", "b"]})  # the model has 16 positions
    with pytest.raises(UserError, match="17 tokens, more than the model's 16 positions"):
        PrivateTrainer(model=_model(), args=_args(tmp_path), train_dataset=long, privacy=privacy)
    foreign = Dataset.from_dict({"input_ids": [[1, 2], [2, 64]], "user": ["a", "b"]})  # vocabulary of 64
    with pytest.raises(UserError, match="token id 64 is outside the model's vocabulary of 64"):
        PrivateTrainer(model=_model(), args=_args(tmp_path), train_dataset=foreign, privacy=privacy)


def test_a_batch_holds_only_the_records_of_the_users_it_names():
    """However the cohort is drawn, row i of a gathered batch is a record of users[i], right-padded,
    with labels -100 on the padding and a given labels column kept."""
    ds = _dataset(labels=True)
    data = UserRecords(ds, "user", pad_token_id=63)
    by_user: dict[str, list] = {}
    for ids, lab, u in zip(ds["input_ids"], ds["labels"], ds["user"], strict=True):
        by_user.setdefault(u, []).append((ids, lab))
    rng = np.random.default_rng(5)
    users = rng.integers(0, data.num_users, 200)
    recs = (rng.random(200) * data.sizes()[users]).astype(np.int64)
    batch = data.gather(users, recs)
    assert batch["input_ids"].shape == (200, data.seq_len)
    for i, (u, r) in enumerate(zip(users, recs, strict=True)):
        ids, lab = by_user[data.user_ids[u]][r]
        n = len(ids)
        assert batch["input_ids"][i, :n].tolist() == ids and (batch["input_ids"][i, n:] == 63).all()
        assert batch["labels"][i, :n].tolist() == lab and (batch["labels"][i, n:] == -100).all()
    assert int(data.sizes().sum()) == len(ds) and data.num_users == 30


@pytest.mark.slow
def test_the_example_script_runs_as_docs_hf_md_shows(tmp_path, capsys, monkeypatch):
    """examples/hf_trainer.py as docs/hf.md runs it (in this process: the imports are already paid)."""
    import runpy
    import sys

    example = REPO / "examples" / "hf_trainer.py"
    monkeypatch.setattr(sys, "argv", [str(example), "--steps", "3", "--output", str(tmp_path / "out")])
    runpy.run_path(str(example), run_name="__main__")
    out = capsys.readouterr().out
    assert "over 3 steps (completed)" in out
    eps = float(out.split("user-level (")[1].split(",")[0])
    assert 0 < eps <= 3.0
    assert json.loads((tmp_path / "out" / "privacy.json").read_text())["steps_taken"] == 3


def test_a_crash_then_resume_from_checkpoint_counts_every_begun_step_once(tmp_path):
    """save_steps=2: userdp's checkpoint is written with each Trainer checkpoint. A crash after step
    5 (released: the ledger counted it) leaves checkpoint-4; train(resume_from_checkpoint=True)
    continues at step 5 with the ledger: 6 steps applied, 7 accounted (one lost, its noise never
    reused). A fresh run in the same output_dir, or a resume from an older checkpoint, is refused."""
    from transformers import TrainerCallback

    class Crash(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 5:
                raise RuntimeError("killed after step 5")

    ds = _dataset()
    privacy = TrainConfig(algorithm=ULS(2, 0.3), steps=6, noise_multiplier=1.0, delta=1e-4)  # unseeded
    args = _args(tmp_path, save_strategy="steps", save_steps=2)
    first = PrivateTrainer(model=_model(), args=args, train_dataset=ds, privacy=privacy, callbacks=[Crash()])
    with pytest.raises(RuntimeError, match="killed after step 5"):
        first.train()
    out = tmp_path / "out"
    assert (out / "checkpoint-4").is_dir() and len(
        (out / "checkpoints" / "ledger_journal.jsonl").read_text().splitlines()
    ) - 1 == 5
    # a fresh run would start a second ledger: refused in the Trainer's terms (not the engine's resume=True)
    with pytest.raises(
        UserError, match=r"already holds a private run .*trainer\.train\(resume_from_checkpoint=True\)"
    ) as exc:
        PrivateTrainer(model=_model(), args=args, train_dataset=ds, privacy=privacy).train()
    assert "resume=True" not in str(exc.value).replace("resume_from_checkpoint=True", "")
    with pytest.raises(UserError, match="at step 2, userdp's .* at step 4"):
        PrivateTrainer(model=_model(), args=args, train_dataset=ds, privacy=privacy).train(
            resume_from_checkpoint=str(out / "checkpoint-2")
        )
    again = PrivateTrainer(model=_model(), args=args, train_dataset=ds, privacy=privacy)
    again.train(resume_from_checkpoint=True)
    rec = again.privacy_record()
    assert again.state.global_step == 6 and rec["steps_applied"] == 6
    assert rec["steps_lost_to_crashes"] == 1 and rec["steps_accounted"] == 7 and rec["stopped"] == "completed"
    assert again.epsilon() > first._private.epsilon() > 0
    # the statement of the resumed run is verified against the ledger journal: every begun step in it
    from userdp.lm.report import build_report

    assert build_report(out)["steps_taken"] == 7


def test_userdp_report_verifies_the_trainers_output_folder_and_refuses_edits(tmp_path, capsys):
    """The output folder is a run directory `userdp report` verifies: privacy.json's epsilon is
    re-derived from its DpEvent and bound to the ledger journal, config.yaml to the journal, the
    released model to its manifest; report.md and the model card state the guarantee. An edited
    epsilon, an edited privacy config or an edited model file is refused in one line."""
    import shutil

    from transformers import AutoModelForCausalLM

    from userdp.cli import main as cli

    privacy = TrainConfig(algorithm=ULS(2, 0.3), steps=3, noise_multiplier=1.0, delta=1e-4)
    trainer = PrivateTrainer(model=_model(), args=_args(tmp_path), train_dataset=_dataset(), privacy=privacy)
    trainer.train()
    out = tmp_path / "out"
    for name in ("config.yaml", "privacy.json", "report.md", "report.json", "state.json", "model/README.md"):
        assert (out / name).is_file(), name
    assert "user-level" in (out / "report.md").read_text()
    assert AutoModelForCausalLM.from_pretrained(out / "model").config.n_embd == 16
    capsys.readouterr()
    assert cli(["report", str(out), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["epsilon_run"] == pytest.approx(trainer.epsilon(), rel=1e-9) and rep["steps_taken"] == 3

    def refused(edit, target) -> str:
        bad = tmp_path / f"bad_{target}"
        shutil.copytree(out, bad)
        edit(bad)
        assert cli(["report", str(bad)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        return err[0]

    def lower_epsilon(d):
        rec = json.loads((d / "privacy.json").read_text())
        rec["epsilon"] = rec["epsilon"] / 2
        (d / "privacy.json").write_text(json.dumps(rec))

    def other_sigma(d):
        (d / "config.yaml").write_text(
            (d / "config.yaml").read_text().replace("noise_multiplier=1.0", "noise_multiplier=4.0", 1)
        )

    def touch_model(d):
        f = next(p for p in (d / "model").iterdir() if p.suffix == ".safetensors")
        f.write_bytes(f.read_bytes()[:-1] + b"\0")

    assert "privacy.json" in refused(lower_epsilon, "epsilon")
    assert "config.yaml" in refused(other_sigma, "config")
    assert "model" in refused(touch_model, "model")


@pytest.mark.parametrize(
    "algorithm", [ULS(group_size=2, sampling_rate=0.5), ELS(group_size=2, sampling_rate=0.3)], ids=["uls", "els"]
)
@pytest.mark.parametrize("adversary", ["one_token_many_times", "long_rows"])
def test_an_adversarial_author_moves_the_trainers_released_sum_by_at_most_its_bound(tmp_path, algorithm, adversary):
    """The Trainer path is a release path of its own: the same seeded step with and without one
    adversarial author (appended last, so no other author's index moves) differs by at most the
    sensitivity the noise was scaled to (the noisy sum, read before the Trainer's optimizer step)."""
    from transformers import TrainerCallback

    from userdp.engine.neighbour import Gap

    rows = {
        "one_token_many_times": [[7] * 15 for _ in range(20)],
        "long_rows": [[int(t) for t in np.random.default_rng(3).integers(1, 64, 16)] for _ in range(3)],
    }[adversary]
    honest = _dataset(n=60, users=20)
    bigger = Dataset.from_dict(
        {"input_ids": list(honest["input_ids"]) + rows, "user": list(honest["user"]) + ["zz-adversary"] * len(rows)}
    )
    privacy = TrainConfig(
        algorithm=algorithm, steps=1, clipping=FlatClip(0.5), noise_multiplier=1.0, delta=1e-4, seed=7
    )  # seed 7: the adversary is in the cohort

    def released(ds, name):
        grabbed = []

        class Grab(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kw):
                grabbed.extend(p.grad.detach().double().clone() for p in trainer.model.parameters() if p.requires_grad)

        trainer = PrivateTrainer(
            model=_model(), args=_args(tmp_path / name), train_dataset=ds, privacy=privacy, callbacks=[Grab()]
        )
        trainer.train()
        run = trainer._private._run
        den = float(run.last_denominator)
        return [g * den for g in grabbed], float(run._sensitivity()) * float(getattr(run.algo, "group_sensitivity", 1))

    s0, bound0 = released(honest, "d")
    s1, bound1 = released(bigger, "d-plus-one")
    gap = Gap(float(sum(((a - b) ** 2).sum() for a, b in zip(s1, s0, strict=True))) ** 0.5, max(bound0, bound1))
    assert gap.ratio > 0.1 and gap.within(), f"{adversary}: {gap.ratio:.4f} x the bound"  # drawn, and bounded


@pytest.mark.heavy(counterpart="tests/engine/test_privacy.py::test_engine_cohorts_are_poisson_and_buckets_pad")
def test_the_trainers_cohorts_are_poisson_at_the_sampling_rate(tmp_path):
    """Each Trainer step is a Poisson cohort of users at the privacy config's rate, not the Trainer's
    batch (a constant 8 rows): over 100 seeded steps the cohort sizes have Binomial(30, 0.3)'s mean and
    variance, within 4 standard errors of each."""
    ds = _dataset(n=90, users=30)
    privacy = TrainConfig(
        algorithm=ULS(group_size=2, sampling_rate=0.3),
        steps=100,
        clipping=FlatClip(0.5),
        noise_multiplier=1.0,
        delta=1e-4,
        seed=7,
    )
    trainer = PrivateTrainer(
        model=_model(), args=_args(tmp_path, logging_steps=1000), train_dataset=ds, privacy=privacy, user_field="user"
    )
    trainer.train()
    sizes = np.array([h["units"] for h in trainer._private.history], dtype=float)
    n, q, t = 30, 0.3, len(sizes)
    mean, var = n * q, n * q * (1 - q)
    assert t == 100
    assert abs(sizes.mean() - mean) < 4 * np.sqrt(var / t)
    # the sample variance's standard error: sqrt((mu4 - var^2 (t-3)/(t-1)) / t), mu4 of a binomial
    mu4 = n * q * (1 - q) * (1 + 3 * (n - 2) * q * (1 - q))
    assert abs(sizes.var(ddof=1) - var) < 4 * np.sqrt((mu4 - var**2 * (t - 3) / (t - 1)) / t)
    assert sizes.min() >= 0 and sizes.max() <= n


def test_bf16_is_set_aside_and_said_as_the_sft_trainer_does(tmp_path):
    """One rule for TrainingArguments.bf16 at every entry point (SFTConfig turns it on by default):
    the Trainer's autocast is set aside, the run's notes say so, and the caller's object is unchanged."""
    privacy = TrainConfig(
        algorithm=ULS(group_size=2, sampling_rate=0.3),
        steps=1,
        clipping=FlatClip(0.5),
        noise_multiplier=1.0,
        delta=1e-4,
    )
    args = _args(tmp_path, bf16=True) if _bf16_possible() else None
    if args is None:
        pytest.skip("this transformers refuses bf16=True on this CPU at TrainingArguments() already")
    trainer = PrivateTrainer(model=_model(), args=args, train_dataset=_dataset(), privacy=privacy, user_field="user")
    assert args.bf16 is True and trainer.args.bf16 is False
    assert any(n.startswith("TrainingArguments.bf16=True set aside") for n in trainer.userdp_notes)


def _bf16_possible() -> bool:
    try:
        TrainingArguments(output_dir=None, bf16=True, use_cpu=True, report_to=[])
    except (ValueError, ImportError):
        return False
    return True


def test_userdp_evaluate_on_a_trainers_output_dir_speaks_the_trainers_language(tmp_path, capsys):
    """`userdp evaluate OUTPUT_DIR` read the Trainer's config.yaml as a `userdp train` config
    ("unknown key 'hf_trainer'"). The Trainer's eval_dataset is never saved, so the users to
    evaluate on must be given: without them, one line says so in the Trainer's terms; with
    --data, the output_dir's model is evaluated as a model folder."""
    from userdp.cli import main as cli

    privacy = TrainConfig(algorithm=ULS(2, 0.3), steps=1, noise_multiplier=1.0, delta=1e-4)
    PrivateTrainer(model=_model(), args=_args(tmp_path), train_dataset=_dataset(), privacy=privacy).train()
    out = tmp_path / "out"
    capsys.readouterr()
    assert cli(["evaluate", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "PrivateTrainer output_dir" in err and "--data" in err and "trainer.evaluate()" in err
    assert "hf_trainer" not in err
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps({"user": f"h{i}", "text": "to be or not"}) + "\n" for i in range(4)))
    rc = cli(["evaluate", str(out), "--data", str(data)])
    err = capsys.readouterr().err.strip()
    assert "hf_trainer" not in err and "Traceback" not in err
    assert rc == 0 or (rc == 2 and "\n" not in err), err  # this tiny model saved no tokenizer: one line


def test_banded_noise_over_user_groups_runs_under_the_trainer_as_in_the_engine(tmp_path):
    """BandMF with cyclic Poisson sampling through PrivateTrainer: the engine's own loop's parameters
    and epsilon, the groups keyed by the authors' ids, and a privacy.json that names the mechanism."""
    ds = _dataset()
    privacy = TrainConfig(
        algorithm=ULS(group_size=2, sampling_rate=0.25),
        steps=6,
        clipping=FlatClip(0.5),
        noise_multiplier=1.0,
        delta=1e-4,
        seed=11,
        sampling="cyclic_poisson",
        noise="bandmf",
        bands=3,
    )
    trainer = PrivateTrainer(model=_model(), args=_args(tmp_path), train_dataset=ds, privacy=privacy, user_field="user")
    trainer.train()
    model, private = _own_loop(ds, privacy)
    for a, b in zip(trainer.model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)
    assert trainer.epsilon() == pytest.approx(private.epsilon(), rel=1e-12)
    eng = json.loads((tmp_path / "out" / "privacy.json").read_text())["engine_record"]
    assert eng["noise_mechanism"] == "bandmf" and eng["correlated_noise"]["bands"] == 3
    assert eng["cycle"]["compositions"] == 2 and eng["dp_event_total"]["count"] == 2
    assert UserRecords(ds, "user").user_keys() == sorted({str(u) for u in ds["user"]})


def test_a_cohort_and_epochs_set_the_rate_and_steps_from_the_datasets_users_and_say_so(tmp_path):
    """PrivateTrainer(cohort_size=M, epochs=E): q = M/N over train_dataset's users (ULS) or p = M/|D'|
    over its records (ELS), steps = ceil(E/q), each written in userdp_notes; bad values are one line."""
    ds = _dataset()  # 30 users, 3 records each
    privacy = TrainConfig(algorithm=ULS(2, 0.9), steps=1, clipping=FlatClip(0.5), noise_multiplier=1.0, delta=1e-4)
    t = PrivateTrainer(
        model=_model(),
        args=_args(tmp_path),
        train_dataset=ds,
        privacy=privacy,
        user_field="user",
        cohort_size=6,
        epochs=2,
    )
    assert t.privacy.algorithm.sampling_rate == pytest.approx(6 / 30) and t.privacy.steps == 10
    assert t.args.max_steps == 10
    assert any("cohort_size=6" in n and "6/30 users" in n for n in t.userdp_notes)
    assert any("epochs=2: 10 steps" in n for n in t.userdp_notes)
    els = TrainConfig(algorithm=ELS(2, 0.9), steps=1, clipping=FlatClip(0.5), noise_multiplier=1.0, delta=1e-4)
    t = PrivateTrainer(
        model=_model(), args=_args(tmp_path), train_dataset=ds, privacy=els, user_field="user", cohort_size=12
    )
    assert t.privacy.algorithm.sampling_rate == pytest.approx(12 / 60)  # 30 users × min(3, G = 2) records
    for kw, words in (
        (dict(cohort_size=31), "more than the 30 users"),
        (dict(cohort_size=0), "cohort_size"),
        (dict(cohort_size=2.5), "cohort_size"),
        (dict(epochs=-1), "epochs"),
        (dict(epochs=1e12), "needs"),
    ):
        with pytest.raises(UserError, match=words) as info:
            PrivateTrainer(
                model=_model(), args=_args(tmp_path), train_dataset=ds, privacy=privacy, user_field="user", **kw
            )
        assert "\n" not in str(info.value)


@pytest.mark.slow
def test_a_plan_over_the_datasets_users_runs_under_the_trainer_and_its_looks_are_stated(tmp_path):
    from userdp import planning
    from userdp.hf_plan import plan_privacy

    ds = _dataset()
    base = TrainConfig(algorithm=ULS(1, 0.1), steps=3, clipping=FlatClip(0.5), target_epsilon=8.0, delta=1e-4, seed=2)
    planned = plan_privacy(_model(), ds, "user", base, compute_budget=8, sample=planning.NormSample(8, seed=0))
    algo = planned.config.algorithm
    assert algo.name == planned.plan.recommended and planned.config.steps == 3 and planned.config.seed == 2
    chosen = planned.plan.uls if algo.name == "uls" else planned.plan.els
    assert algo.group_size == chosen["group_size"] and algo.sampling_rate == pytest.approx(chosen["sampling_rate"])
    trainer = PrivateTrainer(model=_model(), args=_args(tmp_path), train_dataset=ds, privacy=planned, user_field="user")
    trainer.train()
    rec = json.loads((tmp_path / "out" / "privacy.json").read_text())
    assert any(n.startswith("userdp.hf_plan: non-private data touches") for n in rec["not_accounted"])


def test_a_plan_needs_a_target_and_the_user_column_each_in_one_line():
    from userdp.hf_plan import plan_privacy

    ds = _dataset()
    fixed = TrainConfig(algorithm=ULS(1, 0.1), steps=3, noise_multiplier=1.0, delta=1e-4)
    with pytest.raises(UserError, match="target_epsilon") as info:
        plan_privacy(_model(), ds, "user", fixed, 8)
    assert "\n" not in str(info.value)
    target = dataclasses.replace(fixed, noise_multiplier=None, target_epsilon=3.0)
    with pytest.raises(UserError, match="author") as info:
        plan_privacy(_model(), ds, "author", target, 8)
    assert "\n" not in str(info.value)


def test_push_to_hub_sends_the_verified_bundle_and_nothing_else(tmp_path, monkeypatch):
    import huggingface_hub

    sent = {}

    def upload_folder(repo_id, folder_path, **kw):
        sent["repo"] = repo_id
        sent["files"] = sorted(str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file())
        return "ok"

    monkeypatch.setattr(huggingface_hub, "create_repo", lambda repo_id, **kw: sent.setdefault("created", repo_id))
    monkeypatch.setattr(huggingface_hub, "upload_folder", upload_folder)
    privacy = TrainConfig(
        algorithm=ULS(2, 0.3), steps=2, clipping=FlatClip(0.5), noise_multiplier=1.0, delta=1e-4, seed=3
    )
    args = _args(tmp_path, hub_model_id="me/private-model", save_strategy="steps", save_steps=1)
    trainer = PrivateTrainer(model=_model(), args=args, train_dataset=_dataset(), privacy=privacy, user_field="user")
    with pytest.raises(UserError, match="train\\(\\) has not released"):
        trainer.push_to_hub()
    trainer.train()
    assert trainer.push_to_hub() == "ok" and sent["repo"] == sent["created"] == "me/private-model"
    files = sent["files"]
    assert "README.md" in files and "config.json" in files and "userdp/privacy.json" in files
    assert "userdp/checkpoints/ledger_journal.jsonl" in files
    assert not any(f.startswith(("checkpoint-", "runs/", "cache/")) or "checkpoint.pt" in f for f in files), files
    assert not any("diagnostics" in f or "trainer_state" in f for f in files), files
