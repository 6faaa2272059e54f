"""`plan: auto` in a training config: validation, the planned run, its resume and its report."""

import json
from pathlib import Path

import pytest
import yaml

from userdp import accounting as A
from userdp.cli import main as cli
from userdp.errors import UserError
from userdp.lm import config as C

from _lm_corpus import interrupt_after_checkpoint, tiny_config, write_tiny_corpus

BUDGET = 16


# ------------------------------------------------------------------ config validation


def test_plan_defaults_to_none_and_accepts_auto(tmp_path):
    assert C.load_config().plan is None
    assert C.load_config().planning.sample_users == 128
    f = tmp_path / "c.yaml"
    f.write_text("plan: auto\nplanning:\n  compute_budget: 64\n  dp_median_epsilon: 0.1\n")
    cfg = C.load_config(f)
    assert cfg.plan == "auto" and cfg.planning.compute_budget == 64
    assert cfg.planning.dp_median_epsilon == 0.1 and cfg.planning.sample_users == 128
    f.write_text("plan: null\n")
    assert C.load_config(f).plan is None
    # --set reaches the new keys too
    cfg = C.load_config(None, ["plan=auto", "planning.compute_budget=32"])
    assert cfg.plan == "auto" and cfg.planning.compute_budget == 32


def test_plan_auto_without_compute_budget_names_the_key(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("plan: auto\n")
    with pytest.raises(UserError, match=r"c.yaml.*planning.compute_budget"):
        C.load_config(f)


@pytest.mark.parametrize(
    "text, match",
    [
        ("plan: manual\n", "plan must be one of auto"),
        ("planning:\n  budget: 8\n", "unknown key 'planning.budget'"),
        ("plan: auto\nplanning:\n  compute_budget: 0\n", "planning.compute_budget must be >= 1"),
        ("plan: auto\nplanning:\n  compute_budget: 8\n  sample_users: 0\n", "planning.sample_users must be >= 1"),
        ("planning:\n  dp_median_epsilon: -1\n", "planning.dp_median_epsilon must be > 0"),
        ("planning:\n  algorithm: fedavg\n", "planning.algorithm must be one of"),
        (
            "plan: auto\nplanning:\n  compute_budget: 8\ntraining:\n  algorithm: nonprivate\n",
            "chooses between uls and els",
        ),
        (
            "plan: auto\nplanning:\n  compute_budget: 8\nprivacy:\n  noise_multiplier: 1.0\n",
            "drop privacy.noise_multiplier",
        ),
    ],
)
def test_bad_planning_keys_are_refused(tmp_path, text, match):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(UserError, match=match):
        C.load_config(f)


def test_cli_error_is_one_line(tmp_path, capsys):
    f = tmp_path / "c.yaml"
    f.write_text("plan: auto\n")
    assert cli(["train", str(f), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "planning.compute_budget" in err


# ------------------------------------------------------------------ end to end (tiny)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("plan_auto")
    data, public = write_tiny_corpus(tmp_path)
    base = tiny_config(
        data,
        public,
        "  checkpoint_every: 1\n  seed: 3\n",
        "  accountant: rdp  # calibrates faster than PLD at these settings\n",
        f"eval:\n  before: false\noutput:\n  plot: false\nplan: auto\nplanning:\n"
        f"  compute_budget: {BUDGET}\n  sample_users: 8\n  seed: 1\n",
    )
    return tmp_path, base


@pytest.fixture
def tiny(tiny_files, tmp_path, monkeypatch):
    shared, base = tiny_files
    monkeypatch.setenv("USERDP_CACHE", str(shared / "cache"))
    return tmp_path, base


@pytest.mark.slow
def test_plan_auto_run_saves_planned_config_resumes_without_replanning_and_reports(tiny, monkeypatch, capsys):
    tmp, base = tiny
    cfg = tmp / "c.yaml"
    cfg.write_text(base)
    out = tmp / "run"
    import userdp.lm.training as F

    real = interrupt_after_checkpoint(monkeypatch, 2)
    import userdp.fileio
    import userdp.lm.finetune
    import userdp.lm.plan_auto

    written = []  # config.yaml is written once, as planned (issue 36: it was written, then rewritten)
    for mod in (userdp.lm.finetune, userdp.lm.plan_auto):
        monkeypatch.setattr(
            mod,
            "write_atomic",
            lambda path, *a, **k: written.append(Path(path).name) or userdp.fileio.write_atomic(path, *a, **k),
        )
    assert cli(["train", str(cfg), "--output", str(out), "--no-progress"]) == 130
    err = capsys.readouterr().err
    chose = [ln for ln in err.splitlines() if ln.startswith("plan: auto chose")]
    assert len(chose) == 1, err
    assert written.count("config.yaml") == 1, written
    assert (out / "config.yaml").read_text().startswith("# plan: auto chose")
    written.clear()

    plan = json.loads((out / "plan.json").read_text())
    saved = yaml.safe_load((out / "config.yaml").read_text())
    algo = plan["applied"]
    assert algo == plan["recommended"] in ("uls", "els")
    t = saved["training"]
    assert t["algorithm"] == algo
    assert t["group_size"] == plan["overrides"]["training.group_size"]
    assert t["cohort_size"] == plan["overrides"]["training.cohort_size"]
    if algo == "uls":
        assert t["cohort_size"] * t["group_size"] <= BUDGET
        assert t["group_size"] == plan["uls"]["group_size"]
    else:  # ELS: the budget counts records per step
        assert t["cohort_size"] <= BUDGET
        assert t["group_size"] == plan["els"]["group_size"]
    assert f"{algo.upper()}" in chose[0] and f"group_size {t['group_size']}" in chose[0]

    # resume: the saved values are used, and the plan is not made again
    monkeypatch.setattr(F, "_save_weights", real)

    def no_replan(*a, **k):
        raise AssertionError("resume must not plan again")

    import userdp.lm.plan_auto as P

    monkeypatch.setattr(P, "plan_auto", no_replan)
    assert cli(["train", "--resume", str(out), "--json", "--no-progress"]) == 0
    assert "config.yaml" not in written  # a resumed run keeps its own
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # the step begun before the interrupt is counted, never replayed (issue 34, H1): 3 or 4 steps
    # applied within the budget, depending on whether the planned sigma leaves room for the extra one
    assert summary["steps"] in (3, 4) and summary["algorithm"] == algo
    assert summary["group_size"] == t["group_size"] and summary["cohort_size"] == t["cohort_size"]

    priv = json.loads((out / "privacy.json").read_text())
    assert priv["plan"]["overrides"] == plan["overrides"]
    assert priv["group_size"] == t["group_size"]
    assert priv["epsilon_plan"] == 0.0 and priv["epsilon_total"] == priv["epsilon"] <= 8.0
    touches = " ".join(priv["not_accounted"])
    assert "per-user record counts" in touches
    assert "8 training users were sampled" in touches and "gradients at the pretrained model" in touches
    # each touch once, in the report's own words (issue 28: the plan's summary sentence, which
    # repeated them and addressed the report itself, is not listed again)
    assert plan["data_touches"] not in priv["not_accounted"]
    assert sum("per-user record counts" in n for n in priv["not_accounted"]) == 1
    assert not any("report must say so" in n for n in priv["not_accounted"])
    assert cli(["report", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "## 4b. Plan" in md and "8 training users were sampled" in md
    assert "per-user record counts" in md


@pytest.mark.slow
def test_plan_auto_dp_median_is_counted_in_the_total(tiny, capsys):
    tmp, base = tiny
    cfg = tmp / "c.yaml"
    cfg.write_text(base.replace("  seed: 1\n", "  seed: 1\n  dp_median_epsilon: 0.5\n  algorithm: els\n"))
    out = tmp / "run"
    assert cli(["train", str(cfg), "--output", str(out), "--json", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["algorithm"] == "els" and summary["plan"] == "els"
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["training"]["algorithm"] == "els"
    assert saved["training"]["cohort_size"] <= BUDGET
    priv = json.loads((out / "privacy.json").read_text())
    assert priv["plan"]["els"]["group_size_method"] == "dp_median"
    assert priv["epsilon_plan"] == 0.5
    # spent through the ledger (issue 36): the median's pure-DP event composed before the steps, the
    # whole within the target, and tighter than adding the two epsilons
    event = A.event_from_dict(priv["dp_event"])
    assert A.has_pure_dp(event)
    assert priv["epsilon_total"] == priv["epsilon"] == summary["epsilon_total"] <= priv["epsilon_target"]
    acc = priv["engine_record"]["accountant"]
    assert priv["epsilon"] == pytest.approx(A.epsilon(event, priv["delta"], acc), rel=1e-9)
    training_only = A.compose(A.event_from_dict(priv["engine_record"]["step_event"]), priv["steps_taken"])
    assert priv["epsilon"] < A.epsilon(training_only, priv["delta"], acc) + 0.5
    assert any("epsilon-DP median" in n for n in priv["not_accounted"])
    assert cli(["report", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert f"({priv['epsilon_total']:.4g}, " in md and "in total" in md and "composed by the accountant" in md
    assert "extra spend" in md
    # issue 34 (H4): the plan's spend is bound to the journal; deleting or editing the plan section
    # no longer drops it from the headline
    good = (out / "privacy.json").read_text()
    for edit, why in (
        (lambda r: r.pop("plan"), "carries no plan section"),
        (
            lambda r: r["plan"].update(
                dp_median_epsilon_spent=0.0, els=dict(r["plan"]["els"], group_size_method="median")
            ),
            "not the 0.5 the ledger journal",
        ),
    ):
        rec = json.loads(good)
        edit(rec)
        (out / "privacy.json").write_text(json.dumps(rec))
        capsys.readouterr()
        assert cli(["report", str(out)]) == 2
        assert why in capsys.readouterr().err
    (out / "privacy.json").write_text(good)
    assert cli(["report", str(out)]) == 0
    # a run written before the median went through the ledger (its event without it) still verifies, and
    # its total adds the median by basic composition: dropping the median from the event never lowers it
    legacy = json.loads(good)
    legacy["dp_event"] = A.event_to_dict(training_only)
    legacy["epsilon"] = A.epsilon(training_only, priv["delta"], acc)
    (out / "privacy.json").write_text(json.dumps(legacy))
    capsys.readouterr()
    assert cli(["report", str(out), "--json"]) == 0, capsys.readouterr().err
    rep = json.loads(capsys.readouterr().out)
    assert rep["epsilon_total"] == pytest.approx(legacy["epsilon"] + 0.5) and rep["epsilon_total"] > priv["epsilon"]
    (out / "privacy.json").write_text(good)
