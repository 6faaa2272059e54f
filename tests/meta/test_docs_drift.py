"""Docs that cannot drift (issue 26): the contract table of docs/ARCHITECTURE.md against the code's
signatures (inspect.signature), its registries and paths against the modules, and the README's
Layout against src/userdp."""

import importlib
import inspect
import re
from pathlib import Path

import pytest
from _paths import REPO

ROOT = REPO
ARCH = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
README = (ROOT / "README.md").read_text()

#: the table's seam -> the classes (or modules) whose members its contract names
SEAMS = {
    "run plan": ["userdp.engine.plan:RunPlan", "userdp.engine.plan"],
    "mechanism": ["userdp.accounting.mechanism:Mechanism"],
    "accountant": ["userdp.accounting.accountants:PLDAccountant", "userdp.accounting.accountants:RDPAccountant"],
    "per-unit strategy": ["userdp.engine.per_unit:VmapPerUnit", "userdp.engine.ghost:GhostPerUnit"],
    "clipping": [
        "userdp.engine.clipping:FlatClip",
        "userdp.engine.clipping:PerLayerClip",
        "userdp.engine.clipping:AdaptiveClip",
    ],
    "noise mechanism": ["userdp.engine.noise.mechanism:IIDGaussian", "userdp.engine.noise.bandmf:BandMF"],
    "ledger": ["userdp.engine.ledger:PrivacyLedger"],
    "distribution": [
        "userdp.engine.distributed.distribution:Replicated",
        "userdp.engine.distributed.distribution:Sharded",
    ],
    "algorithm": ["userdp.engine.algorithms:ELS", "userdp.engine.algorithms:ULS", "userdp.engine.algorithms:FedAvg"],
}


def _obj(ref: str):
    mod, _, attr = ref.partition(":")
    m = importlib.import_module(mod)
    return getattr(m, attr) if attr else m


def _rows():
    rows = {}
    for line in ARCH.splitlines():
        m = re.match(r"\| \*\*(.+?)\*\* \| (.*) \| (.*) \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = m.groups()[1:]
    return rows


def _calls(text: str):
    """(name, [parameter names], the doc's return or None) of each backticked `name(params) -> R`
    in text (R: a type name, or a parenthesized tuple of names)."""
    for code in re.findall(r"`([^`]+)`", text):
        for m in re.finditer(r"([A-Za-z_][\w.]*)\(([^()]*)\)(?:\s*->\s*(\([^()]*\)|[\w.]+))?", code):
            name = m.group(1).split(".")[-1]
            inner = re.sub(r"\s*\[[^\]]*\]", "", m.group(2))  # shapes such as [m, L]
            params = [re.sub(r"\s*=.*", "", p).strip() for p in inner.split(",")]
            params = [p for p in params if p and p != "*"]
            yield name, params, m.group(3)


def _top_level_args(text: str) -> int:
    depth, n = 0, 1
    for ch in text:
        depth += ch in "[("
        depth -= ch in "])"
        n += ch == "," and depth == 0
    return n


def _return_mismatch(doc: str | None, annotation) -> str | None:
    """Why the doc's return disagrees with the code's annotation (None: it agrees, or either is
    absent). A name must be the annotation's (or its last dotted part, or its generic origin);
    a parenthesized tuple must be a ``tuple[...]`` of as many items."""
    if doc is None or annotation is inspect.Signature.empty:
        return None
    ann = str(annotation).strip("'\"").replace("typing.", "")
    if doc.startswith("("):
        items = re.sub(r"\s*\[[^\]]*\]", "", doc[1:-1])  # shapes such as [m, L]
        if not ann.startswith("tuple["):
            return f"the doc returns a tuple {doc}, the code {ann}"
        if _top_level_args(ann[len("tuple[") : -1]) != len([x for x in items.split(",") if x.strip()]):
            return f"the doc returns {doc}, the code {ann}"
        return None
    base = re.split(r"[\[|]", ann, maxsplit=1)[0].strip()
    if doc not in (ann, base, base.rsplit(".", 1)[-1]):
        return f"the doc returns {doc}, the code {ann}"
    return None


def test_every_seam_of_the_contract_table_is_checked():
    assert set(_rows()) == set(SEAMS)


@pytest.mark.parametrize("seam", sorted(SEAMS))
def test_the_contract_names_the_codes_members_and_parameters(seam):
    contract = _rows()[seam][0]
    objs = [_obj(r) for r in SEAMS[seam]]
    checked = 0
    for name, params, returns in _calls(contract):
        owners = [o for o in objs if hasattr(o, name)]
        assert owners, f"{seam}: the contract names {name}() but none of {SEAMS[seam]} has it"
        for owner in owners:
            sig = inspect.signature(getattr(owner, name))
            real = [p for p in sig.parameters if p not in ("self", "cls")]
            elided = "…" in params or "..." in params
            given = [p for p in params if p not in ("…", "...")]
            assert real[: len(given)] == given, (
                f"{seam}: {owner.__name__}.{name}{sig} vs the doc's ({', '.join(given)})"
            )
            if not elided:  # what the doc leaves out must be optional
                rest = [sig.parameters[p] for p in real[len(given) :]]
                assert all(
                    p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                    for p in rest
                ), f"{seam}: {owner.__name__}.{name}{sig}: the doc omits a required parameter"
            why = _return_mismatch(returns, sig.return_annotation)
            assert why is None, f"{seam}: {owner.__name__}.{name}: {why}"
            checked += 1
    assert checked >= 1


@pytest.mark.parametrize("seam", sorted(SEAMS))
def test_the_registries_and_files_the_table_names_exist(seam):
    _, registry, where = _rows()[seam]
    files = re.findall(r"`([\w/]+\.py)`", where)
    assert files
    for f in files:
        assert (ROOT / "src" / "userdp" / f).is_file(), f"{seam}: {f} does not exist"
    modules = [importlib.import_module("userdp." + f[:-3].replace("/", ".")) for f in files]
    for name in re.findall(r"`([A-Z_]{4,}|register_\w+|get_\w+)`", registry):
        assert any(hasattr(m, name) for m in modules), f"{seam}: {name} is not in {files}"


def _layout_paths(text: str, heading: str) -> list[str]:
    block = text.split(heading, 1)[1].split("```", 2)[1]
    return re.findall(r"^  ([\w./<>]+?/?)\s", block, re.M)


@pytest.mark.parametrize("doc, heading", [(README, "## Layout"), (ARCH, "# Architecture and contracts")])
def test_the_layouts_list_what_src_userdp_holds(doc, heading):
    listed = _layout_paths(doc, heading)
    src = ROOT / "src" / "userdp"
    for p in listed:
        if "<" in p:
            continue
        assert (src / p).exists(), f"the layout lists {p}, which src/userdp does not hold"
    tops = {p.split("/")[0].removesuffix(".py") for p in listed}
    actual = {
        q.stem if q.is_file() else q.name
        for q in src.iterdir()
        if (q.suffix == ".py" and q.stem not in ("__init__", "__main__"))
        or (q.is_dir() and (q / "__init__.py").exists())
    }
    assert actual <= tops, f"missing from the layout: {sorted(actual - tops)}"


def test_the_architecture_layout_names_every_module_of_each_package():
    # a package's line names its modules (issue 36: the engine's once listed 12 of its 20)
    block = ARCH.split("# Architecture and contracts", 1)[1].split("```", 2)[1]
    entries = re.split(r"^  (?=\S)", block, flags=re.M)
    src = ROOT / "src" / "userdp"
    for pkg in [q for q in src.iterdir() if q.is_dir() and (q / "__init__.py").exists() and q.name != "cli"]:
        text = next((e for e in entries if e.startswith(f"{pkg.name}/")), "")
        assert text, f"docs/ARCHITECTURE.md's layout has no line for {pkg.name}/"
        missing = sorted(
            m.stem for m in pkg.glob("*.py") if m.stem != "__init__" and not re.search(rf"\b{m.stem}\b", text)
        )
        assert not missing, f"docs/ARCHITECTURE.md's layout of {pkg.name}/ does not name {missing}"


# ------------------------------------------------------------------------------ every command shown
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: commands cheap enough to run as shown (the rest are parsed, and `train` also validates its config)
RUN_AS_SHOWN = {"account", "calibrate", "experiment", "cache", "data"}
#: the README's own-data recipe runs end to end in tests/e2e/test_user_journey.py
HEAVY = {"train", "audit", "tune", "pretrain", "evaluate", "report", "plan", "init"}


def _shown_commands():
    out = []
    for doc in DOCS:
        in_code = False
        for i, line in enumerate(doc.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                in_code = not in_code
                continue
            m = re.match(r"^\s*(?:\$ )?(userdp [a-z].*?)\s*(?:#.*)?$", line)
            if in_code and m:
                out.append((f"{doc.name}:{i}", m.group(1)))
    return out


SHOWN = _shown_commands()


def _is_synopsis(cmd: str) -> bool:
    return bool(re.search(r"[\[\]{}|]|\.\.\.|…|\b[A-Z][A-Z_]{1,}\b|<\w", cmd))


def test_the_docs_show_many_commands():
    assert len(SHOWN) >= 40 and sum(not _is_synopsis(c) for _, c in SHOWN) >= 20


def _subparser(argv: list[str]):
    from userdp.cli import build_parser

    parser = build_parser()
    for word in argv:
        subs = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
        if not subs or word not in subs[0].choices:
            break
        parser = subs[0].choices[word]
    return parser


@pytest.mark.parametrize("where, cmd", [(w, c) for w, c in SHOWN if _is_synopsis(c)], ids=lambda x: str(x)[:60])
def test_a_synopsis_names_only_options_the_command_has(where, cmd):
    words = cmd.split()[1:]
    parser = _subparser([w for w in words if re.fullmatch(r"[a-z][a-z-]*", w)][:2])
    known = {o for a in parser._actions for o in a.option_strings}
    assert parser.prog != "userdp", f"{where}: {cmd}: no such command"
    for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", cmd):
        assert flag in known, f"{where}: `{cmd}` shows {flag}, which `{parser.prog}` does not have"


@pytest.mark.slow
@pytest.mark.usefixtures("isolated_registries")  # a command may load a plugin (--plugin)
@pytest.mark.parametrize("where, cmd", [(w, c) for w, c in SHOWN if not _is_synopsis(c)], ids=lambda x: str(x)[:60])
def test_a_command_shown_runs_or_parses(where, cmd, tmp_path, monkeypatch, capsys):
    import shlex
    import shutil

    from userdp.cli import main

    argv = shlex.split(cmd)[1:]
    if any("../shared/data" in a for a in argv) and not (ROOT.parent / "shared" / "data").is_dir():
        pytest.skip("needs ../shared/data")
    argv = [str(ROOT.parent / a[3:]) if a.startswith("../shared") else a for a in argv]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("USERDP_CACHE", str(tmp_path / "cache"))
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    if argv[0] in RUN_AS_SHOWN:
        assert main(argv) == 0, f"{where}: `{cmd}` failed: {capsys.readouterr().err[-800:]}"
        return
    assert argv[0] in HEAVY, f"{where}: {argv[0]} is neither run nor parsed here"
    from userdp.cli import build_parser

    args = build_parser().parse_args(argv)  # argparse exits (SystemExit) on an option that does not exist
    if argv[0] == "train" and not args.resume:
        made = [a for a in (getattr(args, "config", None), getattr(args, "plan", None)) if a and not Path(a).exists()]
        if made == ["c.yaml"]:  # ARCHITECTURE.md's plugin lines use a config named by the reader
            (tmp_path / "c.yaml").write_text("")
        elif made:  # files an earlier command of the recipe writes: tests/e2e/test_user_journey.py runs it
            pytest.skip(f"{made} are written by the README recipe's earlier commands (test_user_journey)")
        assert main(argv + ["--print-config"]) == 0, f"{where}: `{cmd}`: {capsys.readouterr().err[-800:]}"


def test_the_return_check_catches_a_wrong_name_and_a_wrong_tuple():
    assert _return_mismatch("list", "None")  # the drift the table once had (add_noise)
    assert _return_mismatch("(a, b)", "tuple[torch.Tensor, torch.Tensor, int]")
    assert _return_mismatch("(a, b)", "list[int]")
    assert _return_mismatch("(factors [m, L], flat norms [m])", "tuple[torch.Tensor, torch.Tensor]") is None
    assert (
        _return_mismatch("RunPlan", "'RunPlan'") is None and _return_mismatch("UnitTable", "userdp.UnitTable") is None
    )
    assert _return_mismatch("list", inspect.Signature.empty) is None  # unannotated: nothing to compare
