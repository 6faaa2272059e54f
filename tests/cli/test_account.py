"""`userdp account` and `userdp calibrate` through userdp.cli.main."""

import json

import pytest

from userdp import accounting as A
from userdp.accounting import split as AC
from userdp.cli import main


def run(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse usage errors
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_account_json_matches_library(capsys):
    rc, out, _ = run(
        [
            "account",
            "--mechanism",
            "els",
            "--noise-multiplier",
            "200",
            "--sampling-rate",
            "0.02",
            "--steps",
            "100",
            "--group-size",
            "8",
            "--delta",
            "1e-6",
            "--json",
        ],
        capsys,
    )
    assert rc == 0
    d = json.loads(out)
    for key in ("epsilon", "delta", "noise_multiplier", "mechanism", "accountant"):
        assert key in d
    assert d["mechanism"] == "els" and d["accountant"] == "pld" and d["group_size"] == 8
    assert d["delta"] == 1e-6 and d["delta_rule"] == "delta given by --delta"
    assert d["adjacency"] == "add_or_remove_one_user" and d["sampling"] == "poisson"
    assert d["epsilon"] == A.epsilon(A.compose(A.els_step_event(200, 0.02, 8), 100), 1e-6)


def test_account_defaults_group_size_1_and_pld_and_delta_rule(capsys):
    rc, out, _ = run(
        [
            "account",
            "--mechanism",
            "uls",
            "--noise-multiplier",
            "1",
            "--users",
            "1000000",
            "--cohort-size",
            "5000",
            "--steps",
            "200",
            "--json",
        ],
        capsys,
    )
    d = json.loads(out)
    assert rc == 0 and d["group_size"] == 1 and d["accountant"] == "pld"
    assert d["sampling_rate"] == 0.005
    assert d["delta"] == pytest.approx(1e6**-1.1) and "N^-1.1" in d["delta_rule"]
    assert d["epsilon"] == pytest.approx(0.697, abs=0.001)


def test_account_text_says_what_gave_delta(capsys):
    rc, out, _ = run(
        [
            "account",
            "--mechanism",
            "uls",
            "--noise-multiplier",
            "1",
            "--users",
            "1000000",
            "--cohort-size",
            "5000",
            "--steps",
            "200",
            "--accountant",
            "rdp",
        ],
        capsys,
    )
    assert rc == 0 and "N^-1.1" in out and "RDP" in out and "User-level" in out
    assert len(out.strip().splitlines()) <= 3


def test_account_fixed_cohort_reproduces_a4(capsys):
    rc, out, _ = run(
        [
            "account",
            "--mechanism",
            "uls",
            "--noise-multiplier",
            "5",
            "--users",
            "1000000",
            "--cohort-size",
            "100",
            "--steps",
            "200",
            "--fixed-cohort",
            "--json",
        ],
        capsys,
    )
    d = json.loads(out)
    assert rc == 0 and d["accountant"] == "rdp" and d["adjacency"] == "replace_one_user"
    assert d["epsilon"] == pytest.approx(0.0340, abs=5e-5)


def test_account_count_noise_stddev(capsys):
    rc, out, _ = run(
        [
            "account",
            "--mechanism",
            "uls",
            "--noise-multiplier",
            "1",
            "--sampling-rate",
            "0.01",
            "--steps",
            "100",
            "--delta",
            "1e-5",
            "--count-noise-stddev",
            "5",
            "--json",
        ],
        capsys,
    )
    d = json.loads(out)
    assert rc == 0 and d["noise_multiplier"] == 1.0
    assert d["update_noise_multiplier"] == pytest.approx(1.00504, abs=5e-6)
    assert d["epsilon"] == A.epsilon(A.compose(A.uls_step_event(1.0, 0.01), 100), 1e-5)


@pytest.mark.slow
def test_calibrate_json_and_pessimism(capsys):
    rc, out, _ = run(
        [
            "calibrate",
            "--mechanism",
            "uls",
            "--epsilon",
            "1",
            "--sampling-rate",
            "0.01",
            "--steps",
            "300",
            "--delta",
            "1e-6",
            "--count-noise-stddev",
            "10",
            "--json",
        ],
        capsys,
    )
    d = json.loads(out)
    assert rc == 0 and d["epsilon"] == 1.0 and d["mechanism"] == "uls"
    z = d["noise_multiplier"]
    assert A.epsilon(A.compose(A.uls_step_event(z, 0.01), 300), 1e-6) <= 1.0
    assert A.epsilon(A.compose(A.uls_step_event(z / 1.01, 0.01), 300), 1e-6) > 1.0
    assert d["update_noise_multiplier"] == pytest.approx(AC.update_noise_multiplier(z, 10.0))


def test_calibrate_text(capsys):
    rc, out, _ = run(
        [
            "calibrate",
            "--mechanism",
            "els",
            "--epsilon",
            "0.3",
            "--users",
            "10000",
            "--cohort-size",
            "100",
            "--steps",
            "100",
            "--group-size",
            "4",
        ],
        capsys,
    )
    assert rc == 0 and "Calibrated" in out and "ELS" in out and "N^-1.1" in out


BAD = [
    (
        [
            "account",
            "--mechanism",
            "els",
            "--noise-multiplier",
            "0",
            "--sampling-rate",
            "0.1",
            "--steps",
            "10",
            "--delta",
            "1e-6",
        ],
        "--noise-multiplier",
    ),
    (
        [
            "account",
            "--mechanism",
            "els",
            "--noise-multiplier",
            "-2",
            "--sampling-rate",
            "0.1",
            "--steps",
            "10",
            "--delta",
            "1e-6",
        ],
        "--noise-multiplier",
    ),
    (
        [
            "account",
            "--mechanism",
            "els",
            "--noise-multiplier",
            "1",
            "--sampling-rate",
            "0",
            "--steps",
            "10",
            "--delta",
            "1e-6",
        ],
        "--sampling-rate",
    ),
    (
        [
            "account",
            "--mechanism",
            "els",
            "--noise-multiplier",
            "1",
            "--sampling-rate",
            "1.01",
            "--steps",
            "10",
            "--delta",
            "1e-6",
        ],
        "--sampling-rate",
    ),
    (
        [
            "account",
            "--mechanism",
            "els",
            "--noise-multiplier",
            "1",
            "--sampling-rate",
            "0.1",
            "--steps",
            "10",
            "--delta",
            "1e-6",
            "--group-size",
            "0",
        ],
        "--group-size",
    ),
    (
        [
            "account",
            "--mechanism",
            "els",
            "--noise-multiplier",
            "1",
            "--sampling-rate",
            "0.1",
            "--steps",
            "0",
            "--delta",
            "1e-6",
        ],
        "--steps",
    ),
    (
        [
            "account",
            "--mechanism",
            "els",
            "--noise-multiplier",
            "1",
            "--sampling-rate",
            "0.1",
            "--steps",
            "10",
            "--delta",
            "1",
        ],
        "--delta",
    ),
    (
        [
            "account",
            "--mechanism",
            "els",
            "--noise-multiplier",
            "1",
            "--sampling-rate",
            "0.1",
            "--steps",
            "10",
            "--delta",
            "0",
        ],
        "--delta",
    ),
    (
        ["account", "--mechanism", "els", "--noise-multiplier", "1", "--sampling-rate", "0.1", "--steps", "10"],
        "--delta",
    ),
    (
        [
            "account",
            "--mechanism",
            "uls",
            "--noise-multiplier",
            "1",
            "--users",
            "100",
            "--cohort-size",
            "200",
            "--steps",
            "10",
        ],
        "--cohort-size",
    ),
    (["account", "--mechanism", "uls", "--noise-multiplier", "1", "--users", "100", "--steps", "10"], "--cohort-size"),
    (
        [
            "account",
            "--mechanism",
            "uls",
            "--noise-multiplier",
            "3",
            "--sampling-rate",
            "0.1",
            "--steps",
            "10",
            "--delta",
            "1e-6",
            "--count-noise-stddev",
            "1",
        ],
        "--count-noise-stddev",
    ),
    (
        [
            "account",
            "--mechanism",
            "mog",
            "--noise-multiplier",
            "1",
            "--sampling-rate",
            "0.1",
            "--steps",
            "10",
            "--delta",
            "1e-6",
        ],
        "--mechanism",
    ),
    (
        [
            "calibrate",
            "--mechanism",
            "uls",
            "--epsilon",
            "0",
            "--sampling-rate",
            "0.1",
            "--steps",
            "10",
            "--delta",
            "1e-6",
        ],
        "--epsilon",
    ),
    (
        [
            "calibrate",
            "--mechanism",
            "uls",
            "--epsilon",
            "1e-9",
            "--sampling-rate",
            "1",
            "--steps",
            "10",
            "--delta",
            "1e-6",
        ],
        "--epsilon",
    ),
    (
        [
            "calibrate",
            "--mechanism",
            "els",
            "--epsilon",
            "abc",
            "--sampling-rate",
            "0.1",
            "--steps",
            "10",
            "--delta",
            "1e-6",
        ],
        "--epsilon",
    ),
]


@pytest.mark.parametrize("argv,name", BAD)
def test_bad_input_one_line_exit_2(argv, name, capsys):
    rc, out, err = run(argv, capsys)
    assert rc == 2
    assert "Traceback" not in err and out == ""
    assert len(err.strip().splitlines()) == 1
    assert name in err
