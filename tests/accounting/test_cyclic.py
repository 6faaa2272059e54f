"""Cyclic Poisson sampling over b user groups (with independent or banded matrix-factorization
noise) is accounted as the Poisson-subsampled Gaussian at q·b composed ceil(T/b) times, through
the mechanism, calibration, the ledger and ``userdp account``; b = 1 is today's ULS figure."""

import json
import math

import dp_accounting
import pytest
from dp_accounting import dp_event as dpe
from dp_accounting.pld import pld_privacy_accountant

from userdp import accounting
from userdp.cli import main as cli
from userdp.engine.journal import journal_event
from userdp.engine.ledger import PrivacyLedger
from userdp.errors import UserError

DELTA = 1e-6


def _independent_pld(sigma: float, rate: float, compositions: int) -> float:
    """epsilon from dp_accounting's own PLD accountant, composed there (no userdp code)."""
    acc = pld_privacy_accountant.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4
    )
    acc.compose(dpe.PoissonSampledDpEvent(rate, dpe.GaussianDpEvent(sigma)), compositions)
    return acc.get_epsilon(DELTA)


@pytest.mark.parametrize("steps,bands", [(100, 4), (101, 4), (30, 7), (12, 12)])
def test_epsilon_is_dp_accountings_pld_over_ceil_t_over_b_compositions_at_q_times_b(steps, bands):
    q, sigma = 0.02, 1.1
    m = accounting.Mechanism("uls_cyclic", sigma, steps, sampling_rate=q, bands=bands)
    assert m.compositions() == math.ceil(steps / bands)
    want = _independent_pld(sigma, q * bands, math.ceil(steps / bands))
    assert m.epsilon(DELTA) == pytest.approx(want, rel=2e-3)


def test_one_band_is_todays_uls_to_the_last_digit():
    for steps in (1, 17, 250):
        uls = accounting.Mechanism("uls", 0.9, steps, sampling_rate=0.03)
        cyc = accounting.Mechanism("uls_cyclic", 0.9, steps, sampling_rate=0.03, bands=1)
        assert cyc.epsilon(DELTA) == uls.epsilon(DELTA)
        assert cyc.calibrated(2.0, DELTA).noise_multiplier == uls.calibrated(2.0, DELTA).noise_multiplier


def test_calibration_meets_the_target_over_the_compositions():
    m = accounting.Mechanism("uls_cyclic", 1.0, 200, sampling_rate=0.01, bands=5).calibrated(3.0, DELTA)
    assert m.epsilon(DELTA) <= 3.0
    assert m.replace(noise_multiplier=m.noise_multiplier * 0.99).epsilon(DELTA) > 3.0


def test_the_ledger_counts_one_composition_per_cycle_begun_and_stops_at_the_budget():
    m = accounting.Mechanism("uls_cyclic", 1.0, 40, sampling_rate=0.05, bands=4)
    ledger = PrivacyLedger(m.step_event(), DELTA, bands=4)
    for t in range(1, 10):
        ledger.record_step()
        assert ledger.epsilon() == m.replace(steps=t).epsilon(DELTA)  # a prefix pays for its own steps
        assert ledger.epsilon_upper_bound() >= ledger.epsilon() - 1e-9
    step_event, bands = journal_event(ledger.event_json())
    assert bands == 4 and step_event == m.step_event()
    target = m.replace(steps=12).epsilon(DELTA)  # three cycles fit, a fourth does not
    capped = PrivacyLedger(m.step_event(), DELTA, target_epsilon=target * (1 + 1e-9), bands=4)
    assert capped.max_steps() == 12
    with pytest.raises(UserError, match="a cyclic run's steps keep one event"):
        capped.rebase(m.step_event())


def test_a_group_rate_above_one_and_bands_without_a_cycle_are_refused():
    with pytest.raises(UserError, match=r"q·b = 1\.5 > 1"):
        accounting.Mechanism("uls_cyclic", 1.0, 10, sampling_rate=0.5, bands=3)
    with pytest.raises(UserError, match="only user-level cyclic Poisson sampling has bands"):
        accounting.Mechanism("uls", 1.0, 10, sampling_rate=0.1, bands=3)
    units = accounting.UnitSampling("record", 0.1, 2)
    with pytest.raises(UserError, match="ELS samples records"):
        accounting.Mechanism.for_training(units, "cyclic_poisson", 1.0, 10, bands=2)


def test_the_record_of_a_cycle_names_its_bands_and_the_others_read_as_before():
    cyc = accounting.Mechanism("uls_cyclic", 1.0, 10, sampling_rate=0.1, bands=3).to_dict()
    assert cyc["bands"] == 3 and cyc["step_event"]["sampling_probability"] == pytest.approx(0.3)
    assert "bands" not in accounting.Mechanism("uls", 1.0, 10, sampling_rate=0.1).to_dict()
    assert accounting.Mechanism.from_dict(cyc).epsilon(DELTA) == accounting.Mechanism(
        "uls_cyclic", 1.0, 10, sampling_rate=0.1, bands=3
    ).epsilon(DELTA)


def _account(capsys, *extra):
    """``userdp account`` in this process: (exit code, stdout, stderr)."""
    args = ["--mechanism", "uls", "--noise-multiplier", "1.0", "--users", "1170", "--cohort-size", "64"]
    code = cli(["account", *args, "--steps", "100", *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_userdp_account_takes_bands(capsys):
    code, out, err = _account(capsys, "--bands", "4", "--json")
    assert code == 0, err
    got = _last_json(out)
    want = accounting.Mechanism("uls_cyclic", 1.0, 100, sampling_rate=64 / 1170, bands=4)
    assert got["epsilon"] == pytest.approx(want.epsilon(got["delta"]), rel=1e-9) and got["bands"] == 4
    plain = _last_json(_account(capsys, "--json")[1])
    one = _last_json(_account(capsys, "--bands", "1", "--json")[1])
    assert one["epsilon"] == plain["epsilon"]
    code, _, err = _account(capsys, "--bands", "40")
    assert code == 2 and err.count("\n") == 1 and "use at most 18 bands" in err
    code = cli(["account", "--mechanism", "els", "--noise-multiplier", "1", "--sampling-rate", "0.01", "--steps",
                "10", "--delta", "1e-6", "--bands", "2"])  # fmt: skip
    assert code == 2 and "--bands applies to --mechanism uls" in capsys.readouterr().err
