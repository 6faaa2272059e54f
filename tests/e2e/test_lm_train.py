"""End to end: `userdp train` on tiny data, the run directory, resume, evaluate, report, refusals."""

import json

import pytest
import torch

from userdp.cli import main as cli

from _lm_corpus import interrupt_after_checkpoint, write_tiny_run


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """Data, public text and config, shared by the module (so is the store/pretraining cache)."""
    tmp_path = tmp_path_factory.mktemp("lm_e2e")
    cfg, _ = write_tiny_run(tmp_path, "  checkpoint_every: 1\n  seed: 3\n")
    return tmp_path, cfg


@pytest.fixture
def tiny(tiny_files, tmp_path, monkeypatch):
    shared, cfg = tiny_files
    monkeypatch.setenv("USERDP_CACHE", str(shared / "cache"))
    return tmp_path, cfg


@pytest.mark.slow
def test_train_run_directory_reload_report_evaluate(tiny, capsys):
    tmp, cfg = tiny
    out = tmp / "run"
    assert cli(["train", str(cfg), "--output", str(out), "--json", "--no-progress"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    for key in ("run_dir", "perplexity_before", "perplexity_after", "epsilon", "delta", "algorithm"):
        assert summary[key] is not None, key
    assert summary["algorithm"] == "uls"
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "diagnostics.jsonl",
        "privacy.json",
        "curves.png",
        "eval.json",
        "checkpoints/checkpoint.pt",
        "checkpoints/model.safetensors",
        "checkpoints/ledger_journal.jsonl",
        "checkpoints/ledger.json",
        "model/config.json",
        "model/tokenizer.json",
    ):
        assert (out / name).is_file(), name
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:  # the public file: nothing computed on the step's cohort
        assert set(r) == {"step", "epsilon", "clip_norm", "journal"}
    diag = [json.loads(x) for x in (out / "diagnostics.jsonl").read_text().splitlines()]
    assert [d["step"] for d in diag] == [1, 2, 3, 4]  # the private file: the un-noised diagnostics
    assert all({"loss", "fraction_clipped", "nonfinite_units"} <= set(d) for d in diag)
    assert rows[-1]["epsilon"] >= rows[0]["epsilon"] > 0
    priv = json.loads((out / "privacy.json").read_text())
    assert 0 < priv["epsilon"] <= 8.0
    assert priv["steps_taken"] == 4
    assert priv["sampler_used"] == priv["sampler_assumed"] == "poisson_users"
    # the model reloads with plain transformers and scores text
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "model", local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out / "model", local_files_only=True)
    ids = torch.tensor([tok("to be or not to be")["input_ids"]])
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)
    # report: every checklist field non-empty, Markdown and JSON written
    from userdp.lm.report import REQUIRED

    assert cli(["report", str(out), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    for key in REQUIRED:
        assert rep.get(key) not in (None, "", [], {}), key
    assert (out / "report.md").is_file()
    # evaluate the run on its held-out users (same split) and personalize
    assert cli(["evaluate", str(out), "--json", "--personalize"]) == 0
    ev = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert abs(ev["heldout"]["perplexity"] - summary["perplexity_after"]) < 1e-3 * summary["perplexity_after"]
    assert ev["personalization"]["users"] >= 1
    assert cli(["evaluate", str(out), "--json"]) == 0  # without the flag, none (whatever the run's config says)
    assert "personalization" not in json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.slow
def test_interrupted_run_resumes_with_the_same_ledger(tiny, monkeypatch, capsys):
    tmp, cfg = tiny
    out = tmp / "run"
    import userdp.lm.training as F

    real = interrupt_after_checkpoint(monkeypatch, 2)
    assert cli(["train", str(cfg), "--output", str(out), "--no-progress"]) == 130
    state = json.loads((out / "state.json").read_text())
    assert state["status"] == "interrupted"
    assert not (out / "privacy.json").exists()
    monkeypatch.setattr(F, "_save_weights", real)
    assert cli(["train", "--resume", str(out), "--json", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    priv = json.loads((out / "privacy.json").read_text())
    # step 2 began before the interrupt: counted as spent, never replayed under the same noise (a
    # seeded run is keyed anew: issue 34, H1), so the budget the run was calibrated for ends it a
    # step early: 3 steps applied, 4 accounted
    assert summary["steps"] == 3 and priv["steps_taken"] == 4
    assert priv["engine_record"]["steps_lost_to_crashes"] == 1
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    diag = [json.loads(x) for x in (out / "diagnostics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in diag] == [1, 2, 3]  # cut back with metrics.jsonl on resume
    assert priv["epsilon"] <= 8.0
    assert cli(["train", "--resume", str(out)]) == 2  # a finished run is not resumed
    assert "already finished" in capsys.readouterr().err


@pytest.mark.slow
def test_a_resume_may_change_performance_settings_but_not_privacy_ones(tiny, monkeypatch, capsys):
    """Issue 26: chunk size, per-unit strategy, precision and checkpoint cadence do not block a
    resume (the journal is bound to the rest); a privacy setting does, before anything runs."""
    tmp, cfg = tiny
    out = tmp / "run"
    import userdp.lm.training as F

    real = interrupt_after_checkpoint(monkeypatch, 2)
    assert cli(["train", str(cfg), "--output", str(out), "--no-progress"]) == 130
    monkeypatch.setattr(F, "_save_weights", real)
    capsys.readouterr()
    saved = (out / "config.yaml").read_text()
    for privacy in ("training.lr=0.5", "privacy.epsilon=100", "training.steps=9", "data.split_seed=4"):
        assert cli(["train", "--resume", str(out), "--set", privacy, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert "a resumed run may change only performance settings" in err and err.count("\n") == 1
    assert (out / "config.yaml").read_text() == saved
    assert (
        cli(
            [
                "train",
                "--resume",
                str(out),
                "--set",
                "training.chunk_size=3",
                "--set",
                "training.per_unit=vmap",
                "--set",
                "training.checkpoint_every=2",
                "--json",
                "--no-progress",
            ]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the step begun before the interrupt is counted, never replayed (issue 34, H1): the budget ends
    # the run after 3 applied steps, 4 accounted
    assert summary["steps"] == 3
    now = (out / "config.yaml").read_text()
    assert "chunk_size: 3" in now and "per_unit: vmap" in now and now != saved
    priv = json.loads((out / "privacy.json").read_text())
    assert priv["steps_taken"] == 4 and priv["compute"]["per_unit"]["strategy"] == "vmap"
    assert cli(["report", str(out)]) == 0  # the journal still vouches for the config
    # an edit of a privacy setting in config.yaml is still caught
    (out / "config.yaml").write_text(now.replace("clip_norm: 1.0", "clip_norm: 0.5"))
    assert cli(["report", str(out)]) == 2
    assert "not the configuration this run's ledger journal was bound to" in capsys.readouterr().err


@pytest.mark.slow
def test_a_fixed_sigma_run_makes_one_run_plan_and_resolves_its_device_once(tiny, monkeypatch):
    # it made up to 5 (issue 26): the budget check and the engine now read the same plan
    import userdp.engine.plan as P
    import userdp.engine.run.build as L
    import userdp.lm.job_plan as J

    calls = []

    def counting(*a, **k):
        calls.append(k.get("num_units"))
        return P.make_plan(*a, **k)

    monkeypatch.setattr(J, "make_plan", counting)
    monkeypatch.setattr(L, "make_plan", counting)
    J._mechanism_plan.cache_clear()
    # and model.device is resolved once, before the data is read (issue 36: it was resolved by each
    # phase that needed it: the model's loading and placing, the engine's precision)
    import userdp.devices as D
    import userdp.lm.finetune as FT
    import userdp.lm.starting_model as SM

    resolved = []
    monkeypatch.setattr(FT, "resolve_device", lambda spec, **k: resolved.append(spec) or D.resolve_device(spec, **k))
    # the later phases take the job's device and cannot resolve their own
    assert not hasattr(SM, "resolve_device") and not hasattr(J, "resolve_device")
    tmp, cfg = tiny
    # chunk_size auto with a fixed sigma was a traceback: the early budget check built a TrainConfig
    # with chunk_size None; performance settings no longer reach the plan's mechanism
    assert (
        cli(
            [
                "train",
                str(cfg),
                "--output",
                str(tmp / "run"),
                "--no-progress",
                "--set",
                "training.chunk_size=auto",
                "--set",
                "privacy.noise_multiplier=1.5",
                "--set",
                "privacy.epsilon=50",
            ]
        )
        == 0
    )
    assert len(calls) == 1
    assert resolved == ["auto"]


def test_unknown_key_and_bad_type_are_one_line_errors(tiny, capsys):
    tmp, cfg = tiny
    assert cli(["train", str(cfg), "--set", "training.stepz=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "training.stepz" in err
    assert cli(["train", str(cfg), "--set", "training.cohort_size=many"]) == 2
    assert "training.cohort_size must be a number" in capsys.readouterr().err


def test_a_missing_gpu_is_refused_before_the_data_is_read(tiny, monkeypatch, capsys):
    """model.device is resolved once, first (issue 36): a GPU this machine lacks is one line naming
    model.device, before the data is prepared, and the run directory it made is removed."""
    import torch

    import userdp.lm.finetune as FT

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(FT, "prepare_data", lambda *a, **k: pytest.fail("the data was read"))
    tmp, cfg = tiny
    assert cli(["train", str(cfg), "--set", "model.device=cuda", "--output", str(tmp / "gpu"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([ln for ln in err if "error" in ln]) == 1 and "model.device: cuda was asked for" in err[-1], err
    assert not (tmp / "gpu").exists()


def test_refuses_undeclared_tokenizer(tiny, capsys):
    tmp, cfg = tiny
    fake = tmp / "tok.json"
    fake.write_text("{}")
    assert cli(["train", str(cfg), "--set", f"tokenizer.path={fake}", "--output", str(tmp / "r1")]) == 2
    assert "declared_public" in capsys.readouterr().err


def test_refuses_steps_beyond_the_budget(tiny, capsys):
    tmp, cfg = tiny
    rc = cli(
        [
            "train",
            str(cfg),
            "--set",
            "privacy.noise_multiplier=0.3",
            "--set",
            "training.steps=400",
            "--set",
            "privacy.epsilon=1",
            "--set",
            "privacy.accountant=rdp",
            "--output",
            str(tmp / "r2"),
            "--no-progress",
        ]
    )
    assert rc == 2
    err = capsys.readouterr().err
    assert "spend epsilon" in err and "> the target 1" in err


def test_refuses_batchnorm_model(tmp_path, capsys):
    from torch import nn

    from userdp.errors import UserError
    from userdp.lm import models

    net = nn.Sequential(nn.Embedding(10, 4), nn.BatchNorm1d(4))
    with pytest.raises(UserError, match="BatchNorm"):
        models.lint_model(net)


@pytest.mark.slow
def test_pretrain_cli_writes_a_folder_train_accepts(tiny, capsys):
    tmp, cfg = tiny
    out = tmp / "pre"
    public = cfg.parent / "public.txt"
    # undeclared public text is refused
    assert cli(["pretrain", "--public-text", str(public), "--output", str(out)]) == 2
    assert "--declare-public" in capsys.readouterr().err
    assert (
        cli(
            [
                "pretrain",
                "--public-text",
                str(public),
                "--declare-public",
                "--output",
                str(out),
                "--steps",
                "3",
                "--batch-size",
                "4",
                "--vocab-size",
                "300",
                "--seq-len",
                "16",
                "--json",
            ]
        )
        == 0
    )
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["steps"] == 3 and "public.txt" in info["public_text"]
    from userdp.lm import config as C
    from userdp.lm.prepare import prepare_data
    from userdp.lm.starting_model import get_tokenizer_and_model

    c = C.load_config(cfg, [f"model.path={out}"])
    prep = prepare_data(c.data, log=lambda m: None)
    tok, model, notes = get_tokenizer_and_model(
        c.tokenizer, c.model, prep, log=lambda m: None, progress=False, device=torch.device("cpu")
    )
    assert "userdp" in notes["pretraining"] and tok.get_vocab_size() <= 300
    # another folder (not made by userdp pretrain) needs the tokenizer declared public
    (out / "userdp_pretrain.json").unlink()
    from userdp.errors import UserError

    with pytest.raises(UserError, match="declared_public"):
        get_tokenizer_and_model(
            c.tokenizer, c.model, prep, log=lambda m: None, progress=False, device=torch.device("cpu")
        )


@pytest.mark.slow
def test_perplexity_selection_is_disclosed_in_the_report(tiny, capsys):
    tmp, cfg = tiny
    out = tmp / "ppl"
    assert (
        cli(
            [
                "train",
                str(cfg),
                "--set",
                "training.selection=highest_ppl",
                "--set",
                "training.steps=2",
                "--set",
                "eval.before=false",
                "--output",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    priv = json.loads((out / "privacy.json").read_text())
    assert priv["selection"] == "highest_ppl"
    assert any("scored" in s and "private records" in s for s in priv["not_accounted"])


@pytest.mark.slow
def test_train_fine_tunes_a_local_pythia_style_gpt_neox_folder_with_ghost_norms(tiny, capsys):
    """A local AutoModelForCausalLM folder of another family than GPT-2: GPT-NeoX (Pythia's),
    with the tokenizer of a userdp pretraining; the ghost strategy clips it, and the result
    reloads as the same family."""
    from transformers import AutoModelForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM

    tmp, cfg = tiny
    folder = tmp / "neox"
    assert (
        cli(
            [
                "pretrain",
                "--public-text",
                str(cfg.parent / "public.txt"),
                "--declare-public",
                "--output",
                str(folder),
                "--steps",
                "1",
                "--batch-size",
                "4",
                "--vocab-size",
                "300",
                "--seq-len",
                "16",
            ]
        )
        == 0
    )
    vocab = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).config.vocab_size
    neox = GPTNeoXForCausalLM(
        GPTNeoXConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            rotary_pct=0.25,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
    )
    for f in folder.glob("*.safetensors"):
        f.unlink()
    neox.save_pretrained(folder)
    out = tmp / "run-neox"
    capsys.readouterr()
    assert (
        cli(
            [
                "train",
                str(cfg),
                "--set",
                f"model.path={folder}",
                "--set",
                "training.per_unit=ghost",
                "--set",
                "training.steps=2",
                "--set",
                "eval.before=false",
                "--output",
                str(out),
                "--json",
                "--no-progress",
            ]
        )
        == 0
    ), capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < summary["epsilon"] <= 8.0
    priv = json.loads((out / "privacy.json").read_text())
    assert priv["compute"]["per_unit"]["strategy"] == "ghost"
    trained = AutoModelForCausalLM.from_pretrained(out / "model", local_files_only=True)
    assert type(trained).__name__ == "GPTNeoXForCausalLM"
    before = dict(neox.named_parameters())
    assert any(not torch_equal(p, before[n]) for n, p in trained.named_parameters())  # it trained


def torch_equal(a, b):
    import torch

    return torch.equal(a.detach(), b.detach())


def _llama_folder(tmp, cfg, name):
    """A local Llama-style folder (nn.Linear projections) with a userdp-pretrained tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    folder = tmp / name
    assert (
        cli(
            [
                "pretrain",
                "--public-text",
                str(cfg.parent / "public.txt"),
                "--declare-public",
                "--output",
                str(folder),
                "--steps",
                "1",
                "--batch-size",
                "4",
                "--vocab-size",
                "300",
                "--seq-len",
                "16",
            ]
        )
        == 0
    )
    vocab = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).config.vocab_size
    import torch

    torch.manual_seed(0)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    )
    for f in folder.glob("*.safetensors"):
        f.unlink()
    llama.save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.extras
def test_qlora_trains_lora_on_a_4bit_base_and_saves_a_model_that_reloads_the_same(tiny, capsys):
    pytest.importorskip("bitsandbytes")
    import torch

    from userdp.lm import models

    tmp, cfg = tiny
    folder = _llama_folder(tmp, cfg, "llama")
    out = tmp / "run-qlora"
    capsys.readouterr()
    assert (
        cli(
            [
                "train",
                str(cfg),
                "--set",
                f"model.path={folder}",
                "--set",
                "model.lora.enabled=true",
                "--set",
                "model.lora.quantize=nf4",
                "--set",
                "training.steps=2",
                "--set",
                "eval.before=false",
                "--output",
                str(out),
                "--json",
                "--no-progress",
            ]
        )
        == 0
    ), capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    priv = json.loads((out / "privacy.json").read_text())
    assert priv["compute"]["per_unit"]["strategy"] == "ghost" and "nf4" in priv["compute"]["quantization"]
    assert 0 < priv["epsilon"] == summary["epsilon"] <= 8.0
    # model/ holds the adapter and the note that rebuilds the quantized base: the evaluated model
    assert (out / "model" / "adapter_config.json").is_file() and (out / "model" / models.QUANTIZATION_FILE).is_file()
    again = models.load_local(out / "model")
    assert models.is_quantized(again) and models.is_lora(again)
    ev = json.loads((out / "eval.json").read_text())["after"]
    assert cli(["evaluate", str(out), "--json", "--device", "cpu"]) == 0, capsys.readouterr().err
    re_eval = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert re_eval["heldout"]["loss"] == pytest.approx(ev["loss"], rel=1e-5)  # the reloaded model is the one evaluated
    trained = {n: p for n, p in again.named_parameters() if "lora_B" in n}
    assert trained and any(float(p.abs().max()) > 0 for p in trained.values())  # B starts at 0: it trained
    assert all(p.dtype == torch.float32 for p in trained.values())


@pytest.mark.parametrize(
    "sets, match",
    [
        (["model.lora.quantize=nf4"], "lora.enabled"),
        (["model.lora.enabled=true", "model.lora.quantize=nf4"], "model.path"),
        (["model.lora.enabled=true", "model.lora.quantize=nf4", "model.path=x", "training.algorithm=fedavg"], "vmap"),
        (["model.lora.enabled=true", "model.lora.quantize=int3"], "quantize"),
    ],
)
def test_qlora_misconfigurations_are_refused_in_one_line(tiny, capsys, sets, match):
    tmp, cfg = tiny
    args = ["train", str(cfg), "--output", str(tmp / "never")]
    for s in sets:
        args += ["--set", s]
    assert cli(args) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1
    assert not (tmp / "never").exists()


@pytest.mark.parametrize(
    "cmd",
    [
        ["evaluate", "no-such-run"],
        ["plan", "--compute-budget", "8"],
        ["train", "--output", "{tmp}/never"],
        ["pretrain", "--output", "{tmp}/never"],
    ],
)
def test_every_job_takes_a_device_and_refuses_a_missing_one(cmd, capsys, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: cuda is not missing here")
    cmd = [c.format(tmp=tmp_path) for c in cmd]
    assert cli(cmd + ["--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--device" in err and "no CUDA" in err
    assert cli(cmd + ["--device", "tpu"]) == 2
    assert "--device" in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


def test_train_device_overrides_the_config(capsys):
    assert cli(["train", "--set", "model.device=cuda", "--device", "CPU", "--print-config"]) == 0
    assert "  device: cpu\n" in capsys.readouterr().out


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.slow
@pytest.mark.extras
def test_tensorboard_scalars_follow_metrics_jsonl_through_a_resume(tiny, monkeypatch, capsys):
    pytest.importorskip("tensorboard")
    tmp, cfg = tiny
    out = tmp / "run"
    import userdp.lm.training as F

    real = interrupt_after_checkpoint(monkeypatch, 2)
    assert cli(["train", str(cfg), "--output", str(out), "--no-progress", "--set", "output.tensorboard=true"]) == 130
    monkeypatch.setattr(F, "_save_weights", real)
    assert cli(["train", "--resume", str(out), "--no-progress"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    diag = [json.loads(x) for x in (out / "diagnostics.jsonl").read_text().splitlines()]
    tb = _scalars(out / "tensorboard")
    # the interrupted run's steps past its checkpoint were dropped (purge_step), as metrics.jsonl was cut back
    # (3 steps applied: the step begun before the interrupt is counted, not replayed; issue 34, H1)
    assert [s for s, _ in tb["train/loss"]] == [r["step"] for r in rows] == [1, 2, 3]
    assert [v for _, v in tb["train/loss"]] == pytest.approx([r["loss"] for r in diag], rel=1e-6)
    assert [v for _, v in tb["privacy/epsilon_spent"]] == pytest.approx([r["epsilon"] for r in rows], rel=1e-6)
    ev = json.loads((out / "eval.json").read_text())
    assert tb["eval/heldout_perplexity"] == [
        (0, pytest.approx(ev["before"]["perplexity"], rel=1e-6)),
        (3, pytest.approx(ev["after"]["perplexity"], rel=1e-6)),
    ]
    priv = json.loads((out / "privacy.json").read_text())
    assert any("tensorboard/" in n and "without noise" in n for n in priv["not_accounted"])


def test_tensorboard_without_the_package_is_refused_before_anything_runs(tiny, monkeypatch, capsys):
    import importlib.util

    tmp, cfg = tiny
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    out = tmp / "never"
    assert cli(["train", str(cfg), "--output", str(out), "--set", "output.tensorboard=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "output.tensorboard" in err[0] and "userdp[tensorboard]" in err[0]
    assert not out.exists()


@pytest.mark.slow
def test_banded_noise_over_user_groups_from_the_cli_is_verified_by_report(tiny, capsys):
    """`userdp train --set privacy.sampler=cyclic_poisson --set privacy.noise=bandmf --set
    privacy.bands=2`: the run's privacy.json names the mechanism and its cycle, `userdp report`
    re-derives epsilon over ceil(T/b) compositions, and a record whose bands or coefficients were
    edited, or a resume with another band count, is one line."""
    tmp, cfg = tiny
    out = tmp / "run"
    sets = ["--set", "privacy.sampler=cyclic_poisson", "--set", "privacy.noise=bandmf", "--set", "privacy.bands=2"]
    assert cli(["train", str(cfg), *sets, "--output", str(out), "--json", "--no-progress"]) == 0
    capsys.readouterr()
    priv = json.loads((out / "privacy.json").read_text())
    eng = priv["engine_record"]
    assert priv["sampler_used"] == "cyclic_poisson_users" and eng["noise_mechanism"] == "bandmf"
    assert eng["cycle"]["bands"] == 2 and eng["correlated_noise"]["bands"] == 2
    assert priv["dp_event"]["count"] == -(-priv["steps_taken"] // 2)
    assert cli(["report", str(out)]) == 0
    text = capsys.readouterr().out
    assert "banded matrix-factorization noise (2 bands" in text and "cyclic Poisson sampling of users" in text
    saved = (out / "privacy.json").read_text()
    for edit in ("bands", "coefficients"):
        rec = json.loads(saved)
        if edit == "bands":
            rec["engine_record"]["cycle"]["bands"] = 1
        else:
            rec["engine_record"]["correlated_noise"]["coefficients"][1] = 0.0
        (out / "privacy.json").write_text(json.dumps(rec))
        assert cli(["report", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "privacy.json" in err
    (out / "privacy.json").write_text(saved)
    assert cli(["train", "--resume", str(out), "--set", "privacy.bands=3", "--no-progress"]) == 2
    assert "bands" in capsys.readouterr().err


@pytest.mark.slow
def test_export_writes_exactly_the_release_bundle_which_report_verifies(tiny, capsys):
    """`userdp export RUN DEST`: the model and its Hub card at the root, the evidence under userdp/,
    nothing private (records, diagnostics, resume state); `userdp report DEST` verifies it and refuses
    an edit; an unverifiable run or a taken DEST is one line and leaves nothing behind."""
    import yaml

    from userdp.lm.export import EVIDENCE

    tmp, cfg = tiny
    run = tmp / "run"
    assert cli(["train", str(cfg), "--output", str(run), "--no-progress"]) == 0
    dest = tmp / "bundle"
    assert cli(["export", str(run), str(dest)]) == 0
    files = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    model_files = sorted(p.name for p in (run / "model").iterdir() if p.is_file())
    evidence = sorted(f"userdp/{rel}" for rel in EVIDENCE if (run / rel).is_file())
    assert files == sorted(model_files + evidence)
    for private in ("diagnostics.jsonl", "cache", "checkpoint.pt", "curves.png", "MANIFEST.json"):
        assert not any(f.startswith(f"userdp/{private}") or f"/{private}" in f for f in files if f != "MANIFEST.json")
    card = (dest / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["pipeline_tag"] == "text-generation" and "differential-privacy" in meta["tags"]
    assert meta["model-index"][0]["results"][0]["metrics"][0]["type"] == "perplexity"
    assert "## Intended use" in card
    capsys.readouterr()
    assert cli(["report", str(dest)]) == 0
    priv = dest / "userdp" / "privacy.json"
    rec = json.loads(priv.read_text())
    rec["epsilon"] = rec["epsilon"] / 2
    priv.write_text(json.dumps(rec))
    assert cli(["report", str(dest)]) == 2
    assert "privacy.json" in capsys.readouterr().err
    assert cli(["export", str(run), str(dest)]) == 2  # taken
    assert "not an empty folder" in capsys.readouterr().err
    (run / "privacy.json").write_text(json.dumps({**json.loads((run / "privacy.json").read_text()), "epsilon": 0.001}))
    assert cli(["export", str(run), str(tmp / "second")]) == 2  # an edited run is not exported
    assert not (tmp / "second").exists() and not list(tmp.glob(".second.partial-*"))
