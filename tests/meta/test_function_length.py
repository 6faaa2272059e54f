"""Functions over 80 lines, counted by a test instead of by a reviewer's script: no new one, and
none of those left from before grows. Each listed function is a debt with its length at the time it
was listed; splitting one below 80 lines means taking it off the list (the test says so). ruff has
no rule for a function's length (its statement count, PLR0915, counts another thing), so this
stays a test. Lines are a definition's own, its docstring included."""

import ast

from _paths import REPO

LIMIT = 80
#: the functions over LIMIT lines at 0.6.0, and their lengths then (they may shrink, never grow)
LONG = {
    "userdp/lm/report.py:render_markdown": 204,
    "userdp/lm/statement.py:privacy_record": 174,
    "userdp/data/store.py:build_store": 156,
    "userdp/lm/training.py:train_model": 125,
    "userdp/cli/train.py:main": 121,
    "userdp/lm/config.py:validate": 108,
    "userdp/lm/starting_model.py:get_tokenizer_and_model": 105,
    "userdp/lm/pretrain.py:train_lm": 100,
    "userdp/audit/session.py:finish": 100,
    "userdp/planning/budget_plan.py:plan_for_budget": 98,
    "userdp/audit/session.py:attach": 98,
    "userdp/lm/release.py:release": 87,
    "userdp/tuning/job.py:new_tuning": 84,
    "userdp/cli/experiment.py:_run_mean_estimation": 82,
}


def _lengths() -> dict[str, int]:
    src = REPO / "src"
    out: dict[str, int] = {}
    for path in sorted((src / "userdp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                key = f"{path.relative_to(src).as_posix()}:{node.name}"
                out[key] = max(out.get(key, 0), node.end_lineno - node.lineno + 1)
    return out


def test_no_function_grows_past_80_lines_and_none_listed_grows():
    lengths = _lengths()
    new = {k: n for k, n in lengths.items() if n > LIMIT and k not in LONG}
    assert not new, f"functions over {LIMIT} lines: {new}; split them (a step a function)"
    grown = {k: (LONG[k], lengths[k]) for k in LONG if lengths.get(k, 0) > LONG[k]}
    assert not grown, f"listed functions grew (listed, now): {grown}"


def test_the_list_holds_only_functions_still_over_the_limit():
    lengths = _lengths()
    paid = sorted(k for k in LONG if lengths.get(k, 0) <= LIMIT)
    assert not paid, f"{paid}: now at most {LIMIT} lines (or gone): take them off LONG"
