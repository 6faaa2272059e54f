"""The audit has power (issue 13, item 6). On the embedded default, with the black-box loss score
on text canaries: a large bound for a non-private run, a bound below 1 for a correct run at
epsilon = 1, a build whose noise is off caught. With gradient-space canaries (the default score):
a correct run at epsilon = 1 stays below 1, and builds with clipping off or a user counted 16
times are caught while the accountant claims epsilon = 1. Each run is the embedded default (100
steps) with 400 canary users; training and canaries are seeded so the outcome is fixed.

To fit CI's time, the runs keep 200 of the corpus's users (`data.max_users`: ~200 train beside the
~200 canaries drawn in, N ~ 396) and shrink the cohort with them: a step costs about a third of the
full corpus's. The audit's power is in the canaries and in how often one is drawn (q * T), not in
the number of real users beside them: the non-private run keeps about the full corpus's q (17 / 396
= 0.043 against 64 / 1366 = 0.047); the private runs use q = 11.5 / 396 = 0.029 (32 / 1366 = 0.023
on the full corpus), a canary drawn ~3 times in 100 steps, which keeps the margins of the faulty
builds. delta is fixed at the full corpus's N^-1.1 (1366 users): N^-1.1 of the smaller N would be
larger and would cap the largest bound this audit can show at 2.93 instead of 3.95. Measured with
these settings (seed 11): correct runs 0.0 (loss) and 0.31 (gradient) against 1; noise off 2.51
against 0.997; clipping off 2.60 and a user counted 16 times 2.34 against 2; the non-private run
2.82 against 2. The model is pretrained for 100 steps, not the default 400: the audit needs a
model that learns the canaries, not a good one, and on a fresh machine (CI) the default's
pretraining was a minute of the first of these tests. Sequences are 32 tokens, not the default
64 (the text canaries' secrets with them): a step costs half as much, and every figure above was
measured again with it (the gradient-canary correct run 0.29 against 0.31 with 64 tokens, the
others the same to two decimals). The margins of unseeded runs of the full
corpus are in benchmarks/HISTORY.md."""

import json

import pytest

from userdp.audit.faults import broken_session
from userdp.audit.session import AuditSession
from userdp.lm import config as C
from userdp.lm.finetune import run
from userdp.lm.job_context import Launch

AUDIT = [
    "audit.canaries=400",
    "audit.seed=2026",
    "training.seed=11",
    "audit.inference_users=0",
    "eval.before=false",
    "data.max_eval_users=16",  # the held-out perplexity is not what these test
    "data.max_users=200",
    "privacy.delta=3.5563e-4",
    "model.pretraining.steps=100",
    "tokenizer.seq_len=32",
]  # module docstring
LOSS = ["audit.score=loss"]
COHORT = ["training.cohort_size=11.5"]  # the private runs: q = 11.5 / ~396 users
NONPRIVATE = ["training.algorithm=nonprivate", "training.cohort_size=17"]  # ~ q = 64 / 1366 of the full corpus


def _audit(tmp_path, overrides, fault=None, times=16):
    cfg = C.load_config(None, AUDIT + overrides)
    session = broken_session(fault, times) if fault else AuditSession
    s = run(cfg, output=str(tmp_path / "run"), progress=False, log=lambda m: None, launch=Launch(audit=session))
    return s, json.loads((tmp_path / "run" / "privacy.json").read_text())


@pytest.mark.heavy(counterpart="tests/audit/test_audit_e2e.py::test_audit_json_secrets_and_report")
@pytest.mark.slow
def test_a_non_private_run_is_caught_with_a_large_bound(tmp_path):
    s, priv = _audit(tmp_path, LOSS + NONPRIVATE)
    a = priv["audit"]
    assert s["epsilon"] is None and a["epsilon_upper_bound"] is None
    assert a["epsilon_lower_bound"] >= 2.0, a
    assert a["canary_auc"] > 0.9
    assert a["seeded"] is True


@pytest.mark.heavy(counterpart="tests/audit/test_bounds.py::test_the_bound_is_valid_for_an_eps_dp_mechanism")
@pytest.mark.slow
def test_a_correct_run_at_epsilon_1_stays_below_1(tmp_path):
    s, priv = _audit(tmp_path, LOSS + COHORT + ["privacy.epsilon=1"])
    a = priv["audit"]
    assert 0.9 < s["epsilon"] <= 1.0
    assert a["epsilon_lower_bound"] < 1.0 and not a["mechanism_caught"]
    assert "broken_build" not in priv["engine_record"]


@pytest.mark.heavy(counterpart="tests/audit/test_audit_e2e.py::test_audit_json_secrets_and_report")
@pytest.mark.slow
def test_a_build_without_noise_is_caught(tmp_path):
    s, priv = _audit(tmp_path, LOSS + COHORT + ["privacy.epsilon=1"], fault="noise_off")
    a = priv["audit"]
    assert priv["engine_record"]["broken_build"] == "noise_off"
    assert s["epsilon"] <= 1.0  # the broken build still claims epsilon = 1 ...
    assert a["mechanism_caught"] and a["epsilon_lower_bound"] > s["epsilon"]  # ... and is caught
    report = (tmp_path / "run" / "report.md").read_text()
    assert "must not be relied on" in report


@pytest.mark.heavy(counterpart="tests/audit/test_bounds.py::test_the_bound_is_valid_for_an_eps_dp_mechanism")
@pytest.mark.slow
def test_gradient_canaries_keep_a_correct_run_below_its_epsilon(tmp_path):
    _, priv = _audit(tmp_path, COHORT + ["privacy.epsilon=1"])
    a = priv["audit"]
    assert a["score"].startswith("gradient:")
    assert priv["engine_record"]["per_unit"]["strategy"] == "vmap"
    assert a["epsilon_lower_bound"] < 1.0 and not a["mechanism_caught"]


@pytest.mark.heavy(counterpart="tests/audit/test_audit_e2e.py::test_audit_json_secrets_and_report")
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["clipping_off", "user_counted_g_times"])
def test_gradient_canaries_catch_a_wrong_sensitivity(tmp_path, fault):
    s, priv = _audit(tmp_path, COHORT + ["privacy.epsilon=1"], fault=fault, times=16)
    a = priv["audit"]
    assert priv["engine_record"]["broken_build"] == fault and s["epsilon"] <= 1.0
    assert a["mechanism_caught"] and a["epsilon_lower_bound"] > 2.0, a
