"""docs/threat_model.md lists exactly what each released file carries (issue 34, the systemic
part): a job is run, and the keys of its metrics.jsonl, privacy.json, report.json, eval.json and
state.json must be the keys the document names for each file — no more (an unlisted key is a
release nobody classified), no fewer (a listed key that is gone is a stale statement)."""

import json
import re
from pathlib import Path

import pytest
from _paths import REPO

from userdp.cli import main

from _lm_corpus import write_tiny_run

DOC = (REPO / "docs" / "threat_model.md").read_text()


def _documented() -> dict[str, set[str]]:
    block = DOC.split("<!-- released-keys: begin -->")[1].split("<!-- released-keys: end -->")[0]
    items = re.split(r"\n- ", "\n" + block.strip())
    out = {}
    for item in filter(None, items):
        name = re.match(r"`([^`]+)`", item).group(1)
        out[name] = set(re.findall(r"`([a-z_]+)`", item.split(":", 1)[1]))
    return out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keys")
    cfg = write_tiny_run(tmp, "", name="cfg.yaml")[0]
    mp = pytest.MonkeyPatch()
    mp.setenv("USERDP_CACHE", str(tmp / "cache"))
    mp.chdir(tmp)
    try:
        assert main(["train", str(cfg), "--output", str(tmp / "run"), "--no-progress"]) == 0
    finally:
        mp.undo()
    return tmp / "run"


def _keys(run: Path) -> dict[str, set[str]]:
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    state = json.loads((run / "state.json").read_text())
    return {
        "metrics.jsonl": set().union(*map(set, rows)),
        "privacy.json": set(json.loads((run / "privacy.json").read_text())),
        "report.json": set(json.loads((run / "report.json").read_text())),
        "eval.json": set(json.loads((run / "eval.json").read_text())),
        "state.json": set(state) | set(state["summary"]),
    }


def test_the_threat_model_names_every_key_each_released_file_carries(run_dir):
    doc, got = _documented(), _keys(run_dir)
    assert set(doc) == {"metrics.jsonl", "privacy.json", "eval.json", "state.json"}
    # report.json is privacy.json plus the keys the document names beside it
    extra = {"epsilon_run", "at_reference_delta", "evaluation", "status"}
    assert extra <= set(re.findall(r"`([a-z_]+)`", DOC.split("`report.json` is the same record plus")[1][:300]))
    expected = dict(doc, **{"report.json": doc["privacy.json"] | extra})
    # state.json's summary repeats privacy.json's figures: the document names those once, in privacy.json
    expected["state.json"] = doc["state.json"] | (got["state.json"] & doc["privacy.json"])
    for name, keys in expected.items():
        assert got[name] - keys == set(), f"{name} carries keys docs/threat_model.md does not list"
        assert keys - got[name] == set(), f"docs/threat_model.md lists keys {name} no longer carries"
