"""The privacy statement (SPEC §8.3): every checklist field non-empty; tiers; mismatch flagged."""


import pytest

from userdp import accounting as A
from userdp.errors import UserError
from userdp.fileio import write_json
from userdp.lm import report as R
from userdp.lm.run_dir import RunDir


def _record(**kw):
    ev = A.compose(A.uls_step_event(1.1, 0.05), 20)
    args = dict(algorithm="uls", accountant="pld", sampler_assumed="poisson_users",
                sampler_used="poisson_users", epsilon_spent=A.epsilon(ev, 1e-4),
                epsilon_target=3.0, delta=1e-4, delta_rule="delta = N^-1.1 with N = 4000 users",
                noise_multiplier=1.1, sampling_rate=0.05, steps_taken=20, steps_planned=20,
                clip_norm=1.0, group_size=4, num_users=4000, num_records=9000,
                expected_cohort=200.0, clipping="flat", dp_event=ev, seq_len=64,
                tokenizer_note="tokenizer trained on declared-public text (4 plays)")
    args.update(kw)
    return R.privacy_record(**args)


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
