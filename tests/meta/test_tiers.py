"""The heavy tier (``@pytest.mark.heavy``, skipped unless ``--heavy``) keeps CI's ``.ci/run`` within
its 10 minutes on 2 cores. A test goes there only with a counterpart: a test of the default run,
named in the mark, that checks the same property in one process (or at a smaller size). Nothing
of the guarantee's own suites, or of these meta-tests, is heavy."""

import ast
import re

import conftest
import pytest
from _paths import REPO, TESTS

HEAVY = re.compile(r"mark\.heavy\b")


def _heavy_marks() -> list[tuple[str, str, str | None, bool]]:
    """(file, test function, counterpart, on the whole function) for each heavy mark in tests/."""
    found = []
    for f in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(f.read_text())
        consts = {
            t.id: n.value.value
            for n in tree.body
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")):
            for d in fn.decorator_list:
                for call in (c for c in ast.walk(d) if isinstance(c, ast.Call) and HEAVY.search(ast.unparse(c.func))):
                    kw = {k.arg: k.value for k in call.keywords}
                    cp = kw.get("counterpart")
                    value = cp.value if isinstance(cp, ast.Constant) else consts.get(getattr(cp, "id", None))
                    found.append((str(f.relative_to(REPO)), fn.name, value, d is call))
        for n in tree.body:  # a module-wide mark would hide a whole file from CI
            if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets):
                assert not HEAVY.search(ast.unparse(n.value)), f"{f}: a whole module in the heavy tier"
    return found


def test_each_heavy_test_names_a_default_tier_counterpart_that_exists():
    marks = _heavy_marks()
    assert len(marks) >= 20  # the tier this file describes (a renamed mark would empty it)
    whole = {(f, fn) for f, fn, _, on_function in marks if on_function}
    for f, fn, counterpart, _ in marks:
        assert counterpart, f"{f}::{fn}: heavy without counterpart= (the default-tier test of its property)"
        path, _, name = counterpart.partition("::")
        func = name.split("[")[0]
        target = REPO / path
        assert target.is_file() and re.search(rf"^def {func}\(", target.read_text(), re.M), (
            f"{f}::{fn}: its counterpart {counterpart} is not a test"
        )
        assert (path, func) not in whole, f"{f}::{fn}: its counterpart {counterpart} is itself heavy"
        assert (path, func) != (f, fn) or "[" in name, f"{f}::{fn}: a test cannot be its own counterpart"


def test_the_guarantee_suites_and_the_meta_tests_are_never_heavy():
    for f, fn, _, _ in _heavy_marks():
        assert not f.startswith(("tests/guarantee/", "tests/meta/")), f"{f}::{fn} must run in CI"


class _Item:
    """A collected test as the tier's hook sees it: its marks, and the ones the hook adds."""

    def __init__(self, heavy: bool):
        self.marks = [pytest.mark.heavy(counterpart="x").mark] if heavy else []

    def get_closest_marker(self, name):
        return next((m for m in self.marks if m.name == name), None)

    def add_marker(self, mark):
        self.marks.append(mark.mark)


class _Config:
    def __init__(self, heavy: bool):
        self.heavy = heavy

    def getoption(self, name):
        assert name == "--heavy"
        return self.heavy


def test_the_heavy_tier_is_skipped_with_its_command_and_runs_under_heavy():
    for heavy_option in (False, True):
        items = [_Item(True), _Item(False)]
        conftest.pytest_collection_modifyitems(_Config(heavy_option), items)
        skips = [[m for m in it.marks if m.name == "skip"] for it in items]
        assert skips[1] == []  # the default tier is never skipped by it
        if heavy_option:
            assert skips[0] == []
        else:
            (skip,) = skips[0]
            assert "python -m pytest -q -n auto --heavy" in skip.kwargs["reason"]
    assert "--heavy" in (REPO / ".ci" / "heavy").read_text() and "--heavy" not in (REPO / ".ci" / "run").read_text()
