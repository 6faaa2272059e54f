"""The privacy statement (SPEC §8.3): every checklist field non-empty; tiers; mismatch flagged."""

import pytest

from userdp import accounting as A
from userdp.errors import UserError
from userdp.fileio import write_json
from userdp.lm import report as R
from userdp.lm import statement as S
from userdp.lm.run_dir import RunDir

from _records import engine_record

ENGINE = {
    "sampler_used": "sampler_mode",
    "epsilon_spent": "epsilon",
    "noise_multiplier": "noise_multiplier",
    "dp_event": "dp_event",
    "epsilon_no_amplification": "epsilon_no_amplification",
}


def _record(**kw):
    """privacy.json's content for a ULS run (20 steps, sigma 1.1, q 0.05); ``kw`` names the engine's
    figures as the statement does (ENGINE) or the job's facts."""
    engine = dict(
        dp_event=A.compose(A.uls_step_event(1.1, 0.05), 20),
        noise_multiplier=1.1,
        sampling_rate=0.05,
        steps=20,
        num_users=4000,
        expected_units=200.0,
        delta=1e-4,
        delta_rule="delta = N^-1.1 with N = 4000 users",
    )
    facts = dict(
        algorithm="uls",
        accountant="pld",
        sampler_assumed="poisson_users",
        epsilon_target=3.0,
        steps_planned=20,
        group_size=4,
        num_records=9000,
        clipping="flat",
        seq_len=64,
        tokenizer_note="tokenizer trained on declared-public text (4 plays)",
    )
    for k, v in kw.items():
        if k in ENGINE:
            engine[ENGINE[k]] = v
        else:
            facts[k] = v
    if engine.get("epsilon", 0) is None:  # a non-private run
        engine.update(dp_event=None, epsilon=None)
    return S.privacy_record(engine_record(algorithm=facts["algorithm"], **engine), S.ReleaseFacts(**facts))


def test_every_checklist_field_is_present_and_non_empty(tmp_path):
    rd = RunDir(tmp_path)
    rd.config.write_text("x: 1\n")
    write_json(rd.privacy, _record())
    # a record without the run's ledger journal beside it is not reported: the journal is the
    # source of truth its DpEvent is checked against
    with pytest.raises(UserError, match="ledger_journal.jsonl: missing"):
        R.write_report(tmp_path)
    rep = _record()
    md = R.render_markdown(rep)
    for key in R.REQUIRED:
        assert rep.get(key) not in (None, "", [], {}), key
    assert rep["dp_event"]["class_name"] == "SelfComposedDpEvent"
    assert rep["dp_event"]["count"] == 20
    assert "add/remove" in rep["adjacency"]
    assert "user" in rep["unit"]
    assert rep["assumptions_met"] is True
    assert any("hyperparameter" in s for s in rep["not_accounted"])
    assert rep["library_versions"]["dp-accounting"] != "not installed"
    for heading in ("Setting", "Instantiation", "Accounting", "Tier", "DpEvent"):
        assert heading in md


@pytest.mark.parametrize("eps,tier", [(0.5, 1), (1.0, 1), (3.0, 2), (10.0, 2), (12.0, 3)])
def test_tiers(eps, tier):
    assert R.epsilon_tier(eps)["tier"] == tier


def test_sampler_mismatch_is_flagged_with_no_amplification_epsilon():
    rec = _record(sampler_used="shuffle_fixed_batches", epsilon_no_amplification=55.0)
    assert rec["assumptions_met"] is False
    md = R.render_markdown(rec)
    assert "Mismatch" in md and "55" in md


def test_perplexity_selection_is_disclosed():
    rec = _record(selection="highest_ppl")
    assert any("perplexity" in s for s in rec["not_accounted"])


def test_nonprivate_run_says_so():
    rec = _record(algorithm="nonprivate", epsilon_spent=None, noise_multiplier=0.0)
    assert rec["tier"]["tier"] is None
    assert "No differential-privacy guarantee" in R.render_markdown(rec)


def test_the_els_record_discloses_the_dropped_mixture_tail():
    els = _record(algorithm="els", dp_event=A.compose(A.els_step_event(1.1, 0.05, 4), 20))["accountant"]
    assert "Binomial(G, q)" in els and "1e-6 of delta" in els
    # ULS has no mixture, and RDP drops nothing
    assert "1e-6" not in _record()["accountant"]
    assert "1e-6" not in _record(algorithm="els", accountant="rdp")["accountant"]
