"""Data flows down (CLI -> job -> phases -> engine -> accounting), never back up: every import in
src/userdp, at any depth (a function-level import counts too), is checked against the layers
below, and no modules import each other in a loop (issue 26: engine/chacha<->noise,
engine/ghost<->per_unit and lm->audit were hidden by function-level imports)."""

import ast
from pathlib import Path

from _paths import REPO

SRC = REPO / "src"

#: lower may not import higher; a module's layer is its most specific entry
LAYERS = {
    "userdp": 0,
    "userdp.errors": 0,
    "userdp.fileio": 0,
    "userdp.validation": 0,
    "userdp.keyed_hash": 0,
    "userdp.accounting": 1,
    "userdp.data": 2,
    "userdp.engine": 3,
    # the engine's data contract, implemented over a user store; devices pick an engine precision
    "userdp.data.torch_data": 4,
    "userdp.data.selection": 4,
    "userdp.devices": 4,
    "userdp.world": 4,
    "userdp.planning": 4,
    "userdp.lm": 5,
    "userdp.audit": 6,
    "userdp.tuning": 6,
    "userdp.experiments": 6,
    "userdp.hf": 6,  # the Trainer integration: on the engine and the LM models
    "userdp.hf_boundary": 6,  # the Trainer's inputs, checked (the engine's journal name among them)
    "userdp.hf_trl": 7,  # TRL's SFTTrainer on userdp.hf
    "userdp.hf_plan": 7,  # planning over a Trainer's dataset, on userdp.hf
    "userdp.hf_inputs": 7,  # a `userdp train` run's inputs for a Trainer, by the LM job's phases
    # --nproc: the CLI's process starter (its workers run the CLI again); it reads devices via launch
    "userdp.cli": 7,
    "userdp.launcher": 7,
    "userdp.__main__": 8,
}


def _module(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str) -> str:
    """The module a dotted import names (``from a.b import c`` may import the module a.b.c)."""
    while name and not (
        (SRC / name.replace(".", "/")).with_suffix(".py").is_file()
        or (SRC / name.replace(".", "/") / "__init__.py").is_file()
    ):
        name = name.rpartition(".")[0]
    return name


def _imports() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in SRC.rglob("*.py"):
        mod = _module(f)
        deps = out.setdefault(mod, set())
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            deps.update(r for n in names if n.startswith("userdp") and (r := _resolve(n)) and r != mod)
    return out


def _layer(mod: str) -> int:
    while mod not in LAYERS:
        mod = mod.rpartition(".")[0]
    return LAYERS[mod]


def test_no_import_runs_back_up_a_layer():
    graph = _imports()
    assert len(graph) > 80 and "userdp.lm.finetune" in graph
    up = sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps if b != "userdp" and _layer(b) > _layer(a))
    assert up == []


def test_no_modules_import_each_other_in_a_loop():
    graph = {a: {b for b in deps if b != "userdp" and not a.startswith(b + ".")} for a, deps in _imports().items()}
    index, low, stack, on, loops = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                loops.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    assert loops == []


def test_the_checks_see_function_level_imports():
    # the LM job reaches the audit only through hooks the CLI passes (finetune.run(audit=...))
    graph = _imports()
    assert "userdp.audit.session" in graph["userdp.cli.audit"]  # a function-level import, seen
    assert not any(d.startswith("userdp.audit") for d in graph["userdp.lm.finetune"])
