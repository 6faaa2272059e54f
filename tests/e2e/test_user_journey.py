"""Issue 16: from "my own JSONL file" to a reviewed model, as the README shows it.

The first test runs the README's own-data commands, read from README.md itself, on the
example data generated afresh in a temporary folder (only the training lengths are shortened
with --set, so that the test takes seconds).
"""

import json
import math
import shlex
import subprocess
import sys

import pytest
from _paths import REPO

from userdp import accounting as A
from userdp.cli import main as cli
from userdp.engine import RunOptions
from userdp.engine.ledger import PrivacyLedger
from userdp.engine.performance import Performance
from userdp.fileio import owned_dir

from _records import engine_record

FAST = ["--set", "model.pretraining.steps=20", "--set", "training.steps=6"]


def _readme_own_data_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("### Your own data", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [ln.split("#", 1)[0].strip() for ln in block.splitlines() if ln.strip().startswith("userdp ")]


@pytest.mark.slow
def test_the_readme_own_data_commands_run_as_written(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from make_example_data import main as make_data
    finally:
        sys.path.pop(0)
    make_data(tmp_path / "examples" / "data")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("USERDP_CACHE", str(tmp_path / "cache"))
    commands = _readme_own_data_commands()
    assert [c.split()[1] for c in commands] == ["data", "init", "plan", "train", "report", "evaluate", "cache"]
    for cmd in commands:
        argv = shlex.split(cmd)[1:]
        if argv[0] in ("plan", "train"):
            argv += FAST
        assert cli(argv) == 0, cmd
        if argv[0] == "plan":  # it says how a run trained without --plan records having seen it
            out = capsys.readouterr().out
            assert "WITHOUT --plan" in out and "privacy.disclosed_touches" in out
            assert "ULS with banded matrix-factorization noise: b = " in out  # the plan says which b, and why
    capsys.readouterr()
    run = tmp_path / "runs" / "mine"
    # the run directory is complete without `userdp report`, and the plan reached the report
    for name in ("report.md", "report.json", "privacy.json", "model/config.json", "plan.json"):
        assert (run / name).is_file(), name
    priv = json.loads((run / "privacy.json").read_text())
    assert any("plan" in n for n in priv["not_accounted"])
    # init's G (the exact private median) is a non-private touch too: disclosed whichever command made it
    assert any(n.startswith("userdp init:") and "median" in n for n in priv["not_accounted"])
    # output.cache: run (written by init): no private data left in the shared cache
    assert cli(["cache", "info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert sum(k["bytes"] for k in info["kinds"].values() if k["private"]) == 0
    # ... and the run's own cache is listed as private data at rest (issue 39)
    assert [x["path"] for x in info["local"]] == [str((run / "cache").resolve())]
    assert info["private_bytes"] == info["local"][0]["bytes"] > 0
    assert (run / "cache" / "stores").is_dir()


def test_init_guesses_fields_writes_a_valid_config_and_never_overwrites(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"author": f"a{i % 7}", "body": f"text {i}"}) + "\n" for i in range(40)))
    out = tmp_path / "c.yaml"
    assert cli(["init", str(data), "--output", str(out)]) == 0
    from userdp.lm import config as C

    cfg = C.load_config(str(out))
    assert (cfg.data.user_field, cfg.data.text_field, cfg.data.source) == ("author", "body", "jsonl")
    assert cfg.training.group_size == 6 and cfg.output.cache == "run"  # median records per user
    # reading the per-user counts to choose G is a non-private touch, carried to the report
    assert any("G = 6" in t and "median" in t for t in cfg.privacy.disclosed_touches)
    # every key a newcomer will want to change is written, with what it does (issue 28, 4)
    text = out.read_text()
    for key in ("steps: 400", "max_eval_users:", "cohort_size:", "checkpoint_every:", "clip_norm:"):
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(key))
        assert "#" in line, line
    assert cfg.model.pretraining.steps == 400 and cfg.data.max_eval_users == 150
    # delta: the default's value for this N, with its reason (issue 39); the baseline is named
    delta_line = next(ln for ln in text.splitlines() if ln.strip().startswith("delta:"))
    n_train = int(7 * (1 - 0.2))  # 7 users, 20% held out
    assert cfg.privacy.delta is None and f"{n_train**-1.1:.2g} = {n_train**-0.1:.2g}/N" in delta_line
    assert "1/N" in text and "delta = 1e-6" in text and "nonprivate" in text
    before = out.read_text()
    assert cli(["init", str(data), "--output", str(out)]) == 2
    assert out.read_text() == before
    other = tmp_path / "x.jsonl"
    other.write_text(json.dumps({"who": "a", "what": "b"}) + "\n")
    assert cli(["init", str(other), "--output", str(tmp_path / "x.yaml")]) == 2
    assert "--user-field" in capsys.readouterr().err


def test_cache_info_marks_private_kinds_and_clear_removes_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("USERDP_CACHE", str(tmp_path))
    (owned_dir(tmp_path / "stores") / "s1").mkdir()  # as userdp makes its cache kinds: marked as its own
    (tmp_path / "stores" / "s1" / "records.arrow").write_bytes(b"x" * 1000)
    (owned_dir(tmp_path / "pretrained") / "m").mkdir()
    (tmp_path / "pretrained" / "m" / "w").write_bytes(b"y" * 10)
    assert cli(["cache", "info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kinds"]["stores"]["private"] and not info["kinds"]["pretrained"]["private"]
    assert info["private_bytes"] == 1000
    assert cli(["cache", "clear", "--private-only"]) == 0
    assert not (tmp_path / "stores").exists() and (tmp_path / "pretrained" / "m" / "w").exists()
    assert cli(["cache", "clear"]) == 0
    assert not (tmp_path / "pretrained").exists()


def test_cache_clear_recognises_an_older_userdps_cache(tmp_path, monkeypatch, capsys):
    # caches written before the marker: every entry is a folder named and filled as userdp does
    monkeypatch.setenv("USERDP_CACHE", str(tmp_path))
    for rel in (
        "stores/jsonl-79c92bb185d2d3d0/meta.json",
        "tokenized/tok-0e4cffb61064711a4d2f977c/meta.json",
        "pretrained/tiny-5c6b9116db372ebb/userdp_pretrain.json",
    ):
        (tmp_path / rel).parent.mkdir(parents=True)
        (tmp_path / rel).write_text("{}")
    assert cli(["cache", "clear", "--private-only"]) == 0
    assert not (tmp_path / "stores").exists() and not (tmp_path / "tokenized").exists()
    assert (tmp_path / "pretrained").exists()
    (tmp_path / "stores" / "jsonl-79c92bb185d2d3d0").mkdir(parents=True)  # one entry userdp would write ...
    (tmp_path / "stores" / "jsonl-79c92bb185d2d3d0" / "meta.json").write_text("{}")
    (tmp_path / "stores" / "notes.txt").write_text("mine")  # ... beside a file of the user's
    assert cli(["cache", "clear", "--private-only"]) == 2
    assert (tmp_path / "stores" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("how", ["user folder", "symlink"])
def test_cache_clear_never_deletes_a_folder_userdp_did_not_mark(tmp_path, monkeypatch, capsys, how):
    # issue 40, class 1: USERDP_CACHE pointed at a folder that is not only userdp's
    monkeypatch.setenv("USERDP_CACHE", str(tmp_path / "home"))
    mine = tmp_path / "home" / "stores" if how == "user folder" else tmp_path / "elsewhere"
    mine.mkdir(parents=True)
    (mine / "thesis.tex").write_text("years of work")
    if how == "symlink":
        (tmp_path / "home").mkdir()
        (tmp_path / "home" / "stores").symlink_to(mine)
    assert cli(["cache", "clear", "--private-only"]) == 2
    err = capsys.readouterr().err
    assert "nothing was removed" in err and len(err.strip().splitlines()) == 1
    assert (mine / "thesis.tex").read_text() == "years of work"


@pytest.mark.slow
def test_epsilon_curve_is_tight_not_capped_at_the_target():
    # a run calibrated for 200 steps: at step 141 the curve must show epsilon(141), not the target
    step = A.uls_step_event(0.9, 0.05)
    delta, target = 1e-5, A.epsilon(A.compose(step, 200), 1e-5)
    led = PrivacyLedger(step, delta, target_epsilon=target, safe_steps=200)
    led.spent = 141
    exact = led.epsilon()
    shown = led.epsilon_upper_bound()
    assert exact <= shown <= exact * 1.01
    assert shown < 0.99 * target
    led.spent = 1500  # beyond the per-step range: the 1% grid
    assert led.epsilon() <= led.epsilon_upper_bound() <= led.epsilon() * 1.01


def test_nonprivate_report_says_only_that_there_is_no_guarantee():
    from userdp.lm.report import render_markdown
    from userdp.lm.statement import ReleaseFacts, privacy_record

    rec = privacy_record(
        engine_record(
            algorithm="nonprivate",
            noise_multiplier=0.0,
            sampling_rate=0.1,
            steps=5,
            num_users=100,
            expected_units=10,
            delta_rule="",
        ),
        ReleaseFacts(
            algorithm="nonprivate",
            accountant="pld",
            sampler_assumed="poisson_users",
            epsilon_target=None,
            steps_planned=5,
            group_size=2,
            num_records=300,
            clipping="flat",
            seq_len=16,
        ),
    )
    rec["evaluation"] = {"after": {"loss": 3.0, "perplexity": 20.0, "user_loss": 3.1, "num_users": 10}}
    md = render_markdown(rec)
    assert "No differential-privacy guarantee" in md
    for absent in ("protected", "accountant", "delta", "e^10", "Tier", "adjacency"):
        assert absent not in md, absent
    assert "not a DP release" in md


def test_private_report_states_delta_against_1_over_n_and_unprotected_mentions():
    from userdp.lm.report import render_markdown
    from userdp.lm.statement import ReleaseFacts, privacy_record

    rec = privacy_record(
        engine_record(
            dp_event=A.compose(A.uls_step_event(1.0, 0.1), 5),
            epsilon=2.0,
            noise_multiplier=1.0,
            sampling_rate=0.1,
            steps=5,
            num_users=4000,
            expected_units=400,
            delta_rule="delta = N^-1.1 with N = 4000 users",
        ),
        ReleaseFacts(
            algorithm="uls",
            accountant="pld",
            sampler_assumed="poisson_users",
            epsilon_target=3.0,
            steps_planned=5,
            group_size=2,
            num_records=9000,
            clipping="flat",
            seq_len=16,
        ),
    )
    md = render_markdown(rec)
    assert "0.4/N" in rec["delta_rule"] and "1/N" in md
    assert "mentioned" in md
    assert "SPEC" not in md


@pytest.mark.parametrize(
    "argv, heavy",
    [
        (["--help"], []),
        (["--version"], []),
        (["account", "--help"], ["dp_accounting"]),
        (["train", "--help"], ["torch", "dp_accounting"]),
    ],
)
def test_the_cli_imports_only_the_command_it_runs(argv, heavy):
    # in a fresh interpreter: `userdp --help` and `--version` import neither torch nor dp_accounting;
    # a command imports its own module (and what that module imports at its top), no other command's
    code = (
        "import sys\nfrom userdp.cli import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
        "print(*(m in sys.modules for m in ('torch', 'dp_accounting', 'userdp.cli.train', 'userdp.cli.account')))"
        % argv
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-4:]
    loaded = {
        m
        for m, seen in zip(("torch", "dp_accounting", "userdp.cli.train", "userdp.cli.account"), out, strict=True)
        if seen == "True"
    }
    commands = {f"userdp.cli.{argv[0]}"} if not argv[0].startswith("-") else set()
    assert loaded == set(heavy) | commands, (argv, out)


@pytest.mark.slow
def test_train_announces_the_mechanism_before_the_first_step(tmp_path, capsys):
    from userdp.engine import ULS, TrainConfig, train

    from _engine_helpers import Mean, sq_loss, user_data

    seen = []
    train(
        Mean(3),
        user_data([2] * 20),
        sq_loss,
        TrainConfig(
            algorithm=ULS(2, 0.2), steps=2, target_epsilon=5.0, delta=1e-5, performance=Performance(track_epsilon=False)
        ),
        RunOptions(on_start=seen.append, callbacks=[lambda m: seen.append("step")]),
    )
    info = seen[0]
    assert isinstance(info, dict) and seen[1] == "step"
    assert info["sampling_rate"] == 0.2 and info["steps"] == 2 and info["noise_multiplier"] > 0
    assert math.isclose(info["expected_units"], 4.0) and info["delta"] == 1e-5


@pytest.mark.slow
def test_ctrl_c_in_train_writes_an_honest_record_and_report(tmp_path, monkeypatch, capsys):
    import os
    import signal

    import userdp.lm.training as F

    from _lm_corpus import write_tiny_run

    cfg, _ = write_tiny_run(tmp_path, "  checkpoint_every: 1\n", name="c.yaml")
    monkeypatch.setenv("USERDP_CACHE", str(tmp_path / "cache"))
    real = F._save_weights

    def press_ctrl_c(model, path, step, eps):
        real(model, path, step, eps)
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # deferred: step 3 finishes and is saved, then it stops

    monkeypatch.setattr(F, "_save_weights", press_ctrl_c)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # SIG_IGN under a background shell
    try:
        assert cli(["train", str(cfg), "--output", str(tmp_path / "run"), "--no-progress"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    run = tmp_path / "run"
    priv = json.loads((run / "privacy.json").read_text())
    assert priv["stopped"] == "interrupted" and priv["steps_applied"] == 3 and priv["steps_taken"] == 3
    md = (run / "report.md").read_text()
    assert "**Interrupted** after 3 of 4 planned steps" in md
    from userdp.engine import checkpoint as ckpt

    assert ckpt.verify(str(run / "checkpoints"))["step"] == 3  # weights, ledger and state of step 3
    assert json.loads((run / "checkpoints" / "ledger.json").read_text())["step"] == 3
    assert cli(["report", str(run)]) == 0  # and `userdp report` agrees


@pytest.mark.slow
def test_the_cli_keeps_the_hub_libraries_offline():
    """Nothing is downloaded at run time: the command line sets HF_HUB_OFFLINE before any hub
    library is imported, so a library beneath userdp (bitsandbytes fetching a kernel, say)
    cannot reach the network either; without it the hub constant reads False here."""
    code = (
        "import os, sys\n"
        "os.environ.pop('HF_HUB_OFFLINE', None)\n"
        "from userdp.cli import main\n"
        "assert 'huggingface_hub' not in sys.modules\n"
        "main(['train', '--print-config'])\n"
        "import huggingface_hub.constants as c\n"
        "print('offline', c.HF_HUB_OFFLINE)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-500:]
    assert out.stdout.strip().splitlines()[-1] == "offline True"


def test_sample_trains_on_a_counted_seeded_slice(tmp_path, monkeypatch, capsys):
    from userdp.lm import config as C
    from userdp.lm.prepare import prepare_data

    monkeypatch.setenv("USERDP_CACHE", str(tmp_path / "cache"))
    assert cli(["train", "--sample", "0.02", "--print-config"]) == 0
    assert "sample_rate: 0.02" in capsys.readouterr().out
    assert cli(["train", "--sample", "0.1", "--set", "data.max_users=3"]) == 2
    assert "give one of --sample and --set" in capsys.readouterr().err
    assert cli(["train", "--resume", str(tmp_path), "--sample", "0.1"]) == 2
    assert "a resumed run keeps the users it was started with" in capsys.readouterr().err
    for bad in ("0", "25", "1"):  # a count is refused with the reason and the rate to give instead
        assert cli(["train", "--sample", bad]) == 2
        err = capsys.readouterr().err
        assert "--sample: must be a rate in (0, 1)" in err and "K/N" in err
    # what the slice is: about 2% of the training users, each in or out on its own, the rest counted
    # in the log; the same users each time
    logs = []
    whole = prepare_data(C.load_config(None, []).data, log=lambda m: None)
    first = prepare_data(C.load_config(None, ["data.sample_rate=0.02"]).data, log=logs.append)
    again = prepare_data(C.load_config(None, ["data.sample_rate=0.02"]).data, log=lambda m: None)
    n, big = first.train_subset.num_users, whole.train_subset.num_users
    assert abs(n - 0.02 * big) <= 4 * (0.02 * big) ** 0.5 and n < big
    assert list(first.train_subset.users) == list(again.train_subset.users)
    assert set(first.train_subset.users) <= set(whole.train_subset.users)
    assert any(f"training on {n} of the {big} training users" in m for m in logs), logs
    assert list(first.eval_subset.users) == list(whole.eval_subset.users)  # the held-out users do not change
    assert first.sample_note == ""  # a rate fixed in advance: nothing for the statement to qualify
    capped = prepare_data(C.load_config(None, ["data.max_users=25"]).data, log=lambda m: None)
    assert "depends on how many users there are" in capped.sample_note
