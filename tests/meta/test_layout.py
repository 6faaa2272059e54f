"""The tests are laid out like the package, so a module's tests are found by its name: the unit
tests of ``userdp/<package>/`` sit in ``tests/<package>/``, those of a top-level module
``userdp/<module>.py`` in ``tests/test_<module>*.py``; the suites that cut across packages have
folders of their own, named here with what they hold."""

from _paths import REPO, TESTS

SRC = REPO / "src" / "userdp"

#: the folders that cut across packages, and what each holds
CROSS_CUTTING = {
    "guarantee": "the guarantee as properties: neighbour tests, released files, contracts",
    "bad_input": "the hostile catalogues: API, CLI, disk, bounds",
    "e2e": "whole jobs: the CLI's train, torchrun, the README's own-data journey",
    "meta": "the repository itself: layering, docs, the fast subset, the threat model's keys, the version",
    "benchmarks": "the scripts of benchmarks/ (and the GPU check) run small on the CPU",
    "hf": "the Hugging Face Trainer and TRL boundary (hf.py, hf_boundary.py, hf_trl.py)",
}


def test_every_test_folder_is_a_package_of_userdp_or_a_named_cross_cutting_suite():
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert folders - packages - set(CROSS_CUTTING) == set()
    assert not (packages & set(CROSS_CUTTING))  # a folder's name says one thing
    for folder in folders:
        assert list((TESTS / folder).glob("test_*.py")), f"tests/{folder} holds no tests"


def test_a_test_file_at_the_top_is_named_for_a_top_level_module():
    modules = {p.stem for p in SRC.glob("*.py") if not p.stem.startswith("_")}
    for f in TESTS.glob("test_*.py"):
        stem = f.stem.removeprefix("test_")
        assert any(stem == m or stem.startswith(m + "_") for m in modules), (
            f"tests/{f.name}: no userdp/{stem}.py; put it in the folder of the package it tests"
        )


def test_no_two_test_files_share_a_name():
    names = [f.name for f in TESTS.rglob("test_*.py")]
    assert len(names) == len(set(names))  # pytest imports them by their base names (no __init__.py)
