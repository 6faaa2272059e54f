"""`userdp data stats` / `userdp data build` end to end on tiny data."""

import json

import pytest

from userdp.cli import main


@pytest.fixture
def jsonl(tmp_path):
    rows = [{"user": f"u{i % 4}", "text": f"post {i} " * (1 + i % 3)} for i in range(21)] + [
        {"user": "u9", "text": "  "}
    ]
    p = tmp_path / "a.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_stats_json_and_plot(jsonl, tmp_path, capsys):
    from userdp.data.tokenize import PublicText, train_bpe

    tok = train_bpe(PublicText(["post one two"] * 10, description="t"), vocab_size=270, min_frequency=1)
    tok.save(str(tmp_path / "tok.json"))
    png = tmp_path / "h.png"
    assert (
        main(["data", "stats", str(jsonl), "--json", "--plot", str(png), "--tokenizer", str(tmp_path / "tok.json")])
        == 0
    )
    s = json.loads(capsys.readouterr().out)
    assert s["users"] == 4 and s["records"] == 21
    r = s["records_per_user"]
    assert (r["min"], r["median"], r["max"]) == (5, 5.0, 6) and r["mean"] == pytest.approx(21 / 4)
    assert {"p90", "p99"} <= set(r)
    assert s["characters"] == sum(len(f"post {i} " * (1 + i % 3)) for i in range(21)) - 0  # stored as given
    expect_tokens = sum(len(tok.encode(f"post {i} " * (1 + i % 3), add_special_tokens=False).ids) for i in range(21))
    assert s["tokens"] == expect_tokens
    assert s["dropped"] == {"empty_or_whitespace_text": 1, "users_left_with_no_records": 1}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stats_text_prints_drops(jsonl, capsys):
    assert main(["data", "stats", str(jsonl)]) == 0
    out = capsys.readouterr().out
    assert "users:      4" in out and "dropped 1: empty_or_whitespace_text" in out


def test_build_then_stats_on_store(jsonl, tmp_path, capsys):
    assert main(["data", "build", str(jsonl), "--out", str(tmp_path / "st")]) == 0
    capsys.readouterr()
    assert main(["data", "stats", str(tmp_path / "st"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["records"] == 21


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    p = tmp_path / "a.jsonl"
    p.write_text('{"author": "x", "text": "y"}\n')
    assert main(["data", "stats", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "a.jsonl:line 1: missing user field 'user'" in err
    assert main(["data", "stats", str(p), "--user-field", "author", "--text-field", "body"]) == 2
    assert "missing text field 'body'" in capsys.readouterr().err
