"""One version, said the same everywhere: pyproject.toml, ``userdp.__version__``, ``userdp --version``,
the installed metadata (what every privacy.json names), and CHANGELOG.md's newest entry."""

import importlib.metadata as md
import re

from _paths import REPO

import userdp
from userdp.cli import main as cli
from userdp.lm.statement import library_versions


def test_the_version_is_one_and_the_changelog_says_what_changed_in_it(capsys):
    declared = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert userdp.__version__ == declared == md.version("userdp") == library_versions()["userdp"]
    try:
        cli(["--version"])
    except SystemExit:
        pass
    assert capsys.readouterr().out.strip() == f"userdp {declared}"
    newest = re.search(r"^## (\S+)", (REPO / "CHANGELOG.md").read_text(), re.M).group(1)
    assert newest == declared
