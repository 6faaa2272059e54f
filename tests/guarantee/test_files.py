"""Issue 34, the file test: a figure in a statement is re-derived from facts bound outside the
file that carries it (the ledger journal, bound before the first step). Here: the tuning section
(C2, C3) and the plan's DP median (H4)."""

import json

import pytest

from userdp.accounting import private_selection as PS
from userdp.accounting.selection import TrialCount
from userdp.cli import main as cli

from _lm_corpus import write_tiny_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("files")
    cfg, _ = write_tiny_run(tmp, "")
    out = tmp / "run"
    import os

    os.environ["USERDP_CACHE"] = str(tmp / "cache")
    try:
        assert cli(["train", str(cfg), "--output", str(out), "--no-progress"]) == 0
    finally:
        os.environ.pop("USERDP_CACHE", None)
    return out


def _fake_tuning(priv: dict, trials: list) -> dict:
    count = TrialCount.with_mean("tnb", 8.0, 1.0).to_dict()
    events = {"m": priv["dp_event"]}
    return {
        "on": "private",
        "delta": priv["delta"],
        "trial_count": count,
        "run_events": events,
        "trial_mechanisms": trials,
        "trials_run": 8,
        "best": {"mechanism": "m"},
        "contract_sha256": PS.contract_digest("private", count, priv["delta"], events),
        "epsilon_total": PS.derive(events, None, PS.trial_count_from_dict(count, "t"), priv["delta"])[
            "epsilon_released_model"
        ],
    }


@pytest.mark.parametrize("trials", [[], ["m"]])
def test_a_tuning_section_added_to_an_untuned_run_is_refused(finished, capsys, trials):
    """C2: an untuned run given a hand-written private tuning section (self-consistent: its figure
    re-derives from its own events) was certified as epsilon = 0 with an empty trial list. The
    run's journal was bound to a config without a tuning contract: refused."""
    p = finished / "privacy.json"
    good = p.read_text()
    rec = json.loads(good)
    rec["tuning"] = _fake_tuning(rec, trials)
    p.write_text(json.dumps(rec))
    try:
        capsys.readouterr()
        assert cli(["report", str(finished)]) == 2
        err = capsys.readouterr().err
        assert "names no tuning contract" in err and "Traceback" not in err
    finally:
        p.write_text(good)
    assert cli(["report", str(finished)]) == 0


def test_an_edited_config_naming_a_contract_is_refused_by_the_journal(finished, capsys):
    """The contract is bound through config.yaml's fingerprint: writing one into config.yaml after
    the run breaks its binding to the journal."""
    c = finished / "config.yaml"
    good = c.read_text()
    p = finished / "privacy.json"
    pgood = p.read_text()
    rec = json.loads(pgood)
    rec["tuning"] = _fake_tuning(rec, ["m"])
    p.write_text(json.dumps(rec))
    assert "tuning_contract: null" in good
    c.write_text(good.replace("tuning_contract: null", f"tuning_contract: {rec['tuning']['contract_sha256']}", 1))
    try:
        capsys.readouterr()
        assert cli(["report", str(finished)]) == 2
        assert "not the configuration this run's ledger journal was bound to" in capsys.readouterr().err
    finally:
        c.write_text(good)
        p.write_text(pgood)


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda r: r.update(num_users=r["num_users"] * 100), "num_users"),
        (lambda r: r.update(num_records=r["num_records"] * 100), "num_records"),
        (lambda r: r.update(not_accounted=[]), "lacks a line"),
        (
            lambda r: r.update(not_accounted=[n for n in r["not_accounted"] if not n.startswith("monitoring")]),
            "lacks a line",
        ),
        (lambda r: r.update(not_accounted=[n for n in r["not_accounted"] if "pretrain" not in n]), "lacks a line"),
        (
            lambda r: r.update(not_accounted=[n for n in r["not_accounted"] if not n.startswith("hyperparameter")]),
            "lacks a line",
        ),
    ],
)
def test_the_statements_scope_is_the_one_the_journal_was_bound_to(finished, capsys, edit, needle):
    """M2: `userdp report` re-derived epsilon but took the statement's scope from the file it checks:
    an emptied not_accounted (the card's "Not covered" lost the un-noised monitoring, tuning and
    public-pretraining lines) and num_users x 100 were printed. Both are bound to the ledger journal
    before the first step: a record that prints other counts or drops a line is refused; one that
    adds a line (more disclosure) is not."""
    p = finished / "privacy.json"
    good = p.read_text()
    rec = json.loads(good)
    edit(rec)
    p.write_text(json.dumps(rec))
    try:
        capsys.readouterr()
        assert cli(["report", str(finished)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0] and "privacy.json" in err[0]
    finally:
        p.write_text(good)
    rec = json.loads(good)
    rec["not_accounted"] = rec["not_accounted"] + ["an extra disclosure"]
    p.write_text(json.dumps(rec))
    try:
        assert cli(["report", str(finished)]) == 0
    finally:
        p.write_text(good)


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda r: r.update(noise_multiplier=r["noise_multiplier"] * 3), "noise_multiplier"),
        (lambda r: r.update(sampling_rate=r["sampling_rate"] / 10), "sampling_rate"),
        (lambda r: r.update(steps_taken=r["steps_taken"] - 1), "steps_taken"),
        (lambda r: r.update(adjacency="replace one record"), "its adjacency"),
        (lambda r: r.update(setting="local DP on each device"), "its setting"),
        (lambda r: r.update(mechanism_output="the final model only"), "its mechanism_output"),
        (lambda r: r.update(seeded=True), "seeded is True"),
    ],
)
def test_the_figures_beside_the_dpevent_are_the_journals_events_own(finished, capsys, edit, needle):
    """Property 3 of round 5: the statement is derived, not read. Beside the verified DpEvent, the
    noise multiplier, the sampling rate and the steps it prints are the journal's step event's and
    step count, and its fixed sentences are userdp's own; a record that says otherwise is refused."""
    p = finished / "privacy.json"
    good = p.read_text()
    rec = json.loads(good)
    edit(rec)
    p.write_text(json.dumps(rec))
    try:
        capsys.readouterr()
        assert cli(["report", str(finished)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0] and "privacy.json" in err[0]
    finally:
        p.write_text(good)
    assert cli(["report", str(finished)]) == 0


def test_a_seeded_run_cannot_be_restated_as_unseeded(tmp_path, monkeypatch, capsys):
    """Whoever holds a seeded run's seed can remove its noise: the statement says SEEDED. A record
    edited to say seeded: false (and to drop the SEEDED assumption) is refused: the journal-bound
    config.yaml gives the seed."""
    cfg, _ = write_tiny_run(tmp_path, "  seed: 3\n")
    monkeypatch.setenv("USERDP_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "seeded"
    assert cli(["train", str(cfg), "--set", "training.steps=2", "--output", str(out), "--no-progress"]) == 0
    p = out / "privacy.json"
    rec = json.loads(p.read_text())
    assert rec["seeded"] is True
    for edit in (
        dict(seeded=False),
        dict(assumptions=[a for a in rec["assumptions"] if not a.startswith("SEEDED RUN")]),
    ):
        p.write_text(json.dumps({**rec, **edit}))
        capsys.readouterr()
        assert cli(["report", str(out)]) == 2
        assert "seeded" in capsys.readouterr().err
