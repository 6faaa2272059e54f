"""One private cache for a project (issue 39): ``output.cache: FOLDER`` is shared by the runs,
plans and evaluations of one project, so the data is read and tokenized once; ``userdp evaluate``
reuses a ``cache: run`` run's own cache; ``userdp cache info`` counts both as private data at rest;
a folder that is not userdp's is refused."""

import json
from pathlib import Path

import pytest

from userdp.cli import main

from _fuzz_cases import _tiny_config  # noqa: E402

BUILD = "building the user store"


def _entries(folder: Path) -> set:
    return {p.name for p in folder.iterdir() if not p.name.startswith(".")} if folder.is_dir() else set()


def test_runs_of_a_project_share_one_private_cache_and_cache_info_counts_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("USERDP_CACHE", str(tmp_path / "home-cache"))
    proj = tmp_path / "proj-cache"
    cfg = _tiny_config(tmp_path, f"output:\n  cache: {proj}\n")
    assert main(["train", str(cfg), "--output", str(tmp_path / "r1")]) == 0
    first = capsys.readouterr().err
    stores, tokenized = _entries(proj / "stores"), _entries(proj / "tokenized")
    assert BUILD in first and stores and tokenized
    assert not (tmp_path / "home-cache" / "stores").exists()  # nothing private in the shared cache
    assert main(["train", str(cfg), "--output", str(tmp_path / "r2")]) == 0
    second = capsys.readouterr().err
    assert BUILD not in second  # read once ...
    assert _entries(proj / "stores") == stores and _entries(proj / "tokenized") == tokenized  # ... tokenized once
    assert main(["evaluate", str(tmp_path / "r2")]) == 0
    assert BUILD not in capsys.readouterr().err and _entries(proj / "stores") == stores
    assert main(["cache", "info", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    local = {x["path"]: x["bytes"] for x in rep["local"]}
    assert local.get(str(proj.resolve()), 0) > 0 and rep["private_bytes"] >= local[str(proj.resolve())]
    assert main(["cache", "info"]) == 0
    assert f"PRIVATE: {proj.resolve()}" in capsys.readouterr().out


def test_evaluate_reuses_a_runs_own_cache(tmp_path, capsys):
    cfg = _tiny_config(tmp_path, "output:\n  cache: run\n")
    run = tmp_path / "run"
    assert main(["train", str(cfg), "--output", str(run)]) == 0
    capsys.readouterr()
    before = _entries(run / "cache" / "tokenized")
    assert main(["evaluate", str(run)]) == 0
    assert BUILD not in capsys.readouterr().err and _entries(run / "cache" / "tokenized") == before


def test_a_cache_folder_that_is_not_userdps_is_refused(tmp_path, capsys):
    mine = tmp_path / "thesis"
    mine.mkdir()
    (mine / "chapter1.tex").write_text("years of work")
    afile = tmp_path / "notes.txt"
    afile.write_text("x")
    for where, says in ((mine, "holds files userdp did not make"), (afile, "is not a folder")):
        cfg = _tiny_config(tmp_path, f"output:\n  cache: {where}\n", name=f"c-{where.name}.yaml")
        assert main(["train", str(cfg), "--output", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert "output.cache" in err and says in err and len(err.strip().splitlines()) == 1
        assert cfg.name in err  # the config file is named (not the folder in its place)
    assert [p.name for p in mine.iterdir()] == ["chapter1.tex"] and afile.read_text() == "x"


@pytest.mark.parametrize(
    "slip, keyword", [("Run", "run"), ("RUN", "run"), ("runs", "run"), ("Shared", "shared"), ("shard", "shared")]
)
def test_a_slip_for_a_cache_keyword_is_refused_not_made_into_a_folder(tmp_path, monkeypatch, slip, keyword):
    """`output.cache: Run` (a slip for `run`) silently put the private store in a new ./Run folder.
    A bare name close to a keyword is refused with the keyword; written as a path it is a folder."""
    from userdp.errors import UserError
    from userdp.lm import config as C

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=f"did you mean {keyword}.*\\./{slip}"):
        C.load_config(None, [f"output.cache={slip}"])
    assert not (tmp_path / slip).exists()
    assert C.load_config(None, [f"output.cache=./{slip}"]).output.cache == f"./{slip}"
    assert C.load_config(None, ["output.cache=project-cache"]).output.cache == "project-cache"
