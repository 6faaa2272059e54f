"""`userdp audit` end to end on tiny data: the JSON, the secrets file kept out of the run
directory, the report section, resume with the same canaries, and refusals (exit 2)."""

import json
import os
import stat

import pytest

from userdp.cli import main as cli

from _lm_corpus import interrupt_after_checkpoint, write_tiny_run


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("audit_e2e")
    cfg, _ = write_tiny_run(
        tmp_path, "  checkpoint_every: 1\n  seed: 3\n", tail="audit:\n  inference_users: 5\n  inference_records: 2\n"
    )
    return tmp_path, cfg


@pytest.fixture
def tiny(tiny_files, tmp_path, monkeypatch):
    shared, cfg = tiny_files
    monkeypatch.setenv("USERDP_CACHE", str(shared / "cache"))
    return tmp_path, cfg


def _last_json(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.slow
def test_audit_json_secrets_and_report(tiny, capsys):
    tmp, cfg = tiny
    out = tmp / "run"
    # a fixed canary seed (7 of 12 included): unseeded, 1 run in 4,096 draws none and is refused
    assert (
        cli(
            [
                "audit",
                str(cfg),
                "--canaries",
                "12",
                "--set",
                "audit.seed=1",
                "--output",
                str(out),
                "--json",
                "--no-progress",
            ]
        )
        == 0
    )
    s = _last_json(capsys)
    for key in ("epsilon", "epsilon_lower_bound", "confidence", "canaries", "statement", "run_dir"):
        assert key in s, key
    assert s["canaries"] == 12 and s["confidence"] == 0.95
    assert 0 < s["epsilon"] <= 8.0 and s["epsilon_lower_bound"] >= 0
    assert s["statement"].startswith(f"accounted ε ≤ {s['epsilon']:.3g}; audited ε ≥ ")
    # the secrets file: beside the run directory, never inside it, owner-only
    secrets = tmp / "run.audit-secrets.json"
    assert s["secrets_file"] == str(secrets.resolve())
    assert stat.S_IMODE(os.stat(secrets).st_mode) == 0o600
    sec = json.loads(secrets.read_text())
    assert len(sec["included"]) == len(sec["score"]) == 12
    # no published file holds the seed or the inclusion pattern
    for f in out.rglob("*"):
        if f.is_file():
            assert sec["seed"].encode() not in f.read_bytes(), f
    priv = json.loads((out / "privacy.json").read_text())
    a = priv["audit"]
    assert a["canaries"] == 12 and a["canaries_included"] == sum(sec["included"])
    assert a["score"].startswith("gradient:") and a["steps_observed"] == 4  # every step was read
    # the gradient canaries need vmap's per-unit gradients: settled before the data, so config.yaml,
    # written once, says what ran
    assert priv["compute"]["per_unit"]["strategy"] == "vmap"
    assert "per_unit: vmap" in (out / "config.yaml").read_text()
    assert "included" not in a and "scores" not in a and isinstance(a["score"], str)  # no per-canary data
    # N counts the included canaries; the disclosures say so and name the user-inference touch
    train_users = int(json.loads((out / "state.json").read_text()).get("summary", {}).get("train_users", 0)) or None
    real = priv["num_users"] - a["canaries_included"]
    assert real == train_users if train_users else 28 <= real <= 36  # the tiny corpus's 40 users less the held out
    assert any("synthetic canary users" in n for n in priv["not_accounted"])
    assert any("user-inference" in n for n in priv["not_accounted"])
    assert a["user_inference"]["trained_users"] == a["user_inference"]["heldout_users"] == 5
    assert cli(["report", str(out)]) == 0
    md = capsys.readouterr().out
    assert "## 8. Empirical audit" in md and a["statement"] in md


@pytest.mark.heavy(counterpart="tests/audit/test_audit_e2e.py::test_audit_json_secrets_and_report")
@pytest.mark.slow
def test_an_interrupted_audit_resumes_with_the_same_canaries(tiny, monkeypatch, capsys):
    tmp, cfg = tiny
    out = tmp / "run"
    import userdp.lm.training as F

    real = interrupt_after_checkpoint(monkeypatch, 2)
    # a fixed canary seed (5 of its 8 coin flips include): unseeded, 1 run in 256 draws none and stops there
    seeded = ["--set", "audit.seed=1"]
    assert cli(["audit", str(cfg), "--canaries", "8", *seeded, "--output", str(out), "--no-progress"]) == 130
    secrets = tmp / "run.audit-secrets.json"
    before = json.loads(secrets.read_text())
    monkeypatch.setattr(F, "_save_weights", real)
    # the resume re-derives the same canaries (the journal is bound to a digest of their seed)
    assert cli(["audit", "--resume", str(out), "--json", "--no-progress"]) == 0
    s = _last_json(capsys)
    after = json.loads(secrets.read_text())
    assert after["seed"] == before["seed"] and after["included"] == before["included"]
    assert after["loss_before"] == before["loss_before"]  # scored once, under the starting model
    assert s["canaries"] == 8
    # without its secrets file, an audited run cannot be resumed as one
    out2 = tmp / "run2"
    interrupt_after_checkpoint(monkeypatch, 2)
    assert cli(["audit", str(cfg), "--canaries", "8", *seeded, "--output", str(out2), "--no-progress"]) == 130
    (tmp / "run2.audit-secrets.json").unlink()
    capsys.readouterr()
    assert cli(["audit", "--resume", str(out2), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "secrets file is missing" in err and len(err.strip().splitlines()) == 1


def test_bad_audit_input_is_one_line_and_exit_2(tiny, capsys):
    tmp, cfg = tiny
    cases = [
        (["audit", str(cfg), "--canaries", "1"], "--canaries"),
        (["audit", str(cfg), "--set", "audit.confidence=1.5"], "audit.confidence"),
        (["audit", str(cfg), "--set", "audit.secret_tokens=99"], "audit.secret_tokens"),
        (["audit", str(cfg), "--set", "audit.score=exposure"], "audit.score"),
        (["train", str(cfg), "--set", "audit.canaries=1"], "audit.canaries"),
        (["audit", "--resume", str(tmp / "nowhere")], "nowhere"),
    ]
    for argv, needle in cases:
        assert cli(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, (argv, err)


@pytest.mark.slow
def test_a_leftover_secrets_file_is_refused_and_a_failed_start_leaves_none(tiny, monkeypatch, capsys):
    tmp, cfg = tiny
    import userdp.lm.finetune as F  # the orchestrator calls the plan phase's resolve_chunk_size
    from userdp.errors import UserError

    (tmp / "run.audit-secrets.json").write_text("{}")
    assert cli(["audit", str(cfg), "--canaries", "8", "--output", str(tmp / "run"), "--no-progress"]) == 2
    assert "already there" in capsys.readouterr().err
    assert not (tmp / "run").exists()
    # a run that fails after the canaries were drawn but before its first step removes the
    # secrets file it wrote, with the run directory
    seen = []

    def fail(cfg_, model, device, rd, log, world_size=1):
        seen.append((tmp / "run3.audit-secrets.json").is_file())
        raise UserError("training.chunk_size: boom")

    monkeypatch.setattr(F, "resolve_chunk_size", fail)
    assert (
        cli(
            [
                "audit",
                str(cfg),
                "--canaries",
                "8",
                "--set",
                "audit.seed=1",
                "--output",
                str(tmp / "run3"),
                "--no-progress",
            ]
        )
        == 2
    )  # seeded: some canary is drawn, so the failure comes from the step
    assert seen == [True]
    assert not (tmp / "run3.audit-secrets.json").exists() and not (tmp / "run3").exists()


@pytest.mark.heavy(counterpart="tests/audit/test_audit_e2e.py::test_audit_json_secrets_and_report")
@pytest.mark.slow
def test_combine_pools_the_canaries_of_separate_runs(tiny, capsys):
    tmp, cfg = tiny
    runs = [tmp / "r1", tmp / "r2"]
    # seeded canaries: unseeded, a run of 6 drew none into training about once in 64 (a refused audit)
    for r, seed in zip(runs, (101, 202), strict=True):
        assert (
            cli(
                [
                    "audit",
                    str(cfg),
                    "--canaries",
                    "6",
                    "--output",
                    str(r),
                    "--no-progress",
                    "--set",
                    f"audit.seed={seed}",
                ]
            )
            == 0
        )
    capsys.readouterr()
    assert cli(["audit", "--combine", str(runs[0]), str(runs[1]), "--json"]) == 0
    c = _last_json(capsys)
    assert c["runs"] == 2 and c["canaries"] == 12
    secs = [json.loads((tmp / f"{r.name}.audit-secrets.json").read_text()) for r in runs]
    assert c["canaries_included"] == sum(sum(s["included"]) for s in secs)
    privs = [json.loads((r / "privacy.json").read_text()) for r in runs]
    assert c["epsilon"] == max(p["epsilon"] for p in privs)
    assert c["delta"] == max(p["audit"]["delta"] for p in privs)
    # the pooled bound is the one-run bound of the pooled scores
    from userdp.audit.bounds import one_run_bound

    want = one_run_bound(
        secs[0]["score"] + secs[1]["score"],
        secs[0]["included"] + secs[1]["included"],
        delta=c["delta"],
        confidence=0.95,
    )
    assert c["epsilon_lower_bound"] == pytest.approx(want.epsilon_lower_bound)
    # the same run twice is not two runs' worth of evidence
    assert cli(["audit", "--combine", str(runs[0]), str(runs[0])]) == 2
    assert "another run" in capsys.readouterr().err
    # a secrets file moved away is named, not mistaken for another run's canaries (issue 41)
    secret = tmp / f"{runs[1].name}.audit-secrets.json"
    secret.rename(tmp / "moved.json")
    assert cli(["audit", "--combine", str(runs[0]), str(runs[1])]) == 2
    err = capsys.readouterr().err
    assert f"{secret} is missing" in err and "another run" not in err and len(err.strip().splitlines()) == 1
