"""The fast subset (`python -m pytest -q -m "not slow"`, under 2 minutes on 2 cores; README) must
still reach every module of src/userdp: the tests it keeps import, directly or through the
package's own imports, each module at least once (issue 28)."""

import ast

from _paths import TESTS
from test_import_structure import SRC, _imports, _resolve


def _is_slow(decorators) -> bool:
    """Marked slow, or heavy (the heavy tier is skipped unless --heavy)."""
    return any("slow" in (u := ast.unparse(d)) or "heavy" in u for d in decorators)


def _fast_imports() -> tuple[set[str], int]:
    """The userdp modules the fast tests import (module level of a file with a fast test, and
    inside the fast test functions), and how many fast tests there are."""
    found, fast = set(), 0
    for f in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(f.read_text())
        module_slow = any(
            isinstance(n, ast.Assign)
            and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
            and ("slow" in (u := ast.unparse(n.value)) or "heavy" in u)
            for n in tree.body
        )
        funcs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
        kept = [fn for fn in funcs if not module_slow and not _is_slow(fn.decorator_list)]
        fast += len(kept)
        scopes = (
            [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))] if kept or not funcs else []
        ) + [n for fn in kept for n in ast.walk(fn)]
        for node in scopes:
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            found.update(r for n in names if n.startswith("userdp") and (r := _resolve(n)))
    return found, fast


def test_the_fast_subset_reaches_every_module():
    graph = _imports()
    from userdp.cli import COMMANDS  # the CLI imports its commands by name (importlib)

    graph.setdefault("userdp.cli", set()).update(f"userdp.cli.{m}" for m in COMMANDS)
    reached, fast = _fast_imports()
    assert fast >= 300  # test functions (parametrized, they are more tests)
    todo = list(reached)
    while todo:
        m = todo.pop()
        for parent in [m.rsplit(".", i)[0] for i in range(1, m.count(".") + 1)]:  # a package's __init__ runs too
            if parent not in reached:
                reached.add(parent)
                todo.append(parent)
        for d in graph.get(m, ()):
            if d not in reached:
                reached.add(d)
                todo.append(d)
    modules = {".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__") for p in SRC.rglob("*.py")}
    missed = sorted(modules - reached - {"userdp.__main__"})
    assert missed == [], f"no fast test reaches {missed}: keep one of their tests out of the slow mark"
